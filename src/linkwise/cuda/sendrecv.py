"""sendrecv on CUDA arrays: the send on the engine's side stream, the receive on the caller's.

GPU sends and receives are stream-ordered, and a receive waits on the device for its data: if
both ranks of a pair enqueued their receive before their send on one stream, each receive would
wait for a send queued behind the other. So the send goes
first, on the GpuEngine's side stream, which starts after the work already on the caller's
stream (sendrecv_fork); the caller's stream then waits for it (sendrecv_join), so work enqueued
after sendrecv sees both done and x may be reused at once in stream order. The forks and joins
are CUDA events on raw stream handles, so any CUDA array (torch, cupy,
__cuda_array_interface__, DLPack) works alike. sendrecv_replace sends a copy of x, made on the
caller's stream, through the same exchange.

Host-staged (LINKWISE_P2P_DISABLE=1): a staged send blocks this thread until its reader has
taken every chunk beyond the staging slots, so with every rank of a ring in its send none
would reach its receive. There the send runs on a helper thread while this thread receives
(Staged keeps separate pinned buffers for the two directions); sendrecv returns once both
are done, and re-raises the send's error if the receive succeeded.
"""
from __future__ import annotations

import threading
from typing import Any

from .arrays import copy_on_stream, stream_handle, view


def gpu_sendrecv(g, x: Any, dst: int, out: Any, src: int, send_tag: int, recv_tag: int,
                 stream: Any = None) -> int:
    """Sends x to dst while receiving out from src on GpuComm g; returns the bytes received
    (enqueued, as recv: they are in out once the caller's stream gets there)."""
    g._open("sendrecv")  # a closed GpuComm has no engine to fork a stream from
    with g._refusing(x, stream, collective=False):  # the peers' kernels may wait for this rank
        v = view(x, "sendrecv")
        o = view(out, "sendrecv")  # both are CUDA arrays, checked before the send is enqueued
        if v.nbytes and o.nbytes and v.ptr < o.ptr + o.nbytes and o.ptr < v.ptr + v.nbytes:
            # as the host path: the send (side stream) and the receive would race on these bytes
            raise ValueError("sendrecv: x and out share memory; the receive would overwrite x "
                             "while it is sent (use sendrecv_replace to exchange in place)")
        s = stream_handle(stream, v)
    g._no_capture(s, "sendrecv")  # before the fork: a captured stream cannot be forked from here
    side = g._engine.sendrecv_fork(s)
    try:
        if g._staged is not None:
            return _staged_exchange(g, x, dst, send_tag, side, out, src, recv_tag, s)
        g.send(x, dst, send_tag, stream=side)
        return g.recv(out, src, recv_tag, stream=s)
    finally:
        g._engine.sendrecv_join(s)  # also after a failure: nothing on s may overtake the send


def _staged_exchange(g, x, dst, send_tag, side, out, src, recv_tag, s) -> int:
    failed: list = []

    def send() -> None:
        try:
            g.send(x, dst, send_tag, stream=side)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failed.append(exc)
    sender = threading.Thread(target=send, name="linkwise-staged-sendrecv", daemon=True)
    sender.start()
    try:
        n = g.recv(out, src, recv_tag, stream=s)
    finally:
        sender.join()  # the send ends too: it has its own timeout
    if failed:
        raise failed[0]
    return n


def gpu_sendrecv_replace(g, x: Any, dst: int, src: int, send_tag: int, recv_tag: int,
                         stream: Any = None) -> int:
    """Sends x to dst and receives into x from src on GpuComm g; returns the bytes received
    (enqueued). The copy that is sent is made on the caller's stream and allocated there, so
    its memory is reused only after that stream has waited for the send."""
    g._open("sendrecv_replace")
    with g._refusing(x, stream, collective=False):
        v = view(x, "sendrecv_replace")
        s = stream_handle(stream, v)
        copy = copy_on_stream(x, v, s, g.device, "sendrecv_replace")
    return gpu_sendrecv(g, copy, dst, x, src, send_tag, recv_tag, s)
