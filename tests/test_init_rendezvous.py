"""init() meeting rank 0's store: a rank that retries init() while rank 0 is not up yet, a rank
of another job (or a duplicate rank) on the same port with no LINKWISE_JOB_ID, a very long
LINKWISE_JOB_ID, and a LINKWISE_TIMEOUT too long for a socket."""
from __future__ import annotations

import os
import time

import numpy as np

from multirank import run_ranks


def _retry_until_rank_0_is_up(rank, n):
    """Rank 1's first attempts fail (rank 0 starts 2.5 s late); a later one must meet rank 0.
    Each failed attempt used to count a world, so rank 1's token named a world ahead of rank
    0's and it took rank 0's store for its previous world's, on every retry."""
    import linkwise
    if rank == 0:
        time.sleep(2.5)
        comm = linkwise.init(timeout=5)
        failures = 0
    else:
        for failures in range(8):
            try:
                comm = linkwise.init(timeout=1)
                break
            except linkwise.BootstrapError:
                continue
        else:
            return "never met rank 0"
    x = np.ones(2)
    comm.all_reduce(x)
    comm.barrier()
    comm.close()
    return float(x[0]), failures > 0 if rank else True


def test_a_rank_retrying_init_meets_rank_0_once_it_is_up():
    out = run_ranks(2, _retry_until_rank_0_is_up, init=False, timeout=60)
    assert out == [(2.0, True)] * 2


def _one_rank_twice(rank, n):
    """Processes 1 and 2 both start as rank 1 of a 2-rank job on one port with no job id (as
    two jobs would): the second to come must be refused at once, naming the cause, and the
    first job must work. Before, it joined too and failed later with '3 callers for size 2'
    (or took the first one's place)."""
    import linkwise
    addr = f"127.0.0.1:{os.environ['LINKWISE_MASTER_PORT']}"
    if rank == 2:
        time.sleep(1.0)
    t0 = time.monotonic()
    try:
        comm = linkwise.init(rank=min(rank, 1), size=2, addr=addr)
    except linkwise.BootstrapError as exc:
        return "refused", str(exc), time.monotonic() - t0
    x = np.ones(2)
    comm.all_reduce(x)
    time.sleep(2.0)  # the store stays open while process 2 comes
    comm.barrier()
    comm.close()
    return "ok", float(x[0]), 0.0


def test_a_second_process_joining_as_a_rank_already_joined_is_refused():
    out = run_ranks(3, _one_rank_twice, init=False, timeout=60,
                    env={"LINKWISE_JOB_ID": "", "LINKWISE_MASTER_PORT_SPARE": "0", "LINKWISE_TIMEOUT": "10"})
    assert out[0] == out[1] == ("ok", 2.0, 0.0), out
    kind, message, seconds = out[2]
    assert kind == "refused" and "already joined the rendezvous store" in message, out
    assert "as rank 1" in message and "LINKWISE_JOB_ID" in message, out
    assert seconds < 5, out


def _all_reduce(comm):
    x = np.ones(3)
    comm.all_reduce(x)
    return float(x[0])


def test_a_job_id_longer_than_a_store_token_holds_works():
    # The token (job|size|port|world) outgrew what a client reads: every init() failed.
    assert run_ranks(2, _all_reduce, env={"LINKWISE_JOB_ID": "x" * 300, "LINKWISE_TIMEOUT": "10"},
                     timeout=60) == [2.0, 2.0]


def test_a_timeout_beyond_what_a_socket_takes_works(transport_env):
    # 1e10 s raised OverflowError in the store client's settimeout (and in select, over TCP).
    env = dict(transport_env, LINKWISE_TIMEOUT="1e10")
    assert run_ranks(2, _all_reduce, env=env, timeout=60) == [2.0, 2.0]
