"""linkwise launch: what the ranks start dies with the job, SIGHUP and the launcher's own death
reach the ranks, and the launcher's errors (bad port, a program that cannot start, nobody
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


def _start(tmp_path, n=2):
    d = tmp_path / "pids"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text("import os, time\nRANK = int(os.environ['LINKWISE_RANK'])\n"
                      + PIDS.format(d=str(d)) + "print('ready', flush=True)\ntime.sleep(60)\n")
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
