"""Quantized checkpoint formats: the exact block kernels (``kernels``) that turn FP8
block-scaled and int4 pack-quantized weights into floating point, a block of rows at a
time."""
