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


def _returned_marker(init_file: str, rank: int) -> str:
    return f"{init_file}.returned.{rank}"


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, threads: int, args: tuple) -> None:
    import faulthandler
    import sys

    import torch
    import torch.distributed as dist

    # A rank killed by a signal (SIGABRT from C++'s std::terminate, SIGSEGV) leaves no Python traceback for the
    # parent to raise: faulthandler prints every thread's Python stack to this rank's stderr first.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    # No rank tears its connections down before every rank's fn has returned. The wait goes through files, not a
    # collective: a rank whose fn raised never joins it, so its exception (not a peer's "connection reset") is the
    # one the parent raises, and the parent kills the waiters. Then leave without interpreter finalization, whose
    # C++ static destructors (torch's, gloo's) have nothing left to do for us once the group is destroyed (only
    # stdio holds buffered output). Why: in one CI run (2026-12-07) a rank of tests/test_fsdp.py died of
    # "terminate called without an active exception" at a point unknown (no stack then; 36 reruns under load
    # passed); a teardown abort can no longer fail checks that passed, and an abort elsewhere now prints its stack.
    open(_returned_marker(init_file, rank), "w").close()
    while not all(os.path.exists(_returned_marker(init_file, r)) for r in range(world_size)):
        time.sleep(0.01)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_processes(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 300.0,
                  threads: int = 1) -> None:
    """fn(rank, world_size, *args) on `world_size` spawned processes (gloo); raises what any of them raised,
    or TimeoutError naming the ranks whose fn had not returned after `timeout` seconds. `fn` must be importable
    by name (a module-level function)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="intqat_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(_entry, args=(fn, world_size, init_file, threads, args), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                running = [r for r, p in enumerate(ctx.processes)
                           if p.is_alive() and not os.path.exists(_returned_marker(init_file, r))]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(5)
                raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} on {world_size} processes: ranks {running} were "
                                   f"still running after {timeout:g} s (a collective that one rank never joined?)")
