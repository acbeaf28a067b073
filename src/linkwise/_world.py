"""The world communicator: :func:`init` (linkwise.init), and the numbering of the worlds
a process makes, which goes into the rendezvous store's token (see _worlds_made)."""
from __future__ import annotations

import functools
import hashlib
import os
import socket
from typing import Optional

from . import _launch_link, bootstrap, config
from ._setup import new_job_id
from .comm import Communicator, _live
from .errors import BootstrapError
from .store import _world_gap


def init(rank: Optional[int] = None, size: Optional[int] = None, addr: Optional[str] = None, *,
         timeout: Optional[float] = None) -> Communicator:
    """Join the job and return its world communicator.

    Reads rank, size and rank 0's address from ``linkwise launch``, torchrun, mpirun (Open MPI,
    MPICH/Hydra) or srun, or from the arguments (``addr`` is "host:port" of rank 0, which hosts
    the rendezvous store). With no launcher and no arguments: a single rank.
    """
    env = bootstrap.detect(rank=rank, size=size, addr=addr)
    if timeout is not None:
        setup_timeout = config.seconds(timeout, "init")
    else:
        try:
            setup_timeout = config.get("LINKWISE_TIMEOUT")
        except ValueError:  # raised on every rank once all have joined (refuse_bad_cards); until then:
            setup_timeout = config.TUNABLES["LINKWISE_TIMEOUT"].default
    rendezvous = (env.master_addr, env.master_port)
    if env.size > 1:
        _refuse_second_world(rendezvous)
    store = None
    job_id = env.job_id
    check = None
    if env.launcher == "linkwise" and env.size > 1:
        # Under `linkwise launch`: a rank that ends without joining is told here, and the
        # waits below give up on it (_launch_link).
        _launch_link.joining(env.rank)
        check = functools.partial(_launch_link.check, env.rank)
    try:
        if env.size > 1:
            world = _worlds_made.get(rendezvous, 0) + 1
            token = f"{_token_job_id(env.job_id)}|{env.size}|{env.master_port}|{world}"
            store = bootstrap.Store(env.master_addr, env.master_port, is_server=env.rank == 0,
                                    timeout=setup_timeout, spare_ports=env.spare_ports,
                                    token=token, port_source=env.port_source, check=check)
            store.join(env.rank, f"pid {os.getpid()} on {socket.gethostname()}")
            # Counted once joined, as the world joined (a later one where rank 0 retried), so
            # an attempt that never reached rank 0's store leaves the count as it was.
            _worlds_made[rendezvous] = world + max(0, _world_gap(store.joined_token, token.encode()) or 0)
            if not job_id:
                if env.rank == 0:
                    store.set("job_id", new_job_id().encode())
                job_id = store.get("job_id", setup_timeout).decode()
        job_id = job_id or new_job_id()
        job_id = "".join(ch for ch in job_id if ch.isalnum())[:24] or new_job_id()
        comm = Communicator(env.rank, env.size, local_rank=env.local_rank, local_size=env.local_size,
                            launcher=env.launcher, store=store, job_id=job_id, timeout=setup_timeout)
        comm._rendezvous = rendezvous if env.size > 1 else None
        if store is not None:
            store.settled()  # from now on this rank closing its store is not leaving setup
            store.check = None  # every rank joined: later waits (splits) are not init's
        return comm
    except BaseException:
        if store is not None:  # a failed init leaves no listener behind: a retry may bind the port again
            store.close()
        raise


# World communicators this process made, by rendezvous: the number goes into the store's
# token, so that a rank making the next world never joins the previous world's store, which
# rank 0 may not have closed yet (store._world_gap; a rank behind, whose rank 0 retried a
# failed init, still joins the later world's store). Contract: a world counts once this
# process joined (or, as rank 0, hosts) its store, and then as the number of the world joined.
# An attempt that failed before (rank 0 not up yet) does not count: counting it put a retrying
# rank a world ahead of its rank 0 on every retry, and it never joined rank 0's store.
_worlds_made: dict = {}

_MAX_TOKEN_JOB_ID = 64  # longer job ids go into the store's token hashed


def _token_job_id(job_id: str) -> str:
    """The job id as the store's token holds it: a long one (LINKWISE_JOB_ID of hundreds of
    characters made every token longer than a client reads, and every init() failed) is
    replaced by a digest of it, the same on every rank."""
    if len(job_id) <= _MAX_TOKEN_JOB_ID:
        return job_id
    return "sha256-" + hashlib.sha256(job_id.encode()).hexdigest()[:40]


def _refuse_second_world(rendezvous: tuple) -> None:
    """A second init() of the same job while its first world communicator is open would meet
    that one's rendezvous store (rank 0 could not listen on its port; the others joined the
    open store, whose keys were the first world's), so it is refused before anything moves."""
    for comm in list(_live):
        if not comm._closed and comm.__dict__.get("_rendezvous") == rendezvous:
            raise BootstrapError(
                f"rank {comm.rank}: init() was called again while this process's world communicator of the "
                f"same job (rendezvous {rendezvous[0]}:{rendezvous[1]}) is open; use that one, close() it "
                "first, or make sub-communicators with comm.split()")


def _forget_parents_worlds() -> None:
    """In a forked child: the parent's world counts are not the child's."""
    _worlds_made.clear()


os.register_at_fork(after_in_child=_forget_parents_worlds)
