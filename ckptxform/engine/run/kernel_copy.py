"""Copying a source file's bytes into an output file inside the kernel: cloned where the
filesystem shares extents, copied elsewhere.

On XFS with reflink and on btrfs, ``FICLONERANGE`` makes the output's blocks point at the
source's (copy-on-write: a later write to either file leaves the other alone), so a rename
costs no data I/O and no space. It takes whole blocks at the same offset modulo the block
size in both files (the layout lines tensors up: engine/plan/layout.py), so a run's
block-aligned middle is cloned and its edges copied (``copy_file_range``, or plain reads
and writes where even that is missing). Where cloning is refused (ext4, tmpfs, another
filesystem, unaligned), the first refusal turns it off for that pair of files.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
from pathlib import Path

from ckptxform.errors import CheckpointFormatError

from ..plan.layout import CLONE_BLOCK

#: ioctl FICLONERANGE: _IOW(0x94, 13, struct file_clone_range {s64 src_fd; u64 src_offset,
#: src_length, dest_offset})
_FICLONERANGE = 0x4020940D
#: bytes copied at once where the kernel cannot copy
_COPY_BLOCK = 8 << 20
#: what copy_file_range fails with where it cannot copy (then: reads and writes)
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def truncated(path: Path, offset: int) -> CheckpointFormatError:
    return CheckpointFormatError(f"source file {str(path)!r} ended at byte {offset}, inside a tensor its "
                                 "header lists; was it truncated or rewritten during the run?")


def clone_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int) -> bool:
    """Share ``length`` bytes (whole blocks, both offsets block-aligned) of ``src`` as
    ``dst``'s; False where the filesystem refuses (no reflink, another filesystem)."""
    if not sys.platform.startswith("linux"):
        return False
    import fcntl

    try:
        fcntl.ioctl(dst, _FICLONERANGE, struct.pack("=qQQQ", src, src_offset, length, dst_offset))
    except OSError:  # EOPNOTSUPP, EXDEV, EINVAL, ENOTTY...: the copy says what else is wrong
        return False
    return True


class KernelCopier:
    """Copies runs between files, cloning what it can; ``cloned``: the bytes it cloned."""

    def __init__(self) -> None:
        #: (source fd, output fd) pairs whose filesystem refused a clone
        self._refused: set[tuple[int, int]] = set()
        self.cloned = 0

    def copy(self, src: int, src_offset: int, dst: int, dst_offset: int, length: int, src_path: Path) -> int:
        """Copy ``length`` bytes of ``src`` (``src_path`` names it) into ``dst``; the bytes cloned."""
        head = -dst_offset % CLONE_BLOCK
        middle = (length - head) // CLONE_BLOCK * CLONE_BLOCK if length > head else 0
        if (middle and (src_offset + head) % CLONE_BLOCK == 0 and (src, dst) not in self._refused):
            if clone_range(src, src_offset + head, dst, dst_offset + head, middle):
                _copy_range(src, src_offset, dst, dst_offset, head, src_path)
                done = head + middle
                _copy_range(src, src_offset + done, dst, dst_offset + done, length - done, src_path)
                self.cloned += middle
                return middle
            self._refused.add((src, dst))
        _copy_range(src, src_offset, dst, dst_offset, length, src_path)
        return 0


def _copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int, src_path: Path) -> None:
    """Copy bytes between files in the kernel; plain reads and writes where it cannot
    (another filesystem, an old kernel, or no copy_file_range at all: macOS)."""
    kernel_copy = getattr(os, "copy_file_range", None)
    while length:
        n = 0
        if kernel_copy is not None:
            try:
                n = kernel_copy(src, dst, length, src_offset, dst_offset)
            except OSError as err:
                if err.errno not in _NO_KERNEL_COPY:
                    raise
        if n == 0:  # not supported here (or EOF): copy the rest through a buffer
            block = os.pread(src, min(length, _COPY_BLOCK), src_offset)
            if not block:
                raise truncated(src_path, src_offset)
            n = os.pwrite(dst, block, dst_offset)
        src_offset += n
        dst_offset += n
        length -= n
