"""sendrecv on CUDA arrays: the send on a side stream, the receive on the caller's stream.

GPU sends and receives are stream-ordered, and a receive waits on the device for its data: if
both ranks of a pair enqueued their receive before their send on one stream, each receive
would wait for a send queued behind the other (and a registered-buffer receive, from
LINKWISE_GPU_REG_MIN bytes, waits on the host for the sender's description). So the send goes
first, on a side stream that starts after the work already on the caller's stream; the caller's
stream then waits for it, so work enqueued after sendrecv sees both done. Side streams come
from the array's library (torch or cupy), one per GpuComm and library, made on first use.
sendrecv_replace sends a copy of x, made on the caller's stream, through the same exchange.
"""
from __future__ import annotations

from typing import Any

from .arrays import stream_handle, torch_stream, view


def gpu_sendrecv(g, x: Any, dst: int, out: Any, src: int, send_tag: int, recv_tag: int,
                 stream: Any = None) -> int:
    """Sends x to dst while receiving out from src on GpuComm g; returns the bytes received
    (enqueued, as recv: they are in out once the caller's stream gets there)."""
    v = view(x, "sendrecv")
    view(out, "sendrecv")  # both are CUDA arrays, checked before the send is enqueued
    s = stream_handle(stream, v)
    sides = g.__dict__.setdefault("_sendrecv_sides", {})
    if v.lib == "torch":
        import torch
        side = sides.get("torch")
        if side is None:
            side = sides["torch"] = torch.cuda.Stream(device=g.device)
        cur = torch_stream(s, g.device)
        side.wait_stream(cur)
        g.send(x, dst, send_tag, stream=side.cuda_stream)
        n = g.recv(out, src, recv_tag, stream=s)
        cur.wait_stream(side)
        return n
    if v.lib == "cupy":
        import cupy
        side = sides.get("cupy")
        if side is None:
            with cupy.cuda.Device(g.device):
                side = sides["cupy"] = cupy.cuda.Stream(non_blocking=True)
        cur = cupy.cuda.ExternalStream(s)
        side.wait_event(cur.record())
        g.send(x, dst, send_tag, stream=side.ptr)
        n = g.recv(out, src, recv_tag, stream=s)
        cur.wait_event(side.record())
        return n
    raise TypeError("sendrecv: CUDA arrays other than torch's and cupy's have no side stream to "
                    "send on; post comm.isend and comm.irecv on separate streams instead")


def gpu_sendrecv_replace(g, x: Any, dst: int, src: int, send_tag: int, recv_tag: int,
                         stream: Any = None) -> int:
    """Sends x to dst and receives into x from src on GpuComm g; returns the bytes received
    (enqueued). The copy that is sent is made on the caller's stream and allocated there, so
    its memory is reused only after that stream has waited for the send."""
    v = view(x, "sendrecv_replace")
    s = stream_handle(stream, v)
    if v.lib == "torch":
        import torch
        with torch.cuda.device(g.device), torch.cuda.stream(torch_stream(s, g.device)):
            copy = x.clone()
    elif v.lib == "cupy":
        import cupy
        with cupy.cuda.Device(g.device), cupy.cuda.ExternalStream(s):
            copy = x.copy()
    else:
        raise TypeError("sendrecv_replace: CUDA arrays other than torch's and cupy's cannot be "
                        "copied here; pass a copy of x to sendrecv(copy, dst, x, src)")
    return gpu_sendrecv(g, copy, dst, x, src, send_tag, recv_tag, s)
