"""The exception hierarchy of linkwise.

Contract: recoverable failures (a timeout, a peer that died, a refused connection) raise one of
these with the rank, the peer and the operation in the message, and a hint of what to try.
Wrong arguments raise the built-in ValueError / TypeError instead.
"""
from __future__ import annotations

import builtins


class LinkwiseError(RuntimeError):
    """Base class of every runtime failure raised by linkwise."""


class PeerError(LinkwiseError):
    """A peer process died or closed its connection while an operation needed it.

    ``rank`` is the caller's rank, ``peer`` the rank that failed (-1 where unknown), ``op``
    the operation where the raising code names it (else "").
    """

    def __init__(self, message: str, rank: int = -1, peer: int = -1, op: str = ""):
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.op = op


class TimeoutError(LinkwiseError, builtins.TimeoutError):  # noqa: A001 - deliberate
    """A blocking call did not complete within its timeout (``LINKWISE_TIMEOUT`` or ``timeout=``)."""


class BootstrapError(LinkwiseError):
    """Rendezvous failed: the store could not be reached, or ranks disagreed on the job."""


class CommAbortedError(LinkwiseError):
    """The communicator was aborted after an earlier failure and can no longer be used."""
