"""Receives that do not fit and sends that time out, where the tag's order and the
communicator must survive them:
- a too-small receive posted before its message fails, and the message goes on to the next
  posted receive of its tag (before: to the unexpected queue, so the tag's next message took
  that receive and the two arrived swapped), small and large (single-copy) messages, shm and TCP;
- a send that times out while the ring is exactly full (none of its bytes written) is withdrawn
  and the communicator goes on (before: CommAbortedError, "timed out in the middle of a
  transfer"), for a staged message and for a single-copy one whose header never went out
  (the next single-copy message still pairs with its ack)."""
import time

import numpy as np
import pytest

from multirank import run_ranks


def _early_misfit(comm, nbytes):
    if comm.rank == 1:
        small, big = np.zeros(1, np.uint8), np.zeros(nbytes, np.uint8)
        q_small = comm.irecv(small, 0, tag=1)
        q_big = comm.irecv(big, 0, tag=1)
        comm.barrier()
        with pytest.raises(ValueError):
            q_small.wait()
        q_big.wait()
        nxt = np.zeros(nbytes, np.uint8)
        comm.recv(nxt, 0, tag=1)
        return int(big[0]), int(big[-1]), int(nxt[0]), int(nxt[-1])
    comm.barrier()
    comm.send(np.full(nbytes, 1, np.uint8), 1, tag=1)
    comm.send(np.full(nbytes, 2, np.uint8), 1, tag=1)
    return None


@pytest.mark.parametrize("nbytes", [100, 1 << 20])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_early_receive_too_small_keeps_the_tags_order(transport, nbytes):
    got = run_ranks(2, _early_misfit, nbytes, env={"LINKWISE_TRANSPORT": transport}, timeout=60)
    assert got[1] == (1, 1, 2, 2)


RING = 64 << 10
HEADER = 40  # bytes of a message header on the wire (csrc/p2p: MsgHeader)
FILL = 88  # staged messages of HEADER + FILL = 128 bytes: RING // 128 of them fill the ring exactly


def _send_times_out_on_a_full_ring(comm, late):
    """Rank 0 fills the ring while rank 1 sleeps, then a send of `late` bytes times out with
    none of it written (a staged message, or a single-copy one whose header waits)."""
    import linkwise
    count = RING // (HEADER + FILL)
    if comm.rank == 0:
        a = np.zeros(FILL, np.uint8)
        for k in range(count):
            a[:] = k % 251
            comm.send(a, 1, tag=1, timeout=10)
        t0 = time.monotonic()
        with pytest.raises(linkwise.TimeoutError):
            comm.send(np.full(late, 255, np.uint8), 1, tag=1, timeout=0.2)
        assert time.monotonic() - t0 < 2
        comm.send(np.full(late, 7, np.uint8), 1, tag=2, timeout=20)  # the communicator goes on
        comm.recv(np.zeros(1), 1, tag=3, timeout=20)  # rank 1 is done: exit only then
        return count
    time.sleep(1.5)  # rank 0 fills the ring meanwhile
    b = np.zeros(FILL, np.uint8)
    for k in range(count):
        comm.recv(b, 0, tag=1, timeout=20)
        assert (b == k % 251).all(), k
    c = np.zeros(late, np.uint8)
    comm.recv(c, 0, tag=2, timeout=20)
    assert (c == 7).all()
    with pytest.raises(linkwise.TimeoutError):  # the withdrawn message never arrives
        comm.recv(c, 0, tag=1, timeout=0.3)
    comm.send(np.zeros(1), 0, tag=3)
    return count


@pytest.mark.parametrize("late", [FILL, 1 << 20])
def test_send_timed_out_before_its_first_byte_is_withdrawn(late):
    env = {"LINKWISE_TRANSPORT": "shm", "LINKWISE_SHM_RING_SIZE": str(RING)}
    assert run_ranks(2, _send_times_out_on_a_full_ring, late, env=env, timeout=90) == [512, 512]
