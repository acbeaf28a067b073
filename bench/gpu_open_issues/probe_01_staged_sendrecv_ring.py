# RANKS: 2
"""Bug: with LINKWISE_P2P_DISABLE=1 (host-staged GPU path, peers on one host) a sendrecv ring
deadlocks once the message has more chunks than staging slots (default 3 x 4 MiB).
gpu_sendrecv (cuda/sendrecv.py:29-32) issues the send first and expects it to return at once;
Staged.send -> StageChannel::write (stage_channel.cu run()) blocks the host until the reader
has acked every chunk beyond the slots, and the reader is the peer, itself blocked in its own
send. Expected: both sizes complete (sendrecv's contract: every rank of a ring may call it)."""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pu import *  # noqa: E402,F403

setenv(LINKWISE_P2P_DISABLE=1, LINKWISE_TIMEOUT=10)


def main():
    comm, g, torch = init(2)
    peer = 1 - comm.rank
    INFO(f"host-staged={g._staged is not None} local peers={sorted(g._staged._local) if g._staged else None}")
    for nbytes in (1 << 20, 32 << 20):
        n = nbytes // 4
        x = torch.full((n,), float(comm.rank + 1), device="cuda")
        out = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        t0 = time.time()
        try:
            comm.sendrecv(x, peer, out, peer)
            torch.cuda.synchronize()
            g.check()
            ok = bool((out == peer + 1).all())
            verdict(ok, f"{nbytes >> 20} MiB sendrecv ring with LINKWISE_P2P_DISABLE=1: "
                        f"{time.time() - t0:.2f}s, data {'ok' if ok else 'WRONG'}")
        except Exception as e:  # noqa: BLE001
            FAIL(f"{nbytes >> 20} MiB sendrecv ring with LINKWISE_P2P_DISABLE=1 raised after "
                 f"{time.time() - t0:.1f}s (deadlock until LINKWISE_TIMEOUT): {exc_text(e)}")
            break
    finish(comm)


run(main)
