"""linkwise launch: what the ranks start dies with the job, SIGHUP, Ctrl-Z and the launcher's
own death reach the ranks (and what they started), and the launcher's errors (bad port, a program that cannot start, nobody
reading stderr) are clear and keep the exit code."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from test_launch import PIDS, SRC, _wait_others, alive, run_launch

# Each rank starts a sleeper in its process group and notes its pid beside its own.
SLEEPER = ("import subprocess\n"
           "child = subprocess.Popen(['sleep', '60'])\n"
           "open(os.path.join({d!r}, 'child' + str(RANK)), 'w').write(str(child.pid))\n")


def _pids(d, names) -> list[int]:
    return [int((d / name).read_text()) for name in names]


def _kill_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["sys.exit(0)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_children_of_an_exited_rank_die_with_the_job(tmp_path, how):
    """Rank 1 ends first (cleanly, or killed) and leaves a process in its group; the launcher
    used to signal only ranks still running, so that process outlived the job."""
    d = tmp_path / "pids"
    d.mkdir()
    body = (PIDS.format(d=str(d)) + SLEEPER.format(d=str(d)) + _wait_others(tmp_path, 4)
            + f"if RANK == 1:\n    {how}\ntime.sleep(1.0)\n")
    p, _ = run_launch(tmp_path, body, "-n", "2")
    children = _pids(d, ["child0", "child1"])
    try:
        assert p.returncode == (0 if "exit" in how else 128 + 9), p.stderr
        time.sleep(0.2)
        assert [alive(pid) for pid in children] == [False, False]
    finally:
        _kill_all(children)


def _start(tmp_path, n=2, extra="", then="time.sleep(60)\n"):
    d = tmp_path / "pids"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text("import os, time\nRANK = int(os.environ['LINKWISE_RANK'])\n"
                      + PIDS.format(d=str(d)) + extra + "print('ready', flush=True)\n" + then)
    p = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", str(n), str(script)],
                         env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         # a suite run under nohup: the launcher keeps an ignored SIGHUP
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    for _ in range(n):
        assert "ready" in p.stdout.readline()
    return p, _pids(d, [str(k) for k in range(n)])


def _gone_within(pids, seconds) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_sighup_is_forwarded(tmp_path):
    """A closed terminal or ssh session: the ranks sit in their own process groups, so only
    the launcher gets the SIGHUP and must pass it on."""
    p, pids = _start(tmp_path)
    try:
        p.send_signal(signal.SIGHUP)
        p.communicate(timeout=10)
        assert p.returncode == 128 + signal.SIGHUP
        assert _gone_within(pids, 5)
    finally:
        p.kill()
        _kill_all(pids)


def test_ranks_end_when_the_launcher_is_killed(tmp_path):
    """SIGKILL cannot be forwarded: the kernel sends the ranks SIGTERM (PR_SET_PDEATHSIG)."""
    p, pids = _start(tmp_path)
    try:
        p.kill()
        p.wait(timeout=10)
        assert _gone_within(pids, 5), [alive(pid) for pid in pids]
    finally:
        _kill_all(pids)


def test_what_the_ranks_started_ends_when_the_launcher_is_killed(tmp_path):
    """The kernel's SIGTERM (PR_SET_PDEATHSIG) reaches the ranks only: what they had started
    in their process groups lived on after `kill -9` of the launcher. Its watchdog ends the
    groups now."""
    p, pids = _start(tmp_path, extra=SLEEPER.format(d=str(tmp_path / "pids")))
    children = _pids(tmp_path / "pids", ["child0", "child1"])
    try:
        p.kill()
        p.wait(timeout=10)
        assert _gone_within(pids + children, 8), [alive(pid) for pid in pids + children]
    finally:
        _kill_all(pids + children)


# Counts the SIGTERMs this process gets in a file of its own, and exits 0.5 s after the first.
COUNT_TERMS = ("import os, signal, sys, time\n"
               "def on_term(*_):\n"
               "    open(os.path.join({d!r}, NAME), 'a').write('x')\n"
               "    signal.setitimer(signal.ITIMER_REAL, 0.5)\n"
               "signal.signal(signal.SIGTERM, on_term)\n"
               "signal.signal(signal.SIGALRM, lambda *_: os._exit(0))\n")


def test_each_process_of_a_killed_launchers_job_gets_one_sigterm(tmp_path):
    """The rank gets its SIGTERM from the kernel (PR_SET_PDEATHSIG); what it started from the
    watchdog. A second one would mean "now" to many programs (a nested launcher escalates)."""
    d = tmp_path / "pids"
    child = COUNT_TERMS.format(d=str(d)).replace("NAME", "'child' + os.environ['LINKWISE_RANK']")
    extra = ("import subprocess, sys\n" + COUNT_TERMS.format(d=str(d)).replace("NAME", "'rank' + str(RANK)")
             + f"kid = subprocess.Popen([sys.executable, '-c', {child + 'print(1, flush=True); time.sleep(60)'!r}],"
               " stdout=subprocess.PIPE)\n"
             "kid.stdout.readline()\n"
             f"open(os.path.join({str(d)!r}, 'kid' + str(RANK)), 'w').write(str(kid.pid))\n")
    p, pids = _start(tmp_path, extra=extra)
    kids = _pids(d, ["kid0", "kid1"])
    try:
        p.kill()
        p.wait(timeout=10)
        assert _gone_within(pids + kids, 8), [alive(pid) for pid in pids + kids]
        got = {name: (d / name).read_text() if (d / name).exists() else "" for name in
               ("rank0", "rank1", "child0", "child1")}
        assert got == dict.fromkeys(got, "x"), got
    finally:
        _kill_all(pids + kids)


def _watchdogs(launcher_pid: int) -> list[int]:
    """The pids of the watchdogs of the launcher whose pid is given (by their command line)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"_launch_watchdog.py") for a in argv) and str(launcher_pid).encode() in argv:
            found.append(int(entry))
    return found


