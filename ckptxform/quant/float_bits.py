"""Float bit primitives the dequant kernels and their tables share: the one quiet NaN of each
output dtype, e4m3 decoding by a bit trick, NVFP4's group scales and a per-thread scratch
buffer. A leaf: the dispatcher (``kernels``), the backends and the tables import it, it
imports none of them. numpy is imported when a function runs, so importing it costs
nothing to ``validate`` or ``plan``.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

Buffer = bytes | bytearray | memoryview

#: per output dtype: the unsigned view, the bits below the sign, the infinity's bits, a quiet NaN
NAN_BITS = {"BF16": ("<u2", 0x7FFF, 0x7F80, 0x7FC0), "F16": ("<u2", 0x7FFF, 0x7C00, 0x7E00),
            "F32": ("<u4", 0x7FFFFFFF, 0x7F800000, 0x7FC00000)}


def quiet_nans(out: np.ndarray, out_dtype: str) -> None:
    """Make every NaN of ``out`` (``out_dtype`` values, any view) the dtype's one quiet NaN, in place."""
    view, magnitude, inf, nan = NAN_BITS[out_dtype]
    bits = out.view(view)
    bits[(bits & magnitude) > inf] = nan


def np_errors_ignored() -> Any:
    import numpy as np

    return np.errstate(all="ignore")


def e4m3_values(raw: Buffer) -> np.ndarray:
    """float32 values of e4m3fn bytes, exactly (NaN for 0x7F/0xFF): a lookup in the 256
    values ``decode_e4m3`` makes, not ml_dtypes' cast (importing ml_dtypes took 1.0-1.2 s
    of a 0.5 GB NVFP4 run here)."""
    import numpy as np

    return e4m3_table()[np.frombuffer(raw, dtype=np.uint8)]


@functools.cache
def e4m3_table() -> np.ndarray:
    """The float32 values of the 256 e4m3fn bytes, by byte (NaN for 0x7F/0xFF), read-only."""
    import numpy as np

    codes = np.arange(256, dtype=np.uint8)
    values = decode_e4m3(codes.view(np.int8), (codes | np.uint8(0x80)) == np.uint8(0xFF)) * np.float32(2.0 ** 120)
    values.flags.writeable = False
    return values


def decode_e4m3(raw: np.ndarray, nan: np.ndarray | None) -> np.ndarray:
    """float32 values of e4m3fn bytes (given as int8) TIMES 2**-120, exactly, in this
    thread's scratch buffer: three vectorised integer passes (a 256-entry table lookup is
    5x slower in numpy).

    Sign-extended to int32 and shifted left by 20, a byte's sign lands in bit 31 (bits
    27-31 are copies of it) and its exponent and mantissa in bits 23-26 and 20-22: masked,
    that is the float32 of the same value times 2**-120 (subnormals included, as the two
    formats' subnormals differ by the same power of two). ``nan`` marks the NaN bytes
    0x7F/0xFF (found by ``kernels``), set to NaN.
    """
    import numpy as np

    bits = scratch(raw.size, np.int32)
    np.copyto(bits, raw)
    bits <<= 20
    bits &= E4M3_MASK
    values = bits.view(np.float32)
    if nan is not None:
        values[nan] = np.nan
    return values


#: sign bit and the 7 bits of exponent+mantissa, after the shift (as a signed int32)
E4M3_MASK = 0x87F00000 - (1 << 32)

_local = threading.local()


def scratch(n: int, dtype: Any) -> np.ndarray:
    """A buffer of ``n`` elements owned by this thread, reused across blocks: a fresh
    allocation per block would page-fault its way through every byte again."""
    import numpy as np

    buf = getattr(_local, "buf", None)
    nbytes = n * np.dtype(dtype).itemsize
    if buf is None or buf.size < nbytes:
        buf = _local.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes].view(dtype)


def nvfp4_scales(scale: Buffer, global_scale: float, *, divide: bool) -> bytes:
    """The F32 scale of each NVFP4 group: the e4m3 ``scale`` bytes widened (exact), then
    divided by (compressed-tensors) or multiplied by (ModelOpt) the float32 ``global_scale``,
    rounded once to float32: what both libraries compute before the codes are scaled."""
    import numpy as np

    s = e4m3_values(scale)
    g = np.float32(global_scale)
    with np_errors_ignored():
        return (s / g if divide else s * g).astype(np.float32).tobytes()
