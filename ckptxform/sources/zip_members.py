"""One member of a ``torch.save`` zip archive, read with bounds.

``torch.save`` writes every member stored (uncompressed) and unencrypted; a damaged or
crafted archive may claim encryption, an unknown method, or a deflate stream that inflates
a thousandfold. ``read_member`` reads what is there as one ``CheckpointFormatError`` for
any of those (never zipfile's ``RuntimeError``, ``zlib.error`` or ``NotImplementedError``),
and stops inflating at ``limit`` bytes whatever the header claims.
"""

from __future__ import annotations

import zipfile
import zlib

from ckptxform.errors import CheckpointFormatError, quote

#: what zipfile raises for a damaged member: a bad CRC or header, a broken deflate stream,
#: an encrypted member ("password required"), a method it has no decoder for
_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, NotImplementedError, ValueError)


def read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, *, label: str, what: str) -> bytes:
    """The bytes of member ``info`` of ``archive`` (at most ``limit``); ``label`` (the file)
    and ``what`` ("a torch.save'd DCP chunk") word the errors."""
    if info.flag_bits & 0x1:
        raise damaged_archive(label, what, f"its member {quote(info.filename)} is marked encrypted, which torch.save never "
                                    "writes")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise damaged_archive(label, what, f"its member {quote(info.filename)} is compressed with method "
                                    f"{info.compress_type}, which torch.save never writes")
    if info.file_size > limit:
        raise damaged_archive(label, what, f"its member {quote(info.filename)} claims {info.file_size:,} bytes, more than "
                                    f"the {limit:,} such a record may hold")
    try:
        with archive.open(info) as member:
            data = member.read(limit + 1)
    except CheckpointFormatError:
        raise
    except _DAMAGED as exc:
        raise damaged_archive(label, what, f"its member {quote(info.filename)} cannot be read ({type(exc).__name__}: "
                                    f"{str(exc)[:120]})") from None
    if len(data) > limit:
        raise damaged_archive(label, what, f"its member {quote(info.filename)} inflates to more than the {limit:,} bytes "
                                    "such a record may hold")
    return data


def damaged_archive(label: str, what: str, why: str) -> CheckpointFormatError:
    """The error for an archive ``label`` that is not ``what`` as torch.save writes it: ``why``."""
    return CheckpointFormatError(f"{label}: is not {what} as torch.save writes it: {why}; the file is damaged or "
                                 "hostile: copy it again from where it was saved", path=label)
