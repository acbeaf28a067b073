"""Whether the members of a communicator being split off are still alive, for the waits of its
setup (Communicator.split; a GPU plane's setup too, cuda/plane_setup.py).

After init() every rank has settled in the rendezvous store, so the store no longer says when
one dies (store.RankLeftError is for init() only); the parent communicator's engine does: it
watches each peer's process (shared memory: a pidfd; TCP: the stream's end, seen once read).
Every wait of a split's setup (its card exchange, the store barriers and gets, accepting and
dialing TCP links, opening shared-memory inboxes) therefore waits in short slices and calls a
MemberWatch between them, which raises PeerError naming the dead member as the parent
numbers it. Only waits call it: a split whose peers are all there costs no extra round trip.

Who failed first: a member that raised because another died may well exit before the others
look, and then looks as dead as the one that died. So a member whose split failed on a death
first records in the store whom it named (:func:`record_cause`, under the watch's ``notes``
prefix), and a watch that finds a member dead follows those records to the member that died
without one: the survivors name the rank that actually died, not a survivor that left first.
The record is written (and acknowledged by the store) before the error is raised, so it is
there before that member can exit. The store's host (parent rank 0) is the exception: once it
left, its store and its record went with it (the others get StoreClosedError naming rank 0).

Threading: a MemberWatch may be called from the setup's threads (the TCP accept thread and
the caller); the engine's calls and the store's are thread-safe.
"""
from __future__ import annotations

from typing import Optional

from .errors import PeerError


def record_cause(store, notes: str, rank: int, dead: int) -> None:
    """Record under ``notes`` that parent rank ``rank`` gives up its split because parent rank
    ``dead`` died. Best effort: the store may be gone too (then nobody can read it anyway), and
    the caller's own error is what matters, so a failure here is not raised."""
    try:
        store.set(f"{notes}/{int(rank)}", str(int(dead)).encode())
    except Exception:  # noqa: BLE001 - see the docstring: the split's error is raised instead
        pass


class MemberWatch:
    """Raises PeerError when a member (a rank of the parent communicator) has died.

    ``native``: the parent's engine (None once the parent is closed: then nothing is known and
    nothing raises); ``rank``: this process's rank in the parent; ``members``: the parent ranks
    of the communicator being made, in its rank order (all of them for the split's own first
    exchange); ``what``: the setup step, for the message; ``store`` and ``notes``: where the
    members record whom they named (see the module docstring; None: no records are read);
    ``op``: the PeerError's op; ``renumbered``: whether the message says what the dead rank
    was to be in the new communicator (not where the members keep their numbers: a GPU
    plane's setup, cuda/plane_setup.py)."""

    def __init__(self, native, rank: int, members: list[int], what: str, store=None, notes: str = "",
                 op: str = "split", renumbered: bool = True):
        self.native, self.rank, self.members, self.what = native, rank, list(members), what
        self.store, self.notes = store, notes
        self.op, self.renumbered = op, renumbered

    def alive(self, peer: int) -> bool:
        """Whether parent rank ``peer`` may still be alive (reads the links first: a TCP peer's
        end is known only once its stream has been read)."""
        native = self.native
        if native is None or peer == self.rank:
            return True
        native.poll()
        return native.peer_alive(peer)

    def recorded_cause(self, peer: int) -> Optional[int]:
        """The member ``peer`` named when its split failed, if it recorded one (one store
        request that does not wait); None if it recorded none or the store cannot say."""
        if self.store is None:
            return None
        try:
            named = self.store.get(f"{self.notes}/{peer}", 0).decode()
        except Exception:  # noqa: BLE001 - no record (TimeoutError), or the store is gone
            return None
        return int(named) if named.isdigit() else None

    def first_dead(self, peer: int) -> int:
        """``peer`` (a dead member), or the member it named as the cause of its failure, and
        so on, to the first that named none: the member that actually died."""
        seen = {peer}
        while True:
            cause = self.recorded_cause(peer)
            if cause is None or cause in seen or cause not in self.members or cause == self.rank:
                return peer
            seen.add(cause)
            peer = cause

    def __call__(self) -> None:
        native = self.native
        if native is None:
            return
        native.poll()  # one pass over every link: a TCP peer's end shows when its stream is read
        for peer in self.members:
            if peer != self.rank and not native.peer_alive(peer):
                dead = self.first_dead(peer)
                left = "" if dead == peer else f" (rank {peer} gave up because of it and left too)"
                to_be = (f" (it was to be rank {self.members.index(dead)} of the new communicator)"
                         if self.renumbered else "")
                raise PeerError(
                    f"rank {self.rank}: rank {dead} died or left during {self.what}{to_be}{left}: "
                    f"{native.describe_link(dead)}; see rank {dead}'s output for the cause",
                    rank=self.rank, peer=dead, op=self.op)
