"""Point-to-point when a peer dies: PeerError instead of a hang, order kept, nothing left
in /dev/shm (shared memory and forced TCP)."""
import glob
import os
import signal
import time

import numpy as np
import pytest

from multirank import run_ranks, shm_of_this_process


def _killed_peer(comm, mode):
    if comm.rank == 1:
        y = np.zeros(10, np.float32)
        comm.recv(y, 0, tag=1)  # rank 0 is alive and ready
        time.sleep(0.2)  # not in a linkwise call: rank 0's stream backs up, then we die
        os.kill(os.getpid(), signal.SIGKILL)
    import linkwise
    comm.send(np.ones(10, np.float32), 1, tag=1)
    t0 = time.monotonic()
    with pytest.raises(linkwise.PeerError, match="rank 1") as info:
        if mode == "recv":
            comm.recv(np.zeros(10, np.float32), 1, tag=2, timeout=60)
        else:
            for _ in range(100):  # fills the ring / socket, then must notice the death
                comm.send(np.ones(1 << 20, np.uint8), 1, tag=2, timeout=60)
    assert info.value.peer == 1
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed  # the engine checks every 0.1 s; slack for a loaded CI box
    return "raised"


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_sigkilled_peer_raises_peer_error(mode, transport_env, shm_clean):
    out = run_ranks(2, _killed_peer, mode, env=transport_env, expect_fail=True)
    assert out[0] == ("ok", "raised"), out[0]
    assert out[1][0] == "died"
    assert not shm_of_this_process()


def _announced_then_killed(comm):
    """Rank 1 announces a large single-copy message to rank 0 and dies before rank 0 posts its
    receive. Rank 0's failed copy must fail every receive from rank 1 after it, the one that
    matches the dead message's tag included (which once waited for the whole timeout)."""
    if comm.rank == 1:
        comm.isend(np.ones(1 << 20, np.float32), 0, tag=1)  # announced: rank 0 copies it later
        os.kill(os.getpid(), signal.SIGKILL)
    import linkwise
    time.sleep(0.5)  # rank 1 is gone before this rank reads its announcement
    t0 = time.monotonic()
    with pytest.raises(linkwise.PeerError) as first:
        comm.recv(np.zeros(4, np.float32), 1, tag=2, timeout=30)  # reads it, fails to copy it
    with pytest.raises(linkwise.PeerError) as second:
        comm.recv(np.zeros(1 << 20, np.float32), 1, tag=1, timeout=30)
    assert first.value.peer == second.value.peer == 1
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed
    return "raised"


def test_receive_after_a_dead_peers_announced_message_raises(shm_clean):
    out = run_ranks(2, _announced_then_killed, env={"LINKWISE_TRANSPORT": "shm"}, expect_fail=True)
    assert out[0] == ("ok", "raised"), out[0]
    assert out[1][0] == "died"


def _order_after_dead_sender(comm):
    """Rank 1 queues A and B (single-copy) and C (small) on one tag and dies; rank 0 has read
    their announcements before receiving them. A and B cannot be copied any more: their
    receives raise PeerError, and C still goes to the third receive (once, B's got C's bytes)."""
    if comm.rank == 1:
        big = 100_000
        for i, arr in enumerate([np.zeros(1), np.full(big, 1.0), np.full(big, 2.0), np.full(10, 3.0)]):
            comm.isend(arr, 0, tag=9 if i == 0 else 5)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    import linkwise
    time.sleep(0.8)
    comm.recv(np.zeros(1), 1, tag=9, timeout=10)  # reads the stream past A, B and C
    outcome = []
    for n in (100_000, 100_000, 10):
        y = np.zeros(n)
        try:
            got = comm.recv(y, 1, tag=5, timeout=10)
            outcome.append(("got", got, np.unique(y[:got // 8]).tolist()))
        except linkwise.PeerError as exc:
            outcome.append(("PeerError", exc.peer))
    return outcome


def test_failed_copies_keep_their_place_in_order(shm_clean):
    out = run_ranks(2, _order_after_dead_sender, env={"LINKWISE_TRANSPORT": "shm"}, expect_fail=True)
    assert out[0] == ("ok", [("PeerError", 1), ("PeerError", 1), ("got", 80, [3.0])]), out[0]


def _polling_test_sees_death(comm):
    if comm.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    import linkwise
    req = comm.irecv(np.zeros(10), 1, tag=0)
    t0 = time.monotonic()
    with pytest.raises(linkwise.PeerError) as info:
        while not req.test():
            assert time.monotonic() - t0 < 10, "test() never noticed the dead peer"
            time.sleep(0.001)
    assert info.value.peer == 1
    return "raised"


def test_polling_with_test_notices_a_dead_peer(transport_env, shm_clean):
    out = run_ranks(2, _polling_test_sees_death, env=transport_env, expect_fail=True)
    assert out[0] == ("ok", "raised"), out[0]




def test_ranks_killed_during_setup_leave_nothing_in_dev_shm(tmp_path):
    """Ranks 0 and 1 of a three-rank job map their inboxes and wait for rank 2, which stalls
    right after the exchange of cards; SIGKILL them all there. Shared memory lives only as long as its mappings: nothing of
    the job may remain in /dev/shm (containers often have only 64 MiB of it)."""
    import subprocess
    import sys
    from multirank import free_port

    job = f"setupkill{os.getpid()}"
    env = dict(os.environ, LINKWISE_SIZE="3", LINKWISE_LOCAL_SIZE="3", LINKWISE_JOB_ID=job,
               LINKWISE_MASTER_ADDR="127.0.0.1", LINKWISE_MASTER_PORT=str(free_port()),
               LINKWISE_TIMEOUT="60")
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep))
    stall = ("import time, linkwise, linkwise._setup as s\n"
             "cards = s.exchange_cards\n"
             "def stalled(*a, **k):\n    out = cards(*a, **k)\n    time.sleep(120)\n    return out\n"
             "s.exchange_cards = stalled\nlinkwise.init()\n")
    procs = [subprocess.Popen([sys.executable, "-c", "import linkwise; linkwise.init()" if r < 2 else stall],
                              env=dict(env, LINKWISE_RANK=str(r), LINKWISE_LOCAL_RANK=str(r)))
             for r in (0, 1, 2)]
    try:
        deadline = time.monotonic() + 30
        mapped = set()
        while len(mapped) < 2 and time.monotonic() < deadline:  # both inboxes exist
            for p in procs[:2]:
                with open(f"/proc/{p.pid}/maps") as f:
                    if f"linkwise-{job}-" in f.read():
                        mapped.add(p.pid)
            time.sleep(0.02)
        assert len(mapped) == 2, "the ranks never created their shared memory"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not glob.glob(f"/dev/shm/linkwise-{job}-*")
