"""Stream order of the CUDA calls whose work spans two streams: comm.sendrecv (the send on a side
stream), comm.sendrecv_replace (a copy of x, then sendrecv) and the in-place all_to_all (a copy
first); sendrecv also for arrays known only by __cuda_array_interface__ or DLPack. Each call
must start after the work already on the caller's stream and finish before the work enqueued
after it, whichever way the stream is named: torch's current stream (the default one, or a
stream of the user's), stream=torch.cuda.default_stream() and stream=0.
torch.cuda.ExternalStream(0) is a stream of torch's pool, not the default stream; wrapping
handle 0 that way ordered nothing (found with two ranks sharing one GPU, where kernels of two
processes take turns).

The caller's stream is kept busy (torch.cuda._sleep) before it writes x, so a call that does
not wait for it reads x unwritten. With fewer than 2 GPUs the ranks share one GPU (CUDA IPC
works between processes of one device).
"""
from __future__ import annotations

import pytest

from array_wrappers import DlpackOnly
from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _setup, _two_or_more

pytestmark = pytest.mark.gpu

SPIN = 20_000_000  # GPU clock cycles (~10 ms): the caller's stream is busy when the call is enqueued
FORMS = ["current", "user stream", "stream=default", "stream=0"]


def _in_form(torch, form, device, call):
    """Runs call(stream_arg) in the stream setting `form`; returns the stream it ordered on."""
    user = torch.cuda.Stream(device=device)
    if form == "user stream":
        with torch.cuda.stream(user):
            call(None)
        return user
    arg = {"current": None, "stream=default": torch.cuda.default_stream(device), "stream=0": 0}[form]
    call(arg)
    return torch.cuda.default_stream(device)


class CaiOnly:
    """A CUDA array known only by __cuda_array_interface__, as Numba's are (stream: stream=,
    else the legacy default stream, which torch's default stream is)."""

    def __init__(self, t):
        self.t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


WRAP = {"sendrecv": None, "replace": None, "cai": CaiOnly, "dlpack": DlpackOnly, "replace-dlpack": DlpackOnly}


def _sendrecv_body(comm, how):
    """A ring of sendrecv (how="sendrecv"; "cai" / "dlpack": the arrays wrapped so) or
    sendrecv_replace ("replace"; "replace-dlpack": x wrapped) in every stream form; the caller
    writes x only after a spin, and overwrites it (sendrecv) right after."""
    g, torch = _setup(comm)
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    wrap = WRAP[how] or (lambda t: t)
    replace = how.startswith("replace")
    bad = []
    for count in (0, 1000, (1 << 20) + 3):  # the scratch slot; a registered buffer (4 MiB+)
        for form in FORMS:
            if how == "cai" and form == "user stream":
                continue  # a bare __cuda_array_interface__ array has no current stream to follow
            box = {}

            def call(stream):
                x = torch.zeros(count, device="cuda")
                out = x if replace else torch.full((count,), -1.0, device="cuda")
                torch.cuda._sleep(SPIN)
                x.fill_(comm.rank + 1)
                if replace:
                    n = comm.sendrecv_replace(wrap(x), nxt, prv, stream=stream)
                else:
                    n = comm.sendrecv(wrap(x), nxt, wrap(out), prv, stream=stream)
                    x.fill_(-7)  # the caller reuses x at once: after the send, in stream order
                box.update(n=n, out=out)
            s = _in_form(torch, form, g.device, call)
            s.synchronize()
            out = box["out"].cpu()
            wrong = int((out != prv + 1).sum())
            if wrong or box["n"] != 4 * count:
                bad.append(f"rank {comm.rank} {how} {count} {form}: {wrong} wrong, {box['n']} bytes, "
                           f"first {out[:3].tolist()}")
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None and how == "replace":  # cupy arrays: copied on cupy's current stream
        with cupy.cuda.Device(g.device):
            for count in (7, (1 << 20) + 3):
                x = cupy.arange(count, dtype=cupy.float32) + 1000 * comm.rank
                n = comm.sendrecv_replace(x, nxt, prv)
                want = cupy.arange(count, dtype=cupy.float32) + 1000 * prv
                if n != 4 * count or not bool((x == want).all()):
                    bad.append(f"rank {comm.rank} cupy replace {count}: {n} bytes, wrong data")
    if replace:  # an array known only by __cuda_array_interface__ cannot be copied: refused
        try:  # before anything is sent, on every rank; last: a refusal stops the GPU plane
            comm.sendrecv_replace(CaiOnly(torch.zeros(4, device="cuda")), nxt, prv)
            bad.append(f"rank {comm.rank}: sendrecv_replace took a bare __cuda_array_interface__ array")
        except TypeError as exc:
            if "stopped on every rank" not in str(exc):
                bad.append(f"rank {comm.rank}: the refusal did not stop the GPU plane: {exc}")
    g.close()
    return bad


@pytest.mark.parametrize("how", list(WRAP))
def test_sendrecv_follows_the_callers_stream(how):
    bad = [b for r in run_ranks(_two_or_more(), _sendrecv_body, how, env=SAFE_ENV, timeout=180) for b in r]
    assert not bad, "\n".join(bad[:12])


def _all_to_all_body(comm):
    g, torch = _setup(comm)
    n, r, count = comm.size, comm.rank, 4099
    blocks = [torch.arange(count, dtype=torch.float32) + 1000 * r + 10 * q for q in range(n)]
    want = torch.cat([torch.arange(count, dtype=torch.float32) + 1000 * q + 10 * r for q in range(n)])
    bad = []
    for form in FORMS:
        box = {}

        def call(stream):
            x = torch.zeros(n * count, device="cuda")
            torch.cuda._sleep(SPIN)
            x.copy_(torch.cat(blocks).cuda())
            box["x"] = comm.all_to_all(x, stream=stream)  # in place: x is copied first
        s = _in_form(torch, form, g.device, call)
        s.synchronize()
        got = box["x"].cpu()
        if not torch.equal(got, want):
            bad.append(f"rank {r} {form}: {int((got != want).sum())} of {got.numel()} wrong")
    g.close()
    return bad


def test_in_place_all_to_all_follows_the_callers_stream():
    bad = [b for r in run_ranks(_two_or_more(), _all_to_all_body, env=SAFE_ENV, timeout=180) for b in r]
    assert not bad, "\n".join(bad[:12])
