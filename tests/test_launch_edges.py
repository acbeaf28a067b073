"""linkwise launch at its edges: nohup, Ctrl-\\, output nobody can take, grandchildren holding
the pipes, launches nested in a rank, and another launcher started from inside a rank."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from linkwise import launch
from test_bench import SRC


def _launcher(argv, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in [k for k in env if k.startswith("LINKWISE_") or k in ("RANK", "WORLD_SIZE")]:
        del env[k]
    env.update(kw.pop("env", {}))
    return subprocess.Popen([sys.executable, "-m", "linkwise.cli", "launch", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _wait_for_line(proc, start: str) -> str:
    for line in proc.stdout:
        if start in line:
            return line
    raise AssertionError(f"no line with {start!r}; stderr: {proc.stderr.read()}")


def test_nohup_keeps_the_job_alive(tmp_path):
    """Started with SIGHUP ignored (nohup), a hangup used to be forwarded and killed the ranks."""
    script = _script(tmp_path, """
        import time
        print("ready", flush=True)
        time.sleep(2)
        print("done", flush=True)
    """)
    proc = _launcher(["-n", "2", script], preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    _wait_for_line(proc, "ready")
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert out.count("done") == 2, out


def test_sigquit_stops_the_ranks_and_what_they_started(tmp_path):
    """Ctrl-\\ killed the launcher at once; the ranks got SIGTERM from the kernel, but the
    processes they had started lived on."""
    script = _script(tmp_path, """
        import subprocess, time
        child = subprocess.Popen(["sleep", "100"])
        print("child", child.pid, flush=True)
        time.sleep(100)
    """)
    proc = _launcher(["-n", "1", script])
    child = int(_wait_for_line(proc, "child").split()[-1])
    proc.send_signal(signal.SIGQUIT)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGQUIT
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the rank's child outlived the job")


def test_grandchildren_holding_the_pipes_do_not_slow_the_exit(tmp_path):
    """Each of 2N output threads waited 1 s for its pipe in turn: 8 s for 4 ranks."""
    script = _script(tmp_path, """
        import subprocess
        subprocess.Popen(["sleep", "30"])
        print("started", flush=True)
    """)
    t0 = time.monotonic()
    proc = _launcher(["-n", "4", script])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.count("started") == 4, out
    assert time.monotonic() - t0 < 7.5  # start-up of 4 ranks on 2 cores, plus the 1 s grace


def test_closed_stdout_is_no_traceback(tmp_path):
    script = _script(tmp_path, 'print("hello")\n')
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(["bash", "-c", f'"{sys.executable}" -m linkwise.cli launch -n 2 "{script}" >&-'],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_output_to_a_hung_up_terminal_is_dropped():
    """EIO from a terminal that hung up ended the output thread (only EPIPE was caught), and
    the rank then blocked on its full pipe."""
    rfd, wfd = os.pipe()
    dest_fd = os.dup(1)

    class HungUp:
        def fileno(self):
            return dest_fd

        def write(self, data):
            raise OSError(errno.EIO, "Input/output error")

        def flush(self):
            pass

    os.write(wfd, b"".join(b"line %d\n" % k for k in range(1000)))  # ~9 KB: fits the pipe
    os.close(wfd)
    out = launch._Output()
    try:
        with os.fdopen(rfd, "rb") as pipe:
            out.pump(pipe, HungUp(), b"[rank 0] ")  # returns: read to the end
    finally:
        os.close(dest_fd)
    assert out.gone == {dest_fd}


def test_a_launch_in_a_rank_does_not_take_the_outer_ones_port_settings(tmp_path):
    inner = _script(tmp_path, """
        from linkwise import bootstrap
        e = bootstrap.detect()
        print("inner", e.rank, e.size, e.spare_ports, flush=True)
    """)
    outer = tmp_path / "outer.py"
    outer.write_text(textwrap.dedent(f"""
        import subprocess, sys
        sys.exit(subprocess.call([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2",
                                  "--master-port", "24999", {inner!r}]))
    """))
    proc = _launcher(["-n", "1", str(outer)])
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    found = sorted(line.split("inner ")[1] for line in out.splitlines() if "inner " in line)
    assert found == ["0 2 0", "1 2 0"], out  # a given port: no spare ports (was the outer's 8)


def test_a_launch_in_a_joined_rank_is_a_job_of_its_own(tmp_path):
    """A `linkwise launch` inside a rank (which has joined its own world) gives its ranks their
    own rank, size and job id: the inner job forms beside the outer one."""
    inner = _script(tmp_path, """
        import os, numpy as np, linkwise
        comm = linkwise.init()
        x = np.ones(1, np.float32)
        comm.all_reduce(x)
        print("inner", comm.rank, comm.size, int(x[0]), os.environ["LINKWISE_JOB_ID"], flush=True)
    """)
    outer = tmp_path / "outer.py"
    outer.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, linkwise
        comm = linkwise.init()
        if comm.rank == 1:
            subprocess.check_call([sys.executable, "-m", "linkwise.cli", "launch", "-n", "3", {inner!r}])
        comm.barrier()
        print("outer", comm.rank, comm.size, os.environ["LINKWISE_JOB_ID"], flush=True)
    """))
    proc = _launcher(["-n", "2", str(outer)])
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    rows = [line.split("] ")[-1].split() for line in out.splitlines()]  # "[rank 1] [rank k] inner ..."
    inner_rows = sorted(r for r in rows if r[0] == "inner")
    outer_rows = sorted(r for r in rows if r[0] == "outer")
    assert [r[:4] for r in inner_rows] == [["inner", str(k), "3", "3"] for k in range(3)], out
    assert [r[:3] for r in outer_rows] == [["outer", str(k), "2"] for k in range(2)], out
    inner_jobs, outer_jobs = {r[4] for r in inner_rows}, {r[3] for r in outer_rows}
    assert len(inner_jobs) == len(outer_jobs) == 1 and inner_jobs != outer_jobs, out


