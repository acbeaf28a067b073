# RANKS: 2
"""Was a bug (fixed on branch gpufix, tests/test_gpu_open_fixes.py): an argument refused on ONE
rank of a GPU collective (here: the root's out= of the wrong size, checked on the root only,
cuda/gpu_comm.py broadcast) raised there at once, but the other ranks had already enqueued their
kernels, which spun until LINKWISE_TIMEOUT and then marked the GPU plane timed out for good.
Now the root enqueues its refusal in the call's place (GpuEngine::refuse: a refusal code in
every rank's Control.error): the others' kernels give up at once, and every rank's GPU plane
raises CommAbortedError naming the root from then on (it cannot go on: the refused call's
counters no longer agree). Expected: the non-root learns within a few seconds; "GPU plane dead
afterwards" is the expected INFO line."""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pu import *  # noqa: E402,F403

setenv(LINKWISE_TIMEOUT=10)


def main():
    comm, g, torch = init(2)
    n = 1 << 16
    x = torch.ones(n, device="cuda")
    out = torch.empty(n + (1 if comm.rank == 0 else 0), device="cuda")  # wrong on the root only
    torch.cuda.synchronize()
    comm.barrier()
    t0 = time.time()
    err = None
    try:
        comm.broadcast(x, root=0, out=out)
        torch.cuda.synchronize()
        g.check()
    except Exception as e:  # noqa: BLE001
        err = e
    dt = time.time() - t0
    if comm.rank == 0:
        INFO(f"root: {exc_text(err) if err else 'no error'} after {dt:.2f}s")
    else:
        verdict(err is not None and dt < 3.0,
                f"non-root learned of the root's refusal after {dt:.1f}s: "
                f"{exc_text(err) if err else 'NO ERROR (returned normally)'}")
        try:
            g.check()
            INFO("GPU plane still usable afterwards")
        except Exception as e:  # noqa: BLE001
            INFO(f"GPU plane dead afterwards: {exc_text(e)[:120]}")
    finish(comm)


run(main)
