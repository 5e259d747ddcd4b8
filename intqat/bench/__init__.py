"""Benchmarks: the only place intqat measures speed and memory (`intqat-bench`, intqat.cli.bench).

timing.py   the shared interleaved timer and the machine description
saved.py    saved-for-backward bytes (saved_tensors_hooks)
memory.py   peak memory of a train step (torch's CPU allocator events)
peers.py    torchao QAT, torchao int8 mixed-precision training, torch.ao eager QAT, and their deploy paths
ops.py      `intqat-bench ops`: int_mm and a linear layer's forward + backward
modules.py  `intqat-bench modules`: MLP / CNN train steps, peak memory, train/deploy mismatch
profile.py  `intqat-bench profile`: torch.profiler top ops of int_linear forward + backward
table.py    the plain-text tables
"""

from intqat.bench.saved import saved_bytes
from intqat.bench.timing import Timing, machine_info, speed_ratio, time_interleaved

__all__ = ["Timing", "time_interleaved", "speed_ratio", "machine_info", "saved_bytes"]
