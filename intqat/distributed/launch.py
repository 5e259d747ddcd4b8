"""Run a function on N CPU processes joined in one gloo process group, with a time bound.

    from intqat.distributed.launch import run_processes
    run_processes(my_check, world_size=2, args=(tmp_dir,), timeout=120)

`fn(rank, world_size, *args)` runs in each process once `torch.distributed` is initialised (gloo, one
thread each: the processes share the machine's cores); an exception in any process is raised here
with its traceback, and processes still running at the timeout are killed, so a hung collective fails
instead of hanging the caller. The rendezvous goes through a file, not a TCP port: nothing to race
for. For the tests (tests/test_fsdp*.py) and the bench (python -m intqat.distributed.bench).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["run_processes"]


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, threads: int, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_processes(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 300.0,
                  threads: int = 1) -> None:
    """fn(rank, world_size, *args) on `world_size` spawned processes (gloo); raises what any of them raised,
    or TimeoutError naming the ranks still running after `timeout` seconds. `fn` must be importable by name
    (a module-level function)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="intqat_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(_entry, args=(fn, world_size, init_file, threads, args), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(5)
                raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} on {world_size} processes: ranks {alive} were "
                                   f"still running after {timeout:g} s (a collective that one rank never joined?)")