def test_another_launcher_inside_a_rank_is_refused(tmp_path):
    """torchrun started from a rank: its processes inherited LINKWISE_RANK / SIZE, which won,
    and each took the outer rank's place (rank 0 of 1) without an error."""
    script = _script(tmp_path, """
        import os, subprocess, sys
        probe = "from linkwise import bootstrap; e = bootstrap.detect(); print(e.launcher, e.rank, e.size)"
        print("as started:", subprocess.run([sys.executable, "-c", probe], capture_output=True,
                                            text=True).stdout.strip(), flush=True)
        inner = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
        r = subprocess.run([sys.executable, "-c", probe], env=inner, capture_output=True, text=True)
        print("inner:", r.returncode, r.stderr.strip().splitlines()[-1], flush=True)
    """)
    # torchrun's variables left in the launcher's own environment are the outer ones: ignored
    proc = _launcher(["-n", "1", script], env={"RANK": "5", "WORLD_SIZE": "8"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "as started: linkwise 0 1" in out, out
    inner = next(line for line in out.splitlines() if "inner:" in line)
    assert "inner: 1 ValueError" in inner and "torchrun 1/2" in inner and "env -u LINKWISE_RANK" in inner, out


def test_an_inner_process_with_the_outer_ranks_own_rank_and_size_is_refused(tmp_path):
    """torchrun (or mpirun) -n 2 started from rank 1 of 2: its process 1 of 2 read as the outer
    rank 1 of 2 and was let through (only its sibling was refused), to join the outer job in
    the place of the rank that started it. torchrun's own TORCHELASTIC_RUN_ID, or another
    launcher's variables at all, tell it from a script that sets RANK / WORLD_SIZE for torch."""
    script = _script(tmp_path, """
        import os, subprocess, sys
        if os.environ["LINKWISE_RANK"] == "1":
            probe = "from linkwise import bootstrap; e = bootstrap.detect(); print(e.launcher, e.rank, e.size)"
            for name, inner in [("torchrun", dict(RANK="{k}", WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none")),
                                ("mpirun", dict(OMPI_COMM_WORLD_RANK="{k}", OMPI_COMM_WORLD_SIZE="2")),
                                ("script", dict(RANK="{k}", WORLD_SIZE="2"))]:
                for k in range(2):
                    env = dict(os.environ, **{v: x.format(k=k) for v, x in inner.items()})
                    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
                    said = r.stdout.strip() or r.stderr.strip().splitlines()[-1].split("since ")[-1].split(";")[0]
                    print("inner", name, k, r.returncode, said, flush=True)
    """)
    proc = _launcher(["-n", "2", script])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    got = sorted(line.split("inner ", 1)[1] for line in out.splitlines() if "inner " in line)
    assert got == ["mpirun 0 1 (openmpi 0/2)", "mpirun 1 1 (openmpi 1/2)",
                   "script 0 1 (torchrun 0/2)",  # not the rank's own
                   "script 1 0 linkwise 1 2",
                   "torchrun 0 1 (torchrun 0/2)", "torchrun 1 1 (torchrun 1/2)"], out


@pytest.mark.parametrize("env,said", [({}, ""), ({"RANK": "3", "WORLD_SIZE": "4"}, "torchrun 3/4"),
                                      ({"OMPI_COMM_WORLD_RANK": "x"}, "openmpi ?")])
def test_other_launchers_record(env, said):
    from linkwise.bootstrap import other_launchers
    assert other_launchers(env) == said


def test_torch_variables_a_rank_sets_to_its_own_are_fine(tmp_path):
    """A script that sets RANK / WORLD_SIZE to its own rank (for torch's env:// init) before
    linkwise.init() is not another launcher."""
    script = _script(tmp_path, """
        import os
        os.environ.update(RANK=os.environ["LINKWISE_RANK"], WORLD_SIZE=os.environ["LINKWISE_SIZE"])
        import linkwise
        comm = linkwise.init()
        print("ok", comm.rank, comm.size, flush=True)
        comm.close()
    """)
    proc = _launcher(["-n", "2", script])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(line.split("ok ")[1] for line in out.splitlines() if "ok " in line) == ["0 2", "1 2"], out


def test_output_to_a_non_blocking_reader_waits_for_room():
    """BlockingIOError (a non-blocking stdout whose pipe is full) is no reason to drop the rest
    of the output, as a gone reader is."""
    import threading
    import fcntl
    rfd, wfd = os.pipe()
    fcntl.fcntl(wfd, 1031, 4096)  # F_SETPIPE_SZ: one page, full at once
    os.set_blocking(wfd, False)
    lines = [b"line %05d\n" % k for k in range(20000)]  # ~300 KB: several pipefuls
    src_r, src_w = os.pipe()
    got = []

    def drain():
        time.sleep(0.3)  # the pipe fills first
        with os.fdopen(rfd, "rb") as f:
            while chunk := f.read(65536):
                got.append(chunk)
                time.sleep(0.001)
    reader = threading.Thread(target=drain)
    reader.start()
    writer = threading.Thread(target=lambda: (os.write(src_w, b"".join(lines)), os.close(src_w)))
    writer.start()
    out = launch._Output()
    with os.fdopen(src_r, "rb") as pipe, os.fdopen(wfd, "wb") as dest:
        out.pump(pipe, dest, b"[rank 0] ")
    writer.join()
    reader.join(timeout=30)
    assert not out.gone
    assert b"".join(got) == b"".join(b"[rank 0] " + line for line in lines)


def test_a_script_setting_torch_variables_under_an_allocation(monkeypatch):
    """linkwise launch in an sbatch script (SLURM_PROCID=0 of 4 recorded for every rank), ranks
    setting RANK / WORLD_SIZE to their own: none refused (rank 0 was, as 'slurm 0/4' differed
    from its RANK=0 reading while the others matched theirs)."""
    from linkwise import bootstrap
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "LINKWISE_SIZE": "4", "LINKWISE_LOCAL_SIZE": "4",
            "LINKWISE_MASTER_ADDR": "127.0.0.1", "LINKWISE_MASTER_PORT": "29999"}
    base["LINKWISE_LAUNCH_OTHERS"] = bootstrap.other_launchers(base)
    for rank in range(4):
        env = dict(base, LINKWISE_RANK=str(rank), LINKWISE_LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="4")
        bootstrap._refuse_inner_launcher(env, rank, 4)  # raises where refused
    inner = dict(base, LINKWISE_RANK="1", LINKWISE_LOCAL_RANK="1", RANK="0", WORLD_SIZE="2")
    with pytest.raises(ValueError, match="torchrun 0/2"):
        bootstrap._refuse_inner_launcher(inner, 1, 4)
    for k, v in inner.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="outer `linkwise launch`"):
        bootstrap.detect()
    assert bootstrap.detect(rank=1, size=4, addr="127.0.0.1:29999").rank == 1  # explicit: not checked


