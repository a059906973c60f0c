"""Run a function on 2 CPU processes joined by a gloo process group (the fixtures' ranks)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable


def spawn_two(rank_main: Callable[[int, str], None], out: str) -> None:
    """``rank_main(rank, out)`` on ranks 0 and 1, each inside an initialised gloo group."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_in_group, args=(port, rank_main, out), nprocs=2)


def _in_group(rank: int, port: int, rank_main: Callable[[int, str], None], out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        rank_main(rank, out)
    finally:
        dist.destroy_process_group()
