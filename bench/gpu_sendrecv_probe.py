"""Where wrong sendrecv data on CUDA tensors comes from (diagnostic; prints, asserts nothing).

Run under `linkwise launch -n 2` (ranks may share one GPU). For each mode, rounds of exchanges
in a ring over the sizes of tests/test_gpu_collectives.py's sendrecv test; each wrong result
is classified: elements still -1 (never written), elements equal to the peer's previous
message (stale slot), or other. Modes:
  sendrecv   comm.sendrecv (send on a side stream, receive on the caller's stream)
  sync       the same, with torch.cuda.synchronize() and a host barrier after each call
  onestream  GpuComm.send / recv on one stream (even ranks send first)
  twostream  GpuComm.send on a side stream, recv on the current stream, no sendrecv wrapper
"""
from __future__ import annotations

import sys

import torch

import linkwise

SIZES = [7, 300001, (1 << 20) + 3, 9]


def classify(out, want, recent):
    """'' when out == want; else how many elements are wrong and what they hold. recent: the
    messages received before this one, newest first (a stale slot repeats one of them)."""
    bad = (out != want).nonzero().flatten()
    if len(bad) == 0:
        return ""
    got = out[bad]
    never = int((got == -1).sum())
    stale = []
    for age, old in enumerate(recent, 1):
        inside = bad[bad < old.numel()]
        stale.append(f"{int((out[inside] == old[inside]).sum())} equal message -{age}")
    return (f"{len(bad)}/{out.numel()} wrong, first at {int(bad[0])} (last {int(bad[-1])}): "
            f"{never} still -1, {', '.join(stale)}; got {got[:4].tolist()} "
            f"want {want[bad[:4]].tolist()}")


def main() -> int:
    modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["sendrecv", "sync", "onestream", "twostream"]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    comm = linkwise.init()
    g = comm.cuda()
    torch.cuda.set_device(g.device)
    n, r = comm.size, comm.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    side = torch.cuda.Stream(device=g.device)
    for mode in modes:
        bad_lines, calls, recent = [], 0, []
        for rnd in range(rounds):
            for i, count in enumerate(SIZES):
                base = 1000 * (rnd * len(SIZES) + i)
                x = torch.arange(count, dtype=torch.float32, device="cuda") + base + 10 * r
                out = torch.full((count,), -1.0, device="cuda")
                if mode in ("sendrecv", "sync"):
                    comm.sendrecv(x, nxt, out, prv)
                elif mode == "onestream":
                    if r % 2 == 0:
                        g.send(x, nxt)
                        g.recv(out, prv)
                    else:
                        g.recv(out, prv)
                        g.send(x, nxt)
                else:
                    cur = torch.cuda.current_stream()
                    side.wait_stream(cur)
                    g.send(x, nxt, stream=side.cuda_stream)
                    g.recv(out, prv, stream=cur.cuda_stream)
                    cur.wait_stream(side)
                if mode == "sync":
                    torch.cuda.synchronize()
                    comm.barrier()
                want = torch.arange(count, dtype=torch.float32, device="cuda") + base + 10 * prv
                what = classify(out, want, recent)
                recent = [want] + recent[:2]
                calls += 1
                if what:
                    bad_lines.append(f"round {rnd} size {count}: {what}")
        torch.cuda.synchronize()
        comm.barrier()
        print(f"rank {r} {mode}: {len(bad_lines)} of {calls} wrong" +
              "".join(f"\n  {b}" for b in bad_lines[:6]), flush=True)
        comm.barrier()
    g.close()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
