"""linkwise launch and init(): a rank that ends without calling init() makes the others' init()
raise BootstrapError naming it, at once instead of at LINKWISE_TIMEOUT; a rank that ends after
joining, or a job that does not use linkwise, is no news."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from linkwise import _launch_link
from linkwise.errors import BootstrapError
from test_launch import SRC


def _body(*parts: str) -> str:
    return "".join(textwrap.dedent(part) for part in parts)


def _launch(tmp_path, body: str, n: int, *prefix: str, timeout: float = 40):
    script = tmp_path / "prog.py"
    script.write_text("import os, sys, time\nRANK = int(os.environ['LINKWISE_RANK'])\n"
                      f"D = {str(tmp_path)!r}\n" + body)
    env = dict(os.environ, PYTHONPATH=SRC, LINKWISE_TIMEOUT="60")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", str(n), *prefix, str(script)],
                       env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


JOIN = """
    import linkwise
    try:
        comm = linkwise.init()
    except linkwise.BootstrapError as e:
        print("refused:", e, flush=True)
        sys.exit(7)
"""


@pytest.mark.parametrize("leaver", [0, 2])
def test_a_rank_that_never_joins_is_named_at_once(tmp_path, leaver):
    """Rank 0 (the store's host: the others wait to reach it) or rank 2 (the others wait for
    its card) exits 0 while the others are in init(): they waited LINKWISE_TIMEOUT (here 60 s)
    and the launcher said nothing."""
    body = f"""
        if RANK == {leaver}:
            while len([f for f in os.listdir(D) if f.startswith("joining")]) < 2:
                time.sleep(0.02)
            time.sleep(0.5)  # the others are in init() by now
            sys.exit(0)
        import linkwise
        open(os.path.join(D, f"joining{{RANK}}"), "w").close()
    """
    p, elapsed = _launch(tmp_path, _body(body, JOIN), 3)
    assert p.returncode == 7, (p.stdout, p.stderr)
    assert elapsed < 20, elapsed
    others = [k for k in range(3) if k != leaver]
    for k in others:
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"[rank {k}] refused:"))
        assert f"rank {leaver} of this `linkwise launch` ended (exit status 0) without calling linkwise.init()" in line
    assert (f"linkwise launch: rank {leaver} exited with status 0 without calling linkwise.init(), which "
            f"rank(s) {', '.join(map(str, others))} wait in") in p.stderr, p.stderr


def test_a_rank_calling_init_after_another_left_is_refused_at_once(tmp_path):
    body = """
        if RANK == 1:
            sys.exit(0)
        time.sleep(1.5)  # rank 1 is gone by now
        t0 = time.monotonic()
    """
    join = JOIN.replace('print("refused:", e, flush=True)',
                        'print("refused:", e, "after", round(time.monotonic() - t0, 1), flush=True)')
    p, _ = _launch(tmp_path, _body(body, join), 2)
    assert p.returncode == 7, (p.stdout, p.stderr)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("[rank 0] refused:"))
    assert "rank 1 of this `linkwise launch` ended (exit status 0)" in line and float(line.split()[-1]) < 2.0, line


def test_ranks_that_end_after_joining_or_without_linkwise_are_no_news(tmp_path):
    """A rank that finishes its work and exits 0 while the others still run is normal; so are
    ranks of a program that never uses linkwise ending one after another."""
    body = """
        import linkwise
        comm = linkwise.init()
        comm.barrier()
        comm.close()
        if RANK == 0:
            time.sleep(1.5)
            comm = linkwise.init(rank=0, size=1)  # a job of its own: nothing to wait for
        print("finished", flush=True)
    """
    p, _ = _launch(tmp_path, _body(body), 2)
    assert p.returncode == 0 and p.stdout.count("finished") == 2 and p.stderr == "", (p.stdout, p.stderr)
    p, _ = _launch(tmp_path, "time.sleep(RANK * 0.7)\nprint('plain', flush=True)\n", 3)
    assert p.returncode == 0 and p.stdout.count("plain") == 3 and p.stderr == "", (p.stdout, p.stderr)


def test_a_process_the_rank_left_behind_may_still_join(tmp_path):
    """What counts is the launcher's socket, not the rank's process: a rank that starts the
    real program in the background (as a shell script may) and exits is not a rank that left."""
    body = """
        if RANK == 1 and not os.environ.get("CHILD"):
            fd = int(os.environ["LINKWISE_LAUNCH_FD"])
            import subprocess
            subprocess.Popen([sys.executable, *sys.argv], env=dict(os.environ, CHILD="1"), pass_fds=(fd,))
            sys.exit(0)
        time.sleep(0.5 if RANK == 0 else 1.0)
    """
    done = """
        comm.barrier()
        print("joined", RANK, flush=True)
        comm.close()
    """
    p, _ = _launch(tmp_path, _body(body, JOIN, done), 2)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert sorted(ln.split("] ")[1] for ln in p.stdout.splitlines() if "joined" in ln) == ["joined 0", "joined 1"]


def test_a_descriptor_that_is_not_the_launchers_is_left_alone(monkeypatch):
    """LINKWISE_LAUNCH_FD inherited by a process where that number is something else (the
    program closed it and opened another socket, or an outer launcher's variable): nothing is
    written to it, nothing read from it."""
    a, b = socket.socketpair()
    try:
        monkeypatch.setattr(_launch_link, "_opened", False)
        monkeypatch.setattr(_launch_link, "_link", None)
        monkeypatch.setattr(_launch_link, "_left", {})
        monkeypatch.setenv("LINKWISE_LAUNCH_FD", str(a.fileno()))
        monkeypatch.setenv("LINKWISE_LAUNCH_PID", str(os.getppid()))  # not this socket's peer
        b.send(b"left 1 0\n")
        _launch_link.joining(0)  # raises nothing: the socket is not used
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(10)  # "I" was not sent
        monkeypatch.setattr(_launch_link, "_opened", False)
        monkeypatch.setenv("LINKWISE_LAUNCH_PID", str(os.getpid()))  # now it is
        with pytest.raises(BootstrapError, match="rank 1 of this `linkwise launch` ended"):
            _launch_link.joining(0)
        assert b.recv(10) == b"I"
    finally:
        if _launch_link._link is not None:
            _launch_link._link.close()
        a.close()
        b.close()


def test_the_launchers_notice_wins_over_a_rank_that_left_because_of_it():
    """All the ranks in init() are told that rank 2 never came; the first to raise closes its
    store and so leaves setup, and the store told the others that rank (or rank 0) left: with
    3 ranks, most runs of test_a_rank_that_never_joins_is_named_at_once[2] named rank 1 or 0
    on a survivor. Whatever a store request would raise, the launcher's notice goes first."""
    from multirank import free_port
    from linkwise.bootstrap import Store
    told = []

    def check():
        if told:
            raise BootstrapError("rank 0: rank 2 of this `linkwise launch` ended (exit status 0) without calling "
                                 "linkwise.init()")
    port = free_port()
    with Store("127.0.0.1", port, is_server=True, timeout=10, check=check) as host:
        host.join(0, "rank 0")
        peer = Store("127.0.0.1", port, is_server=False, timeout=10)
        peer.join(1, "rank 1")
        told.append(True)  # both were told; rank 1 raised first and closed its store
        peer.close()
        t0 = time.monotonic()
        with pytest.raises(BootstrapError, match="rank 2 of this `linkwise launch` ended"):
            host.get("__ag/world/setup/cards/2", timeout=5)
        assert time.monotonic() - t0 < 2.0


def test_a_polled_all_gather_that_times_out_says_its_whole_timeout():
    """Under `linkwise launch` init()'s card exchange waits in 0.25 s slices (to read the
    launcher's notices); when the rank never came, its TimeoutError named the last slice
    ("nobody set it within 0.248 s" after LINKWISE_TIMEOUT), as a split's did."""
    from multirank import free_port
    from linkwise.bootstrap import Store
    from linkwise.errors import TimeoutError
    with Store("127.0.0.1", free_port(), is_server=True, timeout=10, check=lambda: None) as host:
        for kwargs in ({}, {"alive": lambda r: True}):
            with pytest.raises(TimeoutError, match=r"'__ag/cards\d/1': nobody set it within 0.7 s$"):
                host.all_gather(f"cards{len(kwargs)}", 0, 2, b"card", timeout=0.7, **kwargs)
