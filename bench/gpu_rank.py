"""Per-rank setup shared by the GPU bench scripts (gpu_tune.py, gpu_ll_sweep.py,
gpu_eager_host.py), run under `linkwise launch -n N`: the communicator and its GPU side, the
bench stream, rows printed by rank 0 as JSON lines, and CUDA-event timing (slowest rank)."""
from __future__ import annotations

import json


class GpuRank:
    def __init__(self, torch, meta: dict | None = None) -> None:
        import linkwise
        from linkwise.bench.backends import LinkwiseBackend
        from linkwise.bench.gpu import bench_stream, time_ops
        self.torch, self._time_ops = torch, time_ops
        self.comm = linkwise.init()
        self.helper = LinkwiseBackend(self.comm)  # barrier, max_over_ranks over the host engine
        self.g = self.comm.cuda()
        self.stream = bench_stream(torch, self.g.device)
        self.rank, self.n = self.comm.rank, self.comm.size
        self.out: dict = {"ranks": self.n, **(meta or {}), "rows": []}

    def say(self, row: dict) -> None:
        """Keeps row for --json; rank 0 prints it."""
        self.out["rows"].append(row)
        if self.rank == 0:
            print(json.dumps(row), flush=True)

    def barrier(self) -> None:
        self.torch.cuda.synchronize()
        self.helper.barrier()

    def time_us(self, fn, iters: int, warm: int, graph: bool) -> float:
        """µs per call of fn: CUDA events around `iters` back-to-back calls on the bench stream
        (captured in one graph with graph=True), the slowest rank's."""
        return 1e6 * self._time_ops(self.torch, self.stream, fn, iters, warm, graph, self.barrier,
                                    self.helper.max_over_ranks)

    def dump(self, path: str | None) -> None:
        """Writes the rows to path (rank 0) when given."""
        if path and self.rank == 0:
            with open(path, "w") as fh:
                json.dump(self.out, fh, indent=1)
