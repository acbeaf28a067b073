"""Whether the members of a communicator being split off are still alive, for the waits of its
setup (Communicator.split; a GPU plane's setup too, cuda/plane_setup.py).

After init() every rank has settled in the rendezvous store, so the store no longer says when
one dies (store.RankLeftError is for init() only); the parent communicator's engine does: it
watches each peer's process (shared memory: a pidfd; TCP: the stream's end, seen once read).
Every wait of a split's setup (its card exchange, the store barriers and gets, accepting and
dialing TCP links, opening shared-memory inboxes) therefore waits in short slices and calls a
MemberWatch between them, which raises PeerError naming the dead member as the parent
numbers it. Only waits call it: a split whose peers are all there costs no extra round trip.

Threading: a MemberWatch may be called from the setup's threads (the TCP accept thread and
the caller); the engine's calls are thread-safe.
"""
from __future__ import annotations

from .errors import PeerError


class MemberWatch:
    """Raises PeerError when a member (a rank of the parent communicator) has died.

    ``native``: the parent's engine (None once the parent is closed: then nothing is known and
    nothing raises); ``rank``: this process's rank in the parent; ``members``: the parent ranks
    of the communicator being made, in its rank order (all of them for the split's own first
    exchange); ``what``: the setup step, for the message; ``op``: the PeerError's op;
    ``renumbered``: whether the message says what the dead rank was to be in the new
    communicator (not where the members keep their numbers: a GPU plane's setup,
    cuda/plane_setup.py)."""

    def __init__(self, native, rank: int, members: list[int], what: str, op: str = "split",
                 renumbered: bool = True):
        self.native, self.rank, self.members, self.what = native, rank, list(members), what
        self.op, self.renumbered = op, renumbered

    def alive(self, peer: int) -> bool:
        """Whether parent rank ``peer`` may still be alive (reads the links first: a TCP peer's
        end is known only once its stream has been read)."""
        native = self.native
        if native is None or peer == self.rank:
            return True
        native.poll()
        return native.peer_alive(peer)

    def __call__(self) -> None:
        native = self.native
        if native is None:
            return
        native.poll()  # one pass over every link: a TCP peer's end shows when its stream is read
        for new_rank, peer in enumerate(self.members):
            if peer != self.rank and not native.peer_alive(peer):
                to_be = f" (it was to be rank {new_rank} of the new communicator)" if self.renumbered else ""
                raise PeerError(
                    f"rank {self.rank}: rank {peer} died or left during {self.what}{to_be}: "
                    f"{native.describe_link(peer)}; see rank {peer}'s output for the cause",
                    rank=self.rank, peer=peer, op=self.op)
