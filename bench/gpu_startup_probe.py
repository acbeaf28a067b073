"""Where a GPU rank's start goes (diagnostic; prints, asserts nothing).

Run under `linkwise launch -n N` (ranks may share one GPU), twice in a row on a fresh machine to
tell a cold start (libraries read from disk) from a warm one. Each rank prints the seconds each
step took: importing torch, its first CUDA call, linkwise.init(), gpu_comm(), the first GPU
all_reduce (connections, IPC mappings) and a second one.
"""
from __future__ import annotations

import time

t0 = time.perf_counter()
marks = []


def mark(what: str) -> None:
    marks.append((what, time.perf_counter()))


import torch  # noqa: E402

mark("import torch")
import linkwise  # noqa: E402

mark("import linkwise")
comm = linkwise.init()
mark("linkwise.init")
torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
mark("first CUDA call")
from linkwise.cuda import gpu_comm  # noqa: E402

g = gpu_comm(comm)
mark("gpu_comm")
x = torch.ones(1 << 10, device="cuda")
g.all_reduce(x)
g.synchronize()
mark("first all_reduce")
g.all_reduce(x)
g.synchronize()
mark("second all_reduce")
last, steps = t0, []
for what, t in marks:
    steps.append(f"{what} {t - last:.2f}")
    last = t
print(f"rank {comm.rank}: " + ", ".join(steps) + f"; total {last - t0:.2f} s", flush=True)
