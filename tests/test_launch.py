"""linkwise launch: environment, prefixed output, failure handling, binding, /dev/shm cleanup."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from linkwise import launch

import linkwise

SRC = str(Path(linkwise.__file__).resolve().parents[1])  # the linkwise under test


def run_launch(tmp_path, body: str, *opts: str, timeout: float = 20, script_args=()):
    script = tmp_path / "prog.py"
    script.write_text("import os, sys, time, signal\n"
                      "RANK = int(os.environ['LINKWISE_RANK'])\n" + body)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", *opts, str(script),
                        *script_args], env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_environment_and_prefixed_output(tmp_path):
    body = ("e = os.environ\n"
            "print('hello', RANK, e['LINKWISE_SIZE'], e['LINKWISE_LOCAL_RANK'], "
            "e['LINKWISE_LOCAL_SIZE'], e['LINKWISE_MASTER_ADDR'], e['LINKWISE_MASTER_PORT'], "
            "e['LINKWISE_JOB_ID'], e['PYTHONUNBUFFERED'], sys.argv[1:])\n"
            "print('oops', RANK, file=sys.stderr)\n"
            "sys.stdout.write('no newline')\n")
    p, _ = run_launch(tmp_path, body, "-n", "3", "--master-port", "24567",
                      script_args=["-n", "9", "--flag"])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    jobs = set()
    for k in range(3):
        mine = [ln for ln in lines if ln.startswith(f"[rank {k}] hello")]
        assert len(mine) == 1, lines
        f = mine[0].split(" ", 2)[2].split(" ", 8)
        assert f[:8] == ["hello", str(k), "3", str(k), "3", "127.0.0.1", "24567", f[7]]
        assert mine[0].endswith("1 ['-n', '9', '--flag']")
        jobs.add(f[7])
        assert f"[rank {k}] oops {k}" in p.stderr.splitlines()
        assert f"[rank {k}] no newline" in lines
    assert len(jobs) == 1 and len(jobs.pop()) == 16
    assert all(ln.startswith("[rank ") for ln in lines)


def test_reader_going_away_does_not_break_the_job(tmp_path):
    """`linkwise launch ... | head -1`: once the pipe's reader is gone, the ranks' output is
    dropped, every rank still runs to its end (it would block on a full pipe otherwise), the
    launcher exits 0 and prints no traceback."""
    done = tmp_path / "done"
    script = tmp_path / "prog.py"
    script.write_text("import os, pathlib\n"
                      "for i in range(20000):\n    print('line', i, 'x' * 60)\n"
                      f"pathlib.Path({str(done)!r} + os.environ['LINKWISE_RANK']).touch()\n")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launcher = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert launcher.stdout.readline().startswith(b"[rank ")
    launcher.stdout.close()  # the reader goes away, as `head -1` does
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err
    assert all(Path(f"{done}{r}").exists() for r in (0, 1))


def test_free_port_chosen(tmp_path):
    body = ("from linkwise.bootstrap import detect\n"
            "print(os.environ['LINKWISE_MASTER_PORT'], detect().spare_ports)\n")
    p, _ = run_launch(tmp_path, body, "-n", "2")
    rows = {tuple(ln.split()[-2:]) for ln in p.stdout.splitlines()}
    assert p.returncode == 0 and len(rows) == 1, p.stdout + p.stderr
    port, spare = rows.pop()
    # a port found free is not reserved: the store may move up if it is taken by then
    assert 0 < int(port) < 65536 and spare == "8"
    p, _ = run_launch(tmp_path, body, "-n", "2", "--master-port", "24568")
    assert p.returncode == 0 and {ln.split(" ", 2)[2] for ln in p.stdout.splitlines()} == {"24568 0"}


def test_module_mode(tmp_path):
    (tmp_path / "mymod.py").write_text("import os, sys\nprint('mod', os.environ['LINKWISE_RANK'], sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(tmp_path)]))
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", "-m", "mymod",
                        "--help"], env=env, capture_output=True, text=True, timeout=20)
    assert p.returncode == 0, p.stderr
    assert "[rank 1] mod 1 ['--help']" in p.stdout.splitlines()


def test_program_mode(tmp_path):
    """mpirun's form (a program on PATH, then its arguments) and --no-python: run as given; a
    script path still runs with this Python."""
    (tmp_path / "s.py").write_text("import os, sys\nprint('py', os.environ['LINKWISE_RANK'], sys.argv[1:])\n"
                                   "sys.exit(int(sys.argv[1]))\n")
    env = dict(os.environ, PYTHONPATH=SRC)
    exe_dir = os.path.dirname(sys.executable)
    env["PATH"] = exe_dir + os.pathsep + env.get("PATH", "")
    py = os.path.basename(sys.executable)
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", py, str(tmp_path / "s.py"), "4"],
                       env=env, capture_output=True, text=True, timeout=20)
    assert p.returncode == 4, p.stderr
    assert "[rank 1] py 1 ['4']" in p.stdout.splitlines()
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", "--no-python", "sh", "-c",
                        "echo sh $LINKWISE_RANK $LINKWISE_SIZE"], env=env, capture_output=True, text=True, timeout=20)
    assert p.returncode == 0, p.stderr
    assert sorted(ln for ln in p.stdout.splitlines() if " sh " in ln) == ["[rank 0] sh 0 2", "[rank 1] sh 1 2"]
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "1", "no-such-script.py"],
                       env=env, capture_output=True, text=True, timeout=20)
    assert p.returncode != 0 and "no-such-script.py" in p.stdout + p.stderr  # Python says it is missing


PIDS = ("open(os.path.join({d!r}, str(RANK)), 'w').write(str(os.getpid()))\n")


def _wait_others(tmp_path, n):
    return (f"while len(os.listdir({str(tmp_path / 'pids')!r})) < {n}:\n"
            f"    time.sleep(0.01)\n")


@pytest.mark.parametrize("how, message, code", [
    ("sys.exit(3)", "linkwise launch: rank 1 exited with status 3", 3),
    ("os.kill(os.getpid(), signal.SIGKILL)", "linkwise launch: rank 1 was killed by signal SIGKILL",
     128 + 9),
])
def test_failing_rank_stops_the_others(tmp_path, how, message, code):
    (tmp_path / "pids").mkdir()
    body = (PIDS.format(d=str(tmp_path / "pids")) + _wait_others(tmp_path, 3)
            + f"if RANK == 1:\n    {how}\ntime.sleep(60)\n")
    p, elapsed = run_launch(tmp_path, body, "-n", "3")
    assert p.returncode == code, p.stderr
    assert message in p.stderr
    assert "rank 0 was killed" not in p.stderr  # only the first failure is reported
    assert elapsed < 10
    pids = [int((tmp_path / "pids" / str(k)).read_text()) for k in range(3)]
    assert not any(alive(pid) for pid in pids)


def test_rank_ignoring_sigterm_gets_killed(tmp_path):
    (tmp_path / "pids").mkdir()
    # rank 1 ignores SIGTERM before it announces itself, so the launcher's SIGTERM always
    # finds it ignoring (and must escalate to SIGKILL after the grace period)
    body = ("if RANK != 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            + PIDS.format(d=str(tmp_path / "pids")) + _wait_others(tmp_path, 2)
            + "if RANK == 0:\n    sys.exit(1)\ntime.sleep(60)\n")
    p, elapsed = run_launch(tmp_path, body, "-n", "2")
    assert p.returncode == 1 and "rank 0 exited with status 1" in p.stderr
    grace = launch.PEER_GRACE + launch.TERM_GRACE
    assert grace - 0.5 < elapsed < grace + 5
    assert not alive(int((tmp_path / "pids" / "1").read_text()))


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_sigint_is_forwarded(tmp_path, sigint_ignored):
    """Also when the launcher starts with SIGINT ignored (a background job of a non-interactive
    shell): the ranks must not inherit that, or a forwarded SIGINT would do nothing."""
    (tmp_path / "pids").mkdir()
    script = tmp_path / "prog.py"
    script.write_text("import os, time\nRANK = int(os.environ['LINKWISE_RANK'])\n"
                      + PIDS.format(d=str(tmp_path / "pids")) + "print('ready', flush=True)\n"
                      "time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=SRC)
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    p = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=ignore)
    for _ in range(2):
        assert "ready" in p.stdout.readline()
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    pids = [int((tmp_path / "pids" / str(k)).read_text()) for k in range(2)]
    try:
        p.communicate(timeout=10)
    finally:  # on failure, leave nothing running
        p.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert p.returncode != 0 and time.monotonic() - t0 < 8
    assert not any(alive(pid) for pid in pids)


def test_shm_cleanup(tmp_path):
    other = Path(launch.SHM_DIR) / f"linkwise-notmine{os.getpid()}-x"
    other.write_bytes(b"keep")
    try:
        body = ("open(f\"/dev/shm/linkwise-{os.environ['LINKWISE_JOB_ID']}-x{RANK}\", 'w').write('1')\n"
                "print('planted', os.environ['LINKWISE_JOB_ID'])\n"
                "if RANK == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n")
        p, _ = run_launch(tmp_path, body, "-n", "2")
        assert p.returncode != 0
        job = p.stdout.split("planted ")[1].split()[0]
        assert not list(Path(launch.SHM_DIR).glob(f"linkwise-{job}-*"))
        assert other.exists()
        p, _ = run_launch(tmp_path, body.replace("RANK == 1", "False"), "-n", "2")
        job = p.stdout.split("planted ")[1].split()[0]
        assert p.returncode == 0 and not list(Path(launch.SHM_DIR).glob(f"linkwise-{job}-*"))
    finally:
        other.unlink()


def test_cleanup_shm_only_matches_job(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "SHM_DIR", str(tmp_path))
    for name in ("linkwise-abc-1", "linkwise-abc-ring", "linkwise-abcd-1", "other-abc-1"):
        (tmp_path / name).write_text("")
    assert sorted(Path(p).name for p in launch.cleanup_shm("abc")) == ["linkwise-abc-1",
                                                                        "linkwise-abc-ring"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linkwise-abcd-1", "other-abc-1"]
    assert launch.cleanup_shm("") == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_bind_cpu_sets_disjoint_affinity(tmp_path):
    body = ("print('cpus', sorted(os.sched_getaffinity(0)))\n"
            "print('given', repr(os.environ.get('LINKWISE_LAUNCH_CPUS')))\n")
    mine = set(os.sched_getaffinity(0))
    p, _ = run_launch(tmp_path, body, "-n", "2", "--bind", "cpu")
    assert p.returncode == 0, p.stderr
    sets = [set(eval(ln.split("cpus ", 1)[1])) for ln in p.stdout.splitlines() if "cpus " in ln]
    assert len(sets) == 2 and not sets[0] & sets[1]
    assert sets[0] | sets[1] == mine
    # a bound rank learns the launcher's CPUs (for the helpers it starts, bench's mpirun)
    given = [eval(ln.split("given ", 1)[1]) for ln in p.stdout.splitlines() if "given " in ln]
    assert [set(map(int, g.split(","))) for g in given] == [mine, mine]
    p, _ = run_launch(tmp_path, body, "-n", "2")
    sets = [set(eval(ln.split("cpus ", 1)[1])) for ln in p.stdout.splitlines() if "cpus " in ln]
    assert sets == [mine] * 2  # --bind none leaves affinity alone
    assert p.stdout.count("given None") == 2


def test_cpu_slices():
    assert launch.cpu_slices([3, 1, 2, 0], 2) == [[0, 1], [2, 3]]
    assert launch.cpu_slices(list(range(5)), 3) == [[0, 1], [2, 3], [4]]
    assert launch.cpu_slices([0, 1], 3) == [[0], [1], [0]]
    for n in range(1, 9):
        s = launch.cpu_slices(list(range(8)), n)
        assert sorted(c for x in s for c in x) == list(range(8)) and all(s)


def test_bind_cpu_takes_whole_cores_within_a_node(monkeypatch):
    """--bind cpu cut the CPU list in number order: on a 2-socket host numbered as dgx1 (CPU c
    and c + 40 one core's threads) two ranks each got half of both sockets' threads. It now
    slices as --bind auto does without GPUs; unreadable sysfs falls back to the number cuts."""
    from linkwise import topo
    discover_module = sys.modules["linkwise.topo.discover"]  # topo.discover is the function
    dgx1 = topo.fixture("dgx1")
    monkeypatch.setattr(discover_module, "discover", lambda **kw: dgx1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(80)))
    got = launch._bindings("cpu", 2, lambda text: None)
    assert got == [(list(range(0, 20)) + list(range(40, 60)), {}),
                   (list(range(20, 40)) + list(range(60, 80)), {})]
    monkeypatch.setattr(discover_module, "discover", lambda **kw: 1 / 0)
    assert launch._bindings("cpu", 2, lambda text: None) == [(list(range(40)), {}), (list(range(40, 80)), {})]


def test_bind_auto_uses_topology(monkeypatch):
    fake = types.ModuleType("linkwise.topo.affinity")
    fake.binding_for = lambda k, n: types.SimpleNamespace(cpus=[k], gpu=k)
    fake.binding_env = lambda b, environ=None: {"LINKWISE_DEVICE": str(b.gpu)}  # each rank gets its binding's variables
    monkeypatch.setitem(sys.modules, "linkwise.topo.affinity", fake)
    said = []
    got = launch._bindings("auto", 2, said.append)
    assert got == [([0], {"LINKWISE_DEVICE": "0"}), ([1], {"LINKWISE_DEVICE": "1"})]
    assert said == []


def test_bind_auto_falls_back_to_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "linkwise.topo.affinity", None)  # import fails
    said = []
    got = launch._bindings("auto", 1, said.append)
    assert got == [(sorted(os.sched_getaffinity(0)), {})]
    assert "not available" in said[0]
    broken = types.ModuleType("linkwise.topo.affinity")
    broken.binding_for = lambda k, n: 1 / 0
    broken.binding_env = lambda b, environ=None: {}
    monkeypatch.setitem(sys.modules, "linkwise.topo.affinity", broken)
    said.clear()
    assert launch._bindings("auto", 1, said.append) == got and "failed" in said[0]


def test_usage_errors(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC)
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2"], env=env,
                       capture_output=True, text=True, timeout=20)
    assert p.returncode == 2 and "give a script" in p.stderr
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "1",
                        str(tmp_path / "missing.py")], env=env, capture_output=True, text=True,
                       timeout=20)
    assert p.returncode == 2 and "rank 0 exited with status 2" in p.stderr


ASYNC_THEN_EXIT = """
import numpy as np, linkwise
comm = linkwise.init()
for i in range(200):
    comm.all_reduce(np.ones(1000, np.float32), async_op=True).wait()
for i in range(50):  # requests dropped without wait(): their buffers are released at drop
    comm.all_reduce(np.ones(1000, np.float32), async_op=True)
comm.barrier()
print("done", flush=True)
"""


def test_exit_after_async_collectives(tmp_path):
    # The async worker used to drop the last reference to the shared-memory executor, whose
    # Python-held deleter took the GIL; at interpreter shutdown that killed the worker thread
    # inside a C++ destructor and the rank aborted (about 1 launch in 3 on 3 ranks).
    for attempt in range(6):
        p, _ = run_launch(tmp_path, ASYNC_THEN_EXIT, "-n", "3", timeout=60)
        assert p.returncode == 0 and p.stdout.count("done") == 3, (attempt, p.stdout[-1500:], p.stderr[-1500:])


PEER_DIES = """
import numpy as np, linkwise
comm = linkwise.init()
x = np.ones(1000, np.float32)
comm.all_reduce(x)
if comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    for _ in range(100000):
        comm.all_reduce(x)
except linkwise.PeerError as e:
    print("handled PeerError from rank", e.peer, flush=True)
    sys.exit(5)
"""


def test_survivors_handle_peer_error_before_being_stopped(tmp_path):
    # The launcher waits PEER_GRACE before SIGTERM, so a rank blocked on the dead one raises
    # PeerError and runs its handler (it stopped them at once before).
    p, elapsed = run_launch(tmp_path, PEER_DIES, "-n", "3", timeout=60)
    assert p.returncode == 128 + 9 and "rank 1 was killed by signal SIGKILL" in p.stderr, p.stderr[-2000:]
    assert p.stdout.count("handled PeerError from rank 1") == 2, p.stdout[-2000:]
    assert elapsed < 15


def test_ctrl_c_interrupts_ranks_blocked_in_a_receive(tmp_path):
    """Both ranks wait to receive from each other (a deadlock) with a 60 s timeout: the
    forwarded SIGINT must end each rank's wait at once with KeyboardInterrupt and the
    traceback of that receive (before, the ranks sat out the timeout: Ctrl-C did nothing)."""
    script = tmp_path / "prog.py"
    script.write_text("import numpy as np, linkwise\n"
                      "comm = linkwise.init()\n"
                      "comm.barrier()\n"
                      "print('ready', flush=True)\n"
                      "comm.recv(np.zeros(4, np.float32), 1 - comm.rank)\n")
    env = dict(os.environ, PYTHONPATH=SRC, LINKWISE_TIMEOUT="60")
    p = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(2):
            assert "ready" in p.stdout.readline()
        time.sleep(0.5)  # both are in the receive's slow wait by now
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
    finally:
        p.kill()
    assert time.monotonic() - t0 < 5, (out, err)
    for rank in range(2):
        lines = [line for line in (out + err).splitlines() if line.startswith(f"[rank {rank}]")]
        assert any(line.endswith("KeyboardInterrupt") for line in lines), (out, err)
        assert any("comm.recv(" in line for line in lines), (out, err)
