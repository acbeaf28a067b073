"""Routing of Communicator collectives on CUDA arrays to the GPU data plane (GpuComm).

The CPU collectives (collectives.py) call :func:`dispatch` only after their NumPy fast checks
failed (``type(x) is not np.ndarray``) and :func:`is_cuda` said yes, so the CPU path pays
nothing. Semantics are GpuComm's (NCCL's): the operation is enqueued on ``stream`` (else the
array's current stream) and the call returns before the GPU has finished; with async_op=True
(and the a* coroutines) it returns a GpuRequest holding a CUDA event recorded after it.
"""
from __future__ import annotations

import sys
from typing import Any, Optional


def is_cuda(x: Any) -> bool:
    """Cheap test for a CUDA array (see comm._is_cuda). torch tensors first: hasattr() on a
    CUDA tensor's __cuda_array_interface__ would build that dict on every call."""
    if x is None:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and type(x) is torch.Tensor:
        return x.is_cuda
    from .comm import _is_cuda
    return _is_cuda(x)


def host_device_mix(op: str, x_is_cuda: bool) -> TypeError:
    if x_is_cuda:
        return TypeError(f"{op}: x is a CUDA array but out is not; pass out on the same CUDA device "
                         "(or copy x to the host first)")
    return TypeError(f"{op}: x is a host array but out is a CUDA array; pass both on the host or "
                     "both on the GPU")


def unsupported(op: str, hint: str) -> TypeError:
    return TypeError(f"{op}: CUDA arrays are not supported by {op} yet; {hint}")


def _empty(x: Any, count_shape: tuple) -> Any:
    """A new uninitialised array like x (same library, dtype and device) with shape count_shape."""
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.empty(count_shape, dtype=x.dtype, device=x.device)
    if type(x).__module__.startswith("cupy"):
        import cupy
        with cupy.cuda.Device(x.device.id):
            return cupy.empty(count_shape, dtype=x.dtype)
    raise TypeError(f"cannot allocate a result like {type(x).__name__}; pass out=")


def dispatch(comm, op: str, x: Any, *, out: Any = None, red: str = "sum", root: int = 0,
             async_op: bool = False, dtype: Optional[str] = None, stream: Any = None) -> Any:
    """Runs collective `op` of `comm` on CUDA array x through comm.cuda(); returns the result,
    or with async_op a GpuRequest (_request.py) whose wait() / await returns it."""
    result = _run(comm, op, x, out=out, red=red, root=root, dtype=dtype, stream=stream)
    if not async_op:
        return result
    return comm.cuda().request(result, stream, result)


def _run(comm, op: str, x: Any, *, out: Any, red: str, root: Any, dtype: Optional[str],
         stream: Any) -> Any:
    # A rank's own checks refuse through g._refusing (refusal.py): a peer that got past them may
    # have enqueued its kernels, which wait for this rank. Before this rank's plane exists no
    # peer's kernel can wait for it, but the peers may be making the plane (collective), waiting
    # for this rank's card: the refusal is sent there (plane_setup.refuse_before_plane).
    # LINKWISE_CHECK's exchange comes before the plane is made (a rank that passed a host array
    # meets the others there), and its mismatch raises on every rank alike: not a refusal of
    # this rank's.
    from .cuda.plane_setup import checks_of_a_gpu_call
    with checks_of_a_gpu_call(comm, x, stream, agreed_first=True):
        from ._coll_args import _check_tunables  # here: _coll_args imports this module
        _check_tunables()
        if dtype is not None:
            raise TypeError(f"{op}: dtype= is for host arrays; a CUDA array carries its own dtype")
        if out is not None and not is_cuda(out):
            raise host_device_mix(op, True)
        if op == "broadcast":
            root = comm._root(root, op)
    from ._coll_args import check_on
    if check_on():
        _check_agree(comm, op, x, red, root)
    g = getattr(comm, "_gpu_comm", None)
    if g is None:
        g = comm.cuda()
    with g._refusing(x, stream):
        x, out, h = _prepared(comm, g, op, x, out, stream)
    if op == "all_reduce":
        return g.all_reduce(x, op=red, out=out, stream=stream)
    if op == "broadcast":
        return g.broadcast(x, root=root, stream=stream, out=out)
    if op == "all_gather":
        return g.all_gather(x, out, stream=stream)
    if op == "reduce_scatter":
        return g.reduce_scatter(x, out, op=red, stream=stream)
    if h is not None:  # all_to_all in place: from the copy made on the stream into x
        g.all_to_all(out, x, stream=h)
        return x
    return g.all_to_all(x, out, stream=stream)


def _prepared(comm, g, op: str, x: Any, out: Any, stream: Any) -> tuple:
    """(x, out, stream) for the GpuComm call: out allocated where the caller left it out (an
    all_to_all in place: a copy of x made and allocated on the stream, whose handle comes back;
    else None). Raises what the caller refuses (inside g._refusing)."""
    shape = tuple(getattr(x, "shape", ()))
    if op == "all_gather" and out is None:
        lead = shape[0] if shape else 1
        out = _empty(x, (comm.size * lead,) + shape[1:])
    elif op == "reduce_scatter":
        n = 1
        for d in shape:
            n *= d
        if n % comm.size:
            raise ValueError(f"reduce_scatter: x has {n} elements, not a multiple of the "
                             f"communicator size {comm.size}")
        if out is None:
            from ._coll_args import block_shape  # here: _coll_args imports this module
            out = _empty(x, block_shape(tuple(shape), comm.size))
    elif op == "all_to_all" and (out is None or out is x):
        from .cuda.arrays import copy_on_stream, stream_handle, view
        v = view(x, op)
        h = stream_handle(stream, v)
        return x, copy_on_stream(x, v, h, g.device, op), h
    return x, out, None


def _check_agree(comm, op: str, x: Any, red: str, root: int) -> None:
    """LINKWISE_CHECK on a CUDA call: the same descriptor the host path sends (count as the host
    path counts it), marked as a CUDA array, so a rank that passed a host array while the
    others passed CUDA arrays makes every rank raise instead of hanging."""
    from .cuda.arrays import view
    v = view(x, op)
    count = v.count // comm.size if op == "reduce_scatter" else v.count
    reducing = op in ("all_reduce", "reduce", "reduce_scatter")
    comm._check_agree(op, count, v.dtype or f"bytes{v.itemsize}", red if reducing else "",
                      root if op in ("broadcast", "reduce", "gather", "scatter") else 0, device="cuda")