def test_the_watchdog_ends_with_a_normal_run_and_leaves_groups_alone(tmp_path):
    """The watchdog lives in a session of its own while the job runs, and exits with the
    launcher without signalling anything: a process that a rank left in a session of its
    own (outside the rank's group) is not touched."""
    d = tmp_path / "pids"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text("import os, subprocess, sys, time\n"
                      "if os.environ['LINKWISE_RANK'] == '0':\n"
                      "    child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
                      f"    open({str(d / 'away')!r}, 'w').write(str(child.pid))\n"
                      "print('ready', flush=True)\n"
                      f"while not os.path.exists({str(d / 'go')!r}):\n    time.sleep(0.02)\n")
    p = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                         env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    away = None
    try:
        for _ in range(2):
            assert "ready" in p.stdout.readline()
        away = int((d / "away").read_text())
        dogs = _watchdogs(p.pid)
        assert len(dogs) == 1 and os.getsid(dogs[0]) == dogs[0] != os.getsid(p.pid)
        (d / "go").touch()
        p.communicate(timeout=20)
        assert p.returncode == 0
        assert not _watchdogs(p.pid) and not alive(dogs[0])
        time.sleep(0.2)
        assert alive(away)
    finally:
        p.kill()
        if away is not None:
            _kill_all([away])


def test_a_rank_that_ended_is_reaped_only_once_its_group_is_killed(tmp_path):
    """The group of a rank that exited keeps its id (the rank's pid) until the launcher has
    killed it: the rank is left unreaped (a zombie) till then, so neither the launcher's
    nor the watchdog's signal to the group can reach a process that got the id since."""
    d = tmp_path / "pids"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text("import os, time\nRANK = int(os.environ['LINKWISE_RANK'])\n" + PIDS.format(d=str(d))
                      + f"while RANK == 0 and not os.path.exists({str(d / 'go')!r}):\n    time.sleep(0.02)\n")
    p = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                         env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        end = time.monotonic() + 20
        while not (d / "1").exists() or not (d / "0").exists():
            assert time.monotonic() < end and p.poll() is None
            time.sleep(0.02)
        rank1 = int((d / "1").read_text())
        while _state(rank1) not in ("Z", None) and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.3)  # the launcher has seen it exit (it polls every 0.1 s)
        assert _state(rank1) == "Z"
        (d / "go").touch()
        p.communicate(timeout=20)
        assert p.returncode == 0 and _state(rank1) is None  # reaped at the end
    finally:
        p.kill()
        (d / "go").touch()


