# RANKS: 2
"""Was a bug (fixed on branch gpufix, tests/test_gpu_open_fixes.py): the registered-buffer
cache (reg_engine.cu reg_map, now csrc/cuda/reg_cache.h) is keyed by (peer, peer's allocation
base) and never evicted; an entry was closed only when the SAME base reappeared with a new
handle. A peer that frees an allocation (torch.cuda.empty_cache(), cupy without a pool, dynamic
shapes) and allocates elsewhere left the old cudaIpcOpenMemHandle mapping open for the
communicator's life, which kept the freed physical memory allocated on the exporting GPU.
Now the cache is bounded (LINKWISE_GPU_REG_CACHE_ENTRIES / _BYTES, least recently used closed
first, each only once the work that used it is done) and closes a mapping as soon as its peer
describes an allocation overlapping it. The default bound (128 entries, 4 GiB) is larger than
this probe's 16 buffers, so it sets 1 entry and checks that the bound holds (the peer's
last buffer stays mapped: the slot of the last call references it).
Measured here: g._engine.reg_cached() and device free memory after both ranks freed everything.
Expected: cache bounded and free memory back to the baseline (within 128 MiB)."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pu import *  # noqa: E402,F403

setenv(LINKWISE_TIMEOUT=10, LINKWISE_GPU_REG_CACHE_ENTRIES=1)
MiB = 1 << 20


def main():
    comm, g, torch = init(2)

    def one(i, keep):
        x = torch.full(((16 * MiB) // 4 + i * (MiB // 4),), 1.0, device="cuda")  # grows: new segment
        out = torch.empty(2 * x.numel(), device="cuda")
        comm.all_gather(x, out=out)  # >= LINKWISE_GPU_REG_MIN: registers x (slot 0)
        torch.cuda.synchronize()
        del out
        return x  # kept alive until the next iteration so the next x cannot take its address

    keep = one(0, None)
    del keep
    torch.cuda.empty_cache(); torch.cuda.synchronize(); comm.barrier()
    free0 = torch.cuda.mem_get_info()[0]
    c0 = g._engine.reg_cached()
    keep = None
    iters = 16
    for i in range(1, iters + 1):
        x = one(i, keep)
        keep = None
        torch.cuda.empty_cache()
        keep = x
        del x
    del keep
    torch.cuda.empty_cache(); torch.cuda.synchronize(); comm.barrier()
    torch.cuda.synchronize(); comm.barrier()
    free1 = torch.cuda.mem_get_info()[0]
    c1 = g._engine.reg_cached()
    lost = (free0 - free1) / MiB
    INFO(f"reg_cached {c0} -> {c1} after {iters} freed-and-reallocated buffers; device free memory "
         f"{free0 / MiB:.0f} -> {free1 / MiB:.0f} MiB (lost {lost:.0f} MiB with every buffer freed)")
    verdict(c1 <= c0 + 2 and lost < 128,
            f"IPC cache entries grew by {c1 - c0}, device memory not returned: {lost:.0f} MiB")
    finish(comm)


run(main)
