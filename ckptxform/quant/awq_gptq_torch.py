"""torch's sub-band kernel of the AWQ/GPTQ dequantization (quant/awq_gptq.py dispatches to it
where torch is installed): its float16 and bfloat16 conversions are vectorised, 5-8x numpy's
here. Same bytes as the numpy kernel."""

from __future__ import annotations

import numpy as np
import torch

from ..dtypes import torch_dtype


def scaled_into(out: np.ndarray, codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int,
                scale_dtype: str, out_dtype: str) -> None:
    """``out`` (bytes ``[k, rows * size]``) = ``(codes - zeros) * scales`` per ``group`` rows
    (``zeros`` int16 and ``scales`` the scale dtype's bits, ``[k, rows / group]``): the codes
    and zero points are small integers, exact in the scale's dtype, so the product is the
    references' one rounding there; then cast."""
    sdtype = torch_dtype(scale_dtype)
    values = torch.from_numpy(codes).to(sdtype)
    z = torch.from_numpy(zeros).to(sdtype)
    s = torch.from_numpy(scales).view(sdtype)
    values.view(values.shape[0], -1, group).sub_(z[:, :, None]).mul_(s[:, :, None])
    torch.from_numpy(out).view(torch_dtype(out_dtype)).copy_(values)
