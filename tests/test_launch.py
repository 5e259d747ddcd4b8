"""intqat.distributed.launch.run_processes: what the caller sees when a rank succeeds, raises, dies of a signal,
or hangs (2 spawned gloo processes each; ~4 s of process start-up per case). A rank whose fn returned waits for
the others before tearing the group down: the error raised is the failing rank's own, not its peer's."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from intqat.distributed.launch import run_processes


def _sum_ranks(rank: int, world: int, out_dir: str) -> None:
    import torch

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(str(int(t)))


def _rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 found a bad shard: (3, 5)")


def _rank1_aborts(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)  # as C++'s std::terminate does


def _rank1_hangs(rank: int, world: int) -> None:
    import time

    if rank == 1:
        time.sleep(600)  # rank 0 returns and waits for it


def test_every_rank_runs_in_one_group_and_exits_cleanly(tmp_path):
    run_processes(_sum_ranks, world_size=2, args=(str(tmp_path),), timeout=120)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["3", "3"]


def test_an_exception_in_a_rank_is_raised_with_its_message():
    with pytest.raises(ProcessRaisedException, match=r"ValueError: rank 1 found a bad shard: \(3, 5\)"):
        run_processes(_rank1_raises, world_size=2, timeout=120)


def test_a_rank_killed_by_a_signal_prints_its_python_stack(capfd):
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        run_processes(_rank1_aborts, world_size=2, timeout=120)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err, err[-2000:]
    assert "_rank1_aborts" in err, err[-2000:]  # the stack names the function that was running


def test_a_hung_rank_fails_at_the_timeout_naming_it():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] were still running after 20 s"):
        run_processes(_rank1_hangs, world_size=2, timeout=20)
