"""Argument refusals of the GPU plane: a call this rank refuses after its peers may have
enqueued their half of it stops the communicator's GPU plane on every rank at once.

Why: the peers' kernels of that call wait on the device for this rank (a collective, or the
other side of a send / receive), and nothing but this rank can tell them it will never come:
left alone they spin until LINKWISE_TIMEOUT, and the plane is dead after that anyway (the
device counters of the ranks no longer agree). So every ValueError / TypeError raised while a
call's arguments are checked (:meth:`RefusalMixin._refusing`, around each entry's checks and
nothing else) goes through :meth:`RefusalMixin._refuse`, whatever the check: one that only
this rank makes (the root's out of a broadcast), one every rank makes alike but that failed
here only (an out of another size, dtype or device), or one that failed everywhere (a rank
cannot know: the price is that such a call, refused by every rank, stops the plane too).
Errors raised before this rank could be waited for (a closed or failed communicator:
CommAbortedError, PeerError, TimeoutError) are not argument errors and pass untouched, as do
errors of the work itself (a host exchange's refusal notice from a peer, a CUDA error): the
context manager covers the checks only, never an engine call.

Contract: GpuComm mixes this in; it needs self.rank, self.size, self.device, self.comm,
self._engine, self._staged and self._closed. Same threading as GpuComm (one caller at a time).
"""
from __future__ import annotations

import contextlib
from typing import Any

from .arrays import stream_handle, view

# Set on an exception this module already reported (nested _refusing blocks report it once).
_TOLD = "_linkwise_gpu_refusal_told"
_STOPPED = ("; the other ranks may be waiting in this call, so GPU operations of this "
            "communicator were stopped on every rank (CommAbortedError from now on; make a "
            "new communicator)")
# Host-staged: only the ranks that share a channel with this one are told (Staged.stop).
_STOPPED_STAGED = ("; the other ranks may be waiting in this call, so GPU operations of this "
                   "communicator were stopped here and in its host-staged channels to the other "
                   "ranks (CommAbortedError from now on; make a new communicator)")


class RefusalMixin:
    def _refuse(self, s: int, exc: BaseException, collective: bool = True) -> BaseException:
        """Reports argument error `exc` (its type and message kept, the stop appended) to the
        ranks that may be waiting in this call, and returns it to be raised. Two places they
        can wait, and both are told:
         * on the GPU (kernels enqueued): on the NVLink path the refusal is enqueued on stream s
           in the call's place (GpuEngine::refuse; the legacy stream when the call's stream
           cannot be used): every rank's device waits give up, and every rank's GPU plane raises
           CommAbortedError naming this rank from then on (the counters the refused call would
           have advanced no longer agree, so it cannot go on);
         * on the host, in an exchange of a collective (the registered path's descriptions,
           registered.reg_many; host-staged messages): with `collective`, this rank refuses the
           communicator's next host collective number (_skip_call), whose notice makes them
           raise at once, and its host collectives stop, as after any collective refused on one
           rank. The error is marked (REFUSED_UNDER_NUMBER) so that the Communicator's wrapper
           (_skips_on_argument_error) does not number a second call. A send or receive
           (`collective` False) takes no collective number.
        Host-staged, the channels this rank has are stopped instead (Staged.stop): a peer
        waiting in one raises CommAbortedError naming this rank, and so do this rank's GPU
        calls from now on."""
        if getattr(exc, _TOLD, False):
            return exc
        setattr(exc, _TOLD, True)
        engine = self._engine
        told = None  # the text appended when peers were told
        if self.size > 1 and self._staged is None and not self._closed:
            if engine.refuse(s) or (s != 0 and engine.refuse(0)):  # 0: s was no stream
                told = _STOPPED
        elif self.size > 1 and self._staged is not None and not self._closed:
            if self._staged.stop(failed=False):  # peers waiting in a StageChannel (staged.py)
                told = _STOPPED_STAGED
        if told:
            if len(exc.args) == 1 and isinstance(exc.args[0], str):
                exc.args = (exc.args[0] + told,)
        skip = getattr(self.comm, "_skip_call", None)
        if collective and self.size > 1 and skip is not None:
            from .._coll_args import REFUSED_UNDER_NUMBER
            skip()
            setattr(exc, REFUSED_UNDER_NUMBER, True)
        return exc

    @contextlib.contextmanager
    def _refusing(self, x: Any = None, stream: Any = None, collective: bool = True):
        """Around the argument checks of one call (x: its array, stream: its stream argument,
        both as the caller gave them; they name the stream the refusal is enqueued on): a
        ValueError or TypeError raised inside is reported (_refuse) and re-raised. Only checks
        belong inside: an error of an engine call or a host exchange is not this rank's
        refusal."""
        try:
            yield
        except (ValueError, TypeError) as exc:
            if not getattr(exc, _TOLD, False):
                self._refuse(self._refusal_stream(x, stream), exc, collective)
            raise

    def _refusal_stream(self, x: Any, stream: Any) -> int:
        """The stream the refused call would have run on, where it can be named (so this rank's
        earlier operations on it still complete first), else 0 (the legacy stream)."""
        try:
            v = None if x is None else view(x, "refusal")
            if v is not None and v.device is not None and v.device != self.device:
                v = None  # its library's current stream is another device's
            return stream_handle(stream, v)
        except Exception:  # noqa: BLE001 - a bad array or stream argument: the legacy stream
            try:
                return stream_handle(stream, None)
            except Exception:  # noqa: BLE001
                return 0
