"""Non-finite dequantized values, refused where a block is decoded.

A NaN or inf scale, an e4m3 NaN byte (0x7F/0xFF), or a scale so large that the product
overflows makes dequantized values non-finite; written silently they poison every
activation that reads them. ``checked`` wraps one block's computation so that the first
non-finite value of a tensor is an error naming the tensor and its index, unless the rule
allows them (``allow_nonfinite: true``). It runs on the worker thread that computed the
block. The output is scanned only when the inputs can make a non-finite value (a scale
that is not finite or is too large, a NaN byte): integer reductions over the scales and
the codes cost a few percent of the kernel, a float scan of the output several times it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CheckpointFormatError
from .kernels import Buffer, tensor_view

#: the largest finite value of each output dtype
_LARGEST = {"BF16": 3.3895313892515355e38, "F16": 65504.0, "F32": 3.4028234663852886e38}


def checked(compute: Callable[[], memoryview], *, dtype: str, cols: int, first_row: int, what: str,
            scale: Buffer, scale_dtype: str, largest_code: float,
            e4m3_codes: Buffer | None = None) -> Callable[[], memoryview]:
    """``compute`` (the output bytes of rows from ``first_row`` of a ``cols``-column tensor,
    codes of magnitude at most ``largest_code`` times ``scale``), raising
    CheckpointFormatError at its first non-finite value; ``what`` starts the message."""

    def run() -> memoryview:
        out = compute()
        if not _may_be_nonfinite(scale, scale_dtype, largest_code, dtype, e4m3_codes):
            return out
        bad = first_nonfinite(out, dtype)
        if bad is not None:
            index, value = bad
            row, col = divmod(index, cols)
            raise CheckpointFormatError(
                f"{what} gives {value} at [{first_row + row}, {col}], a non-finite value from a NaN or inf "
                "scale or a NaN byte of the source; fix the source, or add allow_nonfinite: true to the op "
                "to write such values")
        return out
    return run


def _may_be_nonfinite(scale: Buffer, scale_dtype: str, largest_code: float, dtype: str,
                      e4m3_codes: Buffer | None) -> bool:
    import numpy as np

    if e4m3_codes is not None and len(e4m3_codes):
        codes = tensor_view(e4m3_codes, "I8", (-1,))
        if int(codes.max()) == 0x7F or int(codes.view(np.uint8).max()) == 0xFF:  # a NaN byte
            return True
    if not len(scale):
        return False
    from .numpy_kernels import as_float32

    magnitude = float(np.abs(as_float32(scale, scale_dtype)).max())  # exact
    # NaN compares false: caught below
    # a margin for the roundings of the product: a false alarm only costs the scan
    return not magnitude * largest_code * 1.01 < _LARGEST[dtype]


def first_nonfinite(raw: Buffer, dtype: str) -> tuple[int, float] | None:
    """(flat index, value) of the first NaN or inf of ``raw`` (``dtype`` values), if any."""
    import numpy as np

    from .numpy_kernels import as_float32

    values = as_float32(raw, dtype)  # exact; only scanned when suspect
    finite = np.isfinite(values)
    if bool(finite.all()):
        return None
    index = int(np.argmin(finite))
    return index, float(values[index])
