"""The rendezvous store on a derived port that something else holds (CI once failed this way:
torchrun's MASTER_PORT + 1 was taken, so rank 0 could not listen).

With ``spare_ports`` the server takes the first free port of ``port..port+k`` and clients keep
the candidate whose server answers HELLO with the job's token."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from linkwise.bootstrap import SPARE_PORTS, Store, detect
from linkwise.errors import BootstrapError
from test_launchers import SCRIPT as RING_SCRIPT  # a 3-rank ring over shared memory


def free_run(n: int) -> int:
    """A port p such that p..p+n-1 can all be bound right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        held = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    pytest.fail("no run of free ports found")


def silent_listener(port: int) -> socket.socket:
    """A foreign listener that accepts (through the backlog) and never answers."""
    return socket.create_server(("127.0.0.1", port))


def garbage_listener(port: int) -> socket.socket:
    """A foreign listener that answers every connection with a huge frame length."""
    srv = socket.create_server(("127.0.0.1", port))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.sendall(b"\xff\xff\xff\xf0garbage")
    threading.Thread(target=serve, daemon=True).start()
    return srv


def clients(base: int, token: str, n: int, spare: int = 4) -> list:
    """Connect n clients from threads; returns their Store objects (or exceptions)."""
    out = [None] * n

    def one(i):
        try:
            out[i] = Store("127.0.0.1", base, is_server=False, timeout=20, token=token,
                           spare_ports=spare)
        except Exception as exc:  # reported by the caller's asserts
            out[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("foreign", [silent_listener, garbage_listener])
def test_foreign_listener_is_skipped(foreign):
    base = free_run(6)
    blocker = foreign(base)
    try:
        with Store("127.0.0.1", base, is_server=True, timeout=20, token="job1",
                   spare_ports=4) as server:
            assert server.port == base + 1
            got = clients(base, "job1", 2)
            assert all(isinstance(c, Store) for c in got), got
            assert [c.port for c in got] == [base + 1, base + 1]
            got[0].set("k", b"v")
            assert got[1].get("k", 5) == b"v" and server.get("k", 5) == b"v"
            for c in got:
                c.close()
    finally:
        blocker.close()


def test_port_held_by_an_outgoing_connection():
    """A local port that an outgoing connection uses cannot be listened on either."""
    base = free_run(4)
    target = socket.create_server(("127.0.0.1", 0))
    out = socket.socket()
    out.bind(("127.0.0.1", base))
    out.connect(target.getsockname())
    try:
        with pytest.raises(BootstrapError, match="LINKWISE_MASTER_PORT"):
            Store("127.0.0.1", base, is_server=True, timeout=1)  # no spare ports: as before
        with Store("127.0.0.1", base, is_server=True, timeout=10, token="t",
                   spare_ports=2) as server:
            assert server.port == base + 1
            (c,) = clients(base, "t", 1, spare=2)
            assert isinstance(c, Store) and c.port == base + 1
            c.add("n", 3)
            assert server.add("n", 1) == 4
            c.close()
    finally:
        out.close()
        target.close()


def test_two_jobs_on_one_base_port_stay_apart():
    base = free_run(6)
    with Store("127.0.0.1", base, is_server=True, timeout=10, token="A", spare_ports=4) as a, \
            Store("127.0.0.1", base, is_server=True, timeout=10, token="B", spare_ports=4) as b:
        assert (a.port, b.port) == (base, base + 1)
        (ca,) = clients(base, "A", 1)
        (cb,) = clients(base, "B", 1)
        assert (ca.port, cb.port) == (base, base + 1)
        ca.set("who", b"A")
        cb.set("who", b"B")
        assert a.get("who", 5) == b"A" and b.get("who", 5) == b"B"
        ca.close()
        cb.close()


@pytest.mark.parametrize("theirs", ["jobB|2|{p}", "jobA|3|{p}"], ids=["another-job", "another-size"])
def test_a_port_the_user_gave_is_checked_too(theirs):
    """With no spare ports (an explicit addr or LINKWISE_MASTER_PORT) a client still checks the
    store's token: another job's store, or one started with another size, is never joined (a
    job's rank 1 used to join another job's rank 0 on the same port and sum with it)."""
    port = free_run(1)
    with Store("127.0.0.1", port, is_server=True, timeout=10, token=f"jobA|2|{port}") as a:
        ok = Store("127.0.0.1", port, is_server=False, timeout=5, token=f"jobA|2|{port}")
        ok.set("k", b"v")
        assert a.get("k", 5) == b"v"
        ok.close()
        t0 = time.monotonic()
        with pytest.raises(BootstrapError, match="another job's or has another size") as info:
            Store("127.0.0.1", port, is_server=False, timeout=30, token=theirs.format(p=port))
        assert f"'jobA|2|{port}'" in str(info.value)
        assert time.monotonic() - t0 < 5  # at once, not at the timeout: the port is taken for good
        with pytest.raises(TimeoutError):
            a.get("intruder", 0.2)  # nothing of the refused client reached the store


def test_client_started_before_the_server_finds_it():
    base = free_run(6)
    blocker = silent_listener(base)
    result = []
    t = threading.Thread(target=lambda: result.extend(clients(base, "late", 1)))
    t.start()
    time.sleep(0.5)
    try:
        with Store("127.0.0.1", base, is_server=True, timeout=20, token="late",
                   spare_ports=4) as server:
            t.join(30)
            assert len(result) == 1 and isinstance(result[0], Store), result
            assert result[0].port == server.port == base + 1
            result[0].close()
    finally:
        blocker.close()


def test_all_candidates_taken_names_the_range():
    base = free_run(3)
    blockers = [silent_listener(p) for p in range(base, base + 3)]
    try:
        with pytest.raises(BootstrapError, match=rf"{base}\.\.{base + 2}.*LINKWISE_MASTER_PORT"):
            Store("127.0.0.1", base, is_server=True, timeout=1, spare_ports=2)
        t0 = time.monotonic()
        with pytest.raises(BootstrapError, match=rf"{base}\.\.{base + 2}"):
            Store("127.0.0.1", base, is_server=False, timeout=1, token="x", spare_ports=2)
        assert time.monotonic() - t0 < 5  # not a whole round of silent candidates (2 s each) past the 1 s timeout
    finally:
        for b in blockers:
            b.close()


def test_detect_marks_derived_ports(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("LINKWISE_", "OMPI_", "PMI", "SLURM_", "TORCHELASTIC")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    e = detect()
    assert e.master_port == 29501 and e.spare_ports == SPARE_PORTS
    monkeypatch.setenv("LINKWISE_MASTER_PORT", "31000")
    e = detect()
    assert e.master_port == 31000 and e.spare_ports == 0
    assert detect(rank=1, size=2, addr="127.0.0.1:32000").spare_ports == 0
    monkeypatch.setenv("LINKWISE_MASTER_PORT_SPARE", "3")
    assert detect().spare_ports == 3
    monkeypatch.setenv("LINKWISE_MASTER_PORT_SPARE", "-1")
    with pytest.raises(ValueError, match="LINKWISE_MASTER_PORT_SPARE"):
        detect()


def test_init_under_torchrun_variables_with_master_port_plus_one_taken(tmp_path):
    """What CI hit: torchrun's variables, MASTER_PORT + 1 held by someone else."""
    base = free_run(SPARE_PORTS + 2)
    blocker = silent_listener(base + 1)
    script = tmp_path / "ring.py"
    script.write_text(RING_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LINKWISE_", "OMPI_"))}
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p)
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    env.update(WORLD_SIZE="3", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(base), TORCHELASTIC_RUN_ID="ci42")
    try:
        procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(3)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        blocker.close()
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    got = sorted(line.split()[1:] for o in outs for line in o.splitlines()
                 if line.startswith("RESULT"))
    assert got == [[str(r), "3", "torchrun", str((r - 1) % 3)] for r in range(3)], outs


def test_cannot_listen_names_where_the_port_came_from(monkeypatch):
    """The hint used to name LINKWISE_MASTER_PORT whatever had set the port."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        for source, hint in [("addr", r"addr='host:port'"), ("LINKWISE_MASTER_PORT", "LINKWISE_MASTER_PORT"),
                             ("MASTER_PORT", r"MASTER_PORT \+ 1"), ("derived", "LINKWISE_MASTER_PORT")]:
            with pytest.raises(BootstrapError, match=hint):
                Store("127.0.0.1", port, is_server=True, timeout=1, port_source=source)
    for name in list(os.environ):
        if name.startswith(("LINKWISE_", "OMPI_", "PMI", "SLURM_", "TORCHELASTIC")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name)
    assert detect(rank=0, size=2, addr=f"127.0.0.1:{port}").port_source == "addr"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert detect().port_source == "MASTER_PORT"
    monkeypatch.setenv("LINKWISE_MASTER_PORT", str(port))
    assert detect().port_source == "LINKWISE_MASTER_PORT"


def test_an_earlier_world_is_waited_out_and_a_later_one_joined():
    """linkwise.init numbers the worlds a process makes in the token (`job|size|port|world`): a
    client of world 2 skips world 1's store, still open, and joins world 2's once it listens;
    a client of world 1 joins world 2's store (rank 0 retried a failed init)."""
    import threading
    port = free_run(1)
    old = Store("127.0.0.1", port, is_server=True, timeout=10, token=f"j|2|{port}|1")
    joined = {}

    def client():
        joined["store"] = Store("127.0.0.1", port, is_server=False, timeout=20, token=f"j|2|{port}|2")
    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.5)
    assert "store" not in joined  # still waiting: world 1's store is not world 2's
    old.close()
    with Store("127.0.0.1", port, is_server=True, timeout=10, token=f"j|2|{port}|2") as new:
        t.join(20)
        joined["store"].set("k", b"v")
        assert new.get("k", 5) == b"v"
        joined["store"].close()
        behind = Store("127.0.0.1", port, is_server=False, timeout=5, token=f"j|2|{port}|1")
        behind.set("k2", b"w")
        assert new.get("k2", 5) == b"w"
        behind.close()