def _state(pid: int):
    """The process's state letter (R, S, T, Z...), None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _wait_state(pids, want, seconds=5.0) -> list:
    """Wait until every pid's state is in ``want``; the states seen last."""
    end = time.monotonic() + seconds
    while True:
        states = [_state(pid) for pid in pids]
        if all(s in want for s in states) or time.monotonic() > end:
            return states
        time.sleep(0.02)


def test_ctrl_z_stops_the_ranks_and_fg_resumes_them(tmp_path):
    """SIGTSTP stopped the launcher only (the ranks, in their own process groups, ran on):
    now the ranks' groups stop with it, and SIGCONT (`fg`, `bg`) resumes them."""
    d = tmp_path / "pids"
    p, pids = _start(tmp_path, then=f"while not os.path.exists({str(d / 'go')!r}):\n    time.sleep(0.02)\n"
                                    "print('done', flush=True)\n")
    try:
        p.send_signal(signal.SIGTSTP)
        assert _wait_state([p.pid] + pids, ("T",)) == ["T"] * 3
        time.sleep(0.3)
        assert [_state(pid) for pid in [p.pid] + pids] == ["T"] * 3  # none was continued
        p.send_signal(signal.SIGCONT)
        states = _wait_state([p.pid] + pids, ("R", "S"))
        assert all(s in ("R", "S") for s in states), states
        (d / "go").touch()
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0 and out.count("done") == 2, (out, err)
    finally:
        p.kill()
        _kill_all(pids)


def test_ctrl_z_reaches_the_ranks_of_a_launch_nested_in_a_rank(tmp_path):
    """The inner launcher is a rank of the outer one: it gets the outer's SIGTSTP and stops
    its own ranks in turn (a SIGSTOP would have stopped it before it could)."""
    d = tmp_path / "pids"
    d.mkdir()
    inner = tmp_path / "inner.py"
    inner.write_text("import os, time\n"
                     f"open(os.path.join({str(d)!r}, 'inner'), 'w').write(f'{{os.getpid()}} {{os.getppid()}}')\n"
                     "print('ready', flush=True)\n"
                     f"while not os.path.exists({str(d / 'go')!r}):\n    time.sleep(0.02)\n")
    outer = tmp_path / "outer.py"
    outer.write_text("import subprocess, sys\n"
                     f"sys.exit(subprocess.call([sys.executable, '-m', 'linkwise.cli', 'launch', '-n', '1', {str(inner)!r}]))\n")
    p = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", "1", str(outer)],
                         env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    pids = []
    try:
        assert "ready" in p.stdout.readline()
        rank, inner_launcher = map(int, (d / "inner").read_text().split())
        pids = [p.pid, inner_launcher, rank]
        p.send_signal(signal.SIGTSTP)
        assert _wait_state(pids, ("T",)) == ["T"] * 3
        p.send_signal(signal.SIGCONT)
        states = _wait_state(pids, ("R", "S"))
        assert all(s in ("R", "S") for s in states), states
        (d / "go").touch()
        p.communicate(timeout=20)
        assert p.returncode == 0
    finally:
        p.kill()
        _kill_all(pids[1:])


def test_master_port_is_checked_before_ranks_start(tmp_path):
    for bad in ("-5", "70000", "http"):
        p, _ = run_launch(tmp_path, "print('ran', flush=True)\n", "-n", "1", "--master-port", bad)
        assert p.returncode == 2 and "--master-port" in p.stderr and "ran" not in p.stdout, p.stderr


def test_cannot_start_names_the_program(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC)
    missing = str(tmp_path / "nosuchprog")
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", "--no-python",
                        missing, "arg1"], env=env, capture_output=True, text=True, timeout=20)
    assert p.returncode == 2
    assert f"cannot start {missing} arg1" in p.stderr, p.stderr


