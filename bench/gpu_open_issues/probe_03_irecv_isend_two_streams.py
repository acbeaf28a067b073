# RANKS: 2
"""Bug: irecv / arecv of a CUDA array of LINKWISE_GPU_REG_MIN (4 MiB) or more blocks the HOST
until the peer has called its send (cuda/registered.py recv, from GpuComm.recv: self.comm.recv of the sender's buffer
description inside GpuComm.recv). So the NCCL-legal pattern "irecv on stream A, then isend on
stream B" on both ranks, which works below 4 MiB, deadlocks (until LINKWISE_TIMEOUT) at 4 MiB+:
each rank is stuck in irecv and never reaches its isend. (64 KiB failed too until the copy kernels were preloaded: CUDA lazy module loading.) Same for `await asyncio.gather(comm.arecv(..), comm.asend(..))`, where it
also blocks the event loop. Expected: both sizes complete."""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pu import *  # noqa: E402,F403

setenv(LINKWISE_TIMEOUT=10)


def main():
    comm, g, torch = init(2)
    peer = 1 - comm.rank
    for nbytes in (64 << 10, 8 << 20):
        n = nbytes // 4
        s_recv, s_send = torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.full((n,), float(comm.rank + 1), device="cuda")
        y = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        comm.barrier()
        t0 = time.time()
        try:
            rq = comm.irecv(y, peer, stream=s_recv)
            sq = comm.isend(x, peer, stream=s_send)
            sq.wait(); rq.wait(); torch.cuda.synchronize(); g.check()
            ok = bool((y == peer + 1).all())
            verdict(ok, f"{nbytes >> 10} KiB: irecv(stream A) then isend(stream B) on both ranks: "
                        f"{time.time() - t0:.2f}s, data {'ok' if ok else 'WRONG'}")
        except Exception as e:  # noqa: BLE001
            FAIL(f"{nbytes >> 10} KiB: irecv(stream A) then isend(stream B) raised after "
                 f"{time.time() - t0:.1f}s: {exc_text(e)}")
            break
    finish(comm)


run(main)
