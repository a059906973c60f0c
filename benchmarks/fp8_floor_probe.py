"""The FP8 block dequant as a bare pipeline: the floor of ckptxform's design on a machine.

    python benchmarks/fp8_floor_probe.py SRC OUT

What ``ckptxform apply rules/fp8_block_to_bf16.yaml`` does to a DeepSeek-style FP8 checkpoint
(SRC: safetensors shards, an index, ``X.weight`` e4m3 with its float32 ``X.weight_scale_inv``
of ``weight_block_size`` blocks), with nothing else: one thread reads a block of rows (``pread``) and
decodes it with ckptxform's own kernel (quant/tables.py), a second hashes it (BLAKE3, a MiB
at a time) and ``pwrite``s it into OUT's shard, at most two blocks behind; other tensors are
copied by ``copy_file_range``. No rule, plan, audit, index, config, checks or commit, so its
output is not a checkpoint anyone should load: it is the bytes and the work, to measure
what the rest of ckptxform costs (``dequant_bench.py --contenders 'floor probe'``). The
apply itself decodes two blocks at once, each hashed and written by its own thread in turn
(quant/pipeline.py ``then_in_order``); this probe arranged that way took the same time.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import sys
import threading
from pathlib import Path

from blake3 import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptxform.quant import tables  # noqa: E402
from ckptxform.quant.layouts import Fp8Block  # noqa: E402

#: the output bytes of a block at most (ops/dequant.py's FP8_CHUNK_BYTES)
CHUNK = 2 << 20
PIECE = 1 << 20
SIZES = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "U8": 1, "I8": 1}


def header(fd: int) -> tuple[dict[str, dict], int]:
    n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
    return json.loads(os.pread(fd, n, 8)), 8 + n


def main(src: Path, dst: Path) -> None:
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    bh, bw = json.loads((src / "config.json").read_text())["quantization_config"]["weight_block_size"]
    files = sorted(set(weight_map.values()))
    fds = {f: os.open(src / f, os.O_RDONLY) for f in files}
    headers = {f: header(fds[f]) for f in files}
    dst.mkdir()
    jobs: queue.Queue = queue.Queue(maxsize=2)
    digests: dict[str, str] = {}

    def write() -> None:
        while (job := jobs.get()) is not None:
            fd, offset, block, hasher = job
            view = memoryview(block)
            for at in range(0, len(view), PIECE):
                piece = view[at:at + PIECE]
                hasher.update(piece)
                os.pwrite(fd, piece, offset + at)

    writer = threading.Thread(target=write)
    writer.start()
    for f in files:
        tensors, base = headers[f]
        keys = sorted(k for k in tensors if k != "__metadata__" and not k.endswith("_scale_inv"))
        out, end = {}, 0
        for k in keys:
            t = tensors[k]
            size = (2 if t["dtype"] == "F8_E4M3" else SIZES[t["dtype"]]) * _count(t["shape"])
            out[k] = {"dtype": "BF16" if t["dtype"] == "F8_E4M3" else t["dtype"], "shape": t["shape"],
                      "data_offsets": [end, end + size]}
            end += size
        text = json.dumps(out).encode()
        text += b" " * (-len(text) % 8)
        fd = os.open(dst / f, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, 8 + len(text) + end)
        os.pwrite(fd, struct.pack("<Q", len(text)) + text, 0)
        data = 8 + len(text)
        for k in keys:
            t, at = tensors[k], data + out[k]["data_offsets"][0]
            first, last = t["data_offsets"]
            if t["dtype"] != "F8_E4M3":
                os.copy_file_range(fds[f], fd, last - first, base + first, at)
                continue
            rows, cols = t["shape"]
            layout = Fp8Block(cols=cols, block_rows=bh, block_cols=bw)
            scale_file = weight_map[k + "_scale_inv"]
            scale_tensors, scale_base = headers[scale_file]
            scale_at = scale_base + scale_tensors[k + "_scale_inv"]["data_offsets"][0]
            hasher = blake3()
            step = bh * max(1, CHUNK // (bh * cols * 2))
            for row in range(0, rows, step):
                n = min(step, rows - row)
                weight = os.pread(fds[f], n * cols, base + first + row * cols)
                scale = os.pread(fds[scale_file], layout.scale_rows(n) * layout.scale_cols * 4,
                                 scale_at + row // bh * layout.scale_cols * 4)
                jobs.put((fd, at + row * cols * 2, tables.fp8_block(weight, scale, layout, n, "BF16"), hasher))
            digests[k] = hasher  # read once the writer is done
    jobs.put(None)
    writer.join()
    (dst / "digests.json").write_text(json.dumps({k: h.hexdigest() for k, h in digests.items()}))


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