def test_failure_message_to_a_closed_stderr_keeps_the_exit_code(tmp_path):
    """Nobody reads the launcher's stderr any more (`... 2>&1 | head -1`): its report of the
    failed rank must not crash it, nor cut the others' grace period short."""
    d = tmp_path / "pids"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text("import os, sys, time\nRANK = int(os.environ['LINKWISE_RANK'])\n"
                      + PIDS.format(d=str(d)) + _wait_others(tmp_path, 2)
                      + "if RANK == 1:\n    sys.exit(3)\n"
                      "try:\n    time.sleep(60)\nexcept BaseException:\n    pass\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the launcher's stderr has no reader from the start
    try:
        p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                           env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL,
                           stderr=write_end, timeout=30)
    finally:
        os.close(write_end)
    assert p.returncode == 3


def test_ctrl_c_exits_130_without_blaming_a_rank(tmp_path):
    """Ranks that turn the forwarded SIGINT into their own exit status (a KeyboardInterrupt
    handler's sys.exit(1)) are the signal's doing: exit 130, as a shell reports Ctrl-C."""
    d = tmp_path / "pids"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text("import os, sys, time\nRANK = int(os.environ['LINKWISE_RANK'])\n"
                      + PIDS.format(d=str(d)) + "print('ready', flush=True)\n"
                      "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    sys.exit(1)\n")
    p = subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                         env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for _ in range(2):
        assert "ready" in p.stdout.readline()
    pids = _pids(d, ["0", "1"])
    try:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=10)
        assert p.returncode == 130 and "exited with status" not in err, (p.returncode, err)
    finally:
        p.kill()
        _kill_all(pids)


def test_ranks_start_when_the_watchdog_is_gone(tmp_path):
    """The watchdog was killed (or its interpreter could not run the script) before the ranks
    started: each rank's process, between fork and exec, got SIGPIPE writing its group to the
    watchdog's pipe (Popen had set SIGPIPE back to the default there) and died before its
    program ran. Now it runs without the watchdog, with SIGPIPE at its default as before."""
    (tmp_path / "drive.py").write_text(
        "import sys\n"
        "from linkwise import launch\n"
        "plain = launch.Watchdog.__init__\n"
        "def gone(self, say):\n"
        "    plain(self, say)\n"
        "    self.proc.kill()\n"
        "    self.proc.wait()\n"
        "launch.Watchdog.__init__ = gone\n"
        "sys.exit(launch.main(['-n', '2', 'sh', '-c', 'echo ran $(grep SigIgn /proc/self/status)']))\n")
    p = subprocess.run([sys.executable, str(tmp_path / "drive.py")],
                       env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.stdout, p.stderr)
    ran = sorted(line.split() for line in p.stdout.splitlines())
    assert [r[:3] for r in ran] == [["[rank", "0]", "ran"], ["[rank", "1]", "ran"]], p.stdout
    assert all(not int(r[4], 16) & (1 << (signal.SIGPIPE - 1)) for r in ran), p.stdout  # not ignored


def test_a_ctrl_z_ignored_at_start_stays_ignored(tmp_path):
    """A launcher started with SIGTSTP ignored (`trap '' TSTP`, as nohup ignores SIGHUP) ran on
    with its ranks; the Ctrl-Z relay handled it anyway and stopped the job. The ranks inherit
    the ignored signal, as before."""
    d = tmp_path / "pids"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text(
        "import os, signal, time\n"
        f"open(os.path.join({str(d)!r}, 'rank'), 'w').write(str(os.getpid()))\n"
        f"while not os.path.exists({str(d / 'go')!r}):\n    time.sleep(0.02)\n"
        "print('tstp', 'ignored' if signal.getsignal(signal.SIGTSTP) == signal.SIG_IGN else 'default', flush=True)\n")
    launch = f"exec {sys.executable} -m linkwise.cli launch -n 1 {script}"
    p = subprocess.Popen(["sh", "-c", f"trap '' TSTP TTIN TTOU; {launch}"], env=dict(os.environ, PYTHONPATH=SRC),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 20
        while not (d / "rank").exists():
            assert time.monotonic() < end and p.poll() is None
            time.sleep(0.02)
        rank = int((d / "rank").read_text())
        p.send_signal(signal.SIGTSTP)
        time.sleep(0.3)
        assert _state(p.pid) in ("S", "R") and _state(rank) in ("S", "R")  # neither stopped
        (d / "go").touch()
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0 and out == "[rank 0] tstp ignored\n", (out, err)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        (d / "go").touch()