@pytest.mark.parametrize("argv,env,expect", [
    (["-n", "2"], {}, lambda cpus: max(1, cpus // 2)),
    (["-n", "2", "--bind", "cpu"], {}, lambda cpus: max(1, cpus // 2)),
    (["-n", "2"], {"OMP_NUM_THREADS": "3"}, lambda cpus: 3),
    (["-n", "1"], {}, None)])
def test_each_rank_gets_its_share_of_openmp_threads(tmp_path, monkeypatch, argv, env, expect):
    """Before, OMP_NUM_THREADS was left unset: n ranks each started an OpenMP (BLAS, torch)
    thread on every CPU. A value the user set is kept; one rank is left alone."""
    script = _script(tmp_path, """
        import os
        print("OMP", os.environ.get("OMP_NUM_THREADS"), flush=True)
    """)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # _launcher starts from os.environ
    proc = _launcher([*argv, script], env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = [line.split()[-1] for line in out.splitlines() if " OMP " in line]
    want = "None" if expect is None else str(expect(len(os.sched_getaffinity(0))))
    assert seen == [want] * (1 if expect is None else 2), (out, err)


def _nested_env(script: str, argv: list, env: dict) -> list[tuple[str, str, str, str, str]]:
    """Per rank of `linkwise launch *argv script` started with `env`, sorted by rank: its rank,
    OMP_NUM_THREADS, LINKWISE_SOCKET_IFNAME, the count of CPUs it may use and
    LINKWISE_LAUNCH_SET."""
    proc = _launcher([*argv, script], env=env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    rows = sorted(line.split("] ", 1)[1] for line in out.splitlines() if "] ENV " in line)
    return [tuple(row.split(" ", 5)[1:]) for row in rows]


_PRINT_ENV = """
    import os
    e = os.environ
    print("ENV", e["LINKWISE_RANK"], e.get("OMP_NUM_THREADS"), e.get("LINKWISE_SOCKET_IFNAME"),
          len(os.sched_getaffinity(0)), e.get("LINKWISE_LAUNCH_SET"), flush=True)
"""


def test_a_launch_nested_in_a_rank_works_out_its_own_threads_and_interface(tmp_path, monkeypatch):
    """Started where an outer launch had set OMP_NUM_THREADS=8 and, by --bind auto, the interface:
    before, the inner ranks took both as the user's and kept the outer rank's values (8 threads
    each, 16 where the outer launcher had given 8; an interface bind() had not chosen for them)."""
    import json
    from linkwise.topo.affinity import binding_env, binding_for
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # _launcher starts from os.environ
    script = _script(tmp_path, _PRINT_ENV)
    outer_set = {"OMP_NUM_THREADS": "8", "LINKWISE_SOCKET_IFNAME": "=eth9"}
    outer = dict(outer_set, LINKWISE_JOB_ID="0123abcd", LINKWISE_LAUNCH_SET=json.dumps(outer_set))
    rows = _nested_env(script, ["-n", "2"], outer)
    # the 8 CPUs shared by the two inner ranks; without --bind auto the outer rank's NIC is kept
    assert [r[:3] for r in rows] == [(str(k), "4", "=eth9") for k in range(2)], rows
    assert [json.loads(r[4]) for r in rows] == [{"OMP_NUM_THREADS": "4", "LINKWISE_SOCKET_IFNAME": "=eth9"}] * 2
    rows = _nested_env(script, ["-n", "2", "--bind", "auto"], outer)
    for k, (rank, threads, ifname, cpus, _) in enumerate(rows):
        mine = binding_env(binding_for(k, 2), environ={}).get("LINKWISE_SOCKET_IFNAME")
        assert (rank, threads, ifname) == (str(k), cpus, str(mine)), rows  # its slice, its NIC
        assert ifname != "=eth9", rows  # never the outer rank's interface
    # A value the user set is kept: one set before the outer launch, or changed in the rank.
    rows = _nested_env(script, ["-n", "2", "--bind", "auto"], dict(outer, OMP_NUM_THREADS="6",
                                                                   LINKWISE_SOCKET_IFNAME="=eth8"))
    assert [r[:3] for r in rows] == [(str(k), "6", "=eth8") for k in range(2)], rows
    assert not any("OMP_NUM_THREADS" in r[4] or "SOCKET_IFNAME" in r[4] for r in rows), rows
