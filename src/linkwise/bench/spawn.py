"""Start benchmark ranks when ``linkwise bench`` is not already running under a launcher.

:func:`launch_ranks` starts N processes of ``python -m linkwise.bench.worker`` on this host
with the ``LINKWISE_*`` variables of a local job (as ``linkwise launch`` sets them);
:func:`launch_mpi` starts the same worker under ``mpirun`` for the MPI comparison. The
benchmark's arguments travel in ``LINKWISE_BENCH_ARGS`` (JSON), the systems to measure in
``LINKWISE_BENCH_SYSTEMS``, and rank 0 writes its results to ``LINKWISE_BENCH_RESULT``.

Only rank 0 keeps stdout and stderr (its progress bar and errors); other ranks keep stderr.
When a rank fails or the time limit passes, the other ranks started here are killed, and the
job's shared-memory segments are removed.
"""
from __future__ import annotations

import glob
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from . import compare
from .. import config
from ..launch import thread_affinity


class LaunchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(args_json: str, systems: list[str], result: str) -> dict:
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(k, v)  # NVLink multicast stays off (GPU runs)
    env.update(LINKWISE_BENCH_ARGS=args_json, LINKWISE_BENCH_SYSTEMS=",".join(systems),
               LINKWISE_BENCH_RESULT=result)
    return env


def _read_result(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{what}: rank 0 wrote no result ({exc})") from None


def _wait_all(procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(k, c) for k, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                k, c = bad[0]
                raise LaunchError(f"{what}: rank {k} exited with status {c}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{what}: ranks did not finish within {timeout:g} s (--timeout)")
            time.sleep(0.02)
    finally:
        _kill(procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _rank_env(rank: int, nranks: int, port: int, job: str) -> dict:
    """The variables launch_ranks gives each rank (a local job's, as `linkwise launch` sets them)."""
    return {"LINKWISE_RANK": str(rank), "LINKWISE_SIZE": str(nranks), "LINKWISE_LOCAL_RANK": str(rank),
            "LINKWISE_LOCAL_SIZE": str(nranks), "LINKWISE_MASTER_ADDR": "127.0.0.1",
            "LINKWISE_MASTER_PORT": str(port), "LINKWISE_JOB_ID": job}


RANK_VARIABLES = tuple(_rank_env(0, 1, 0, ""))  # their names: values set here never reach the ranks


def launch_ranks(nranks: int, args_json: str, systems: list[str], timeout: float) -> dict:
    """Run the worker on nranks local processes; returns rank 0's result document."""
    job = secrets.token_hex(6)
    fd, result = tempfile.mkstemp(prefix="linkwise-bench-", suffix=".json")
    os.close(fd)
    env = _worker_env(args_json, systems, result)
    port = free_port()
    procs = []
    try:
        try:  # a rank that cannot start (EAGAIN, Ctrl-C): the ones started must not wait on
            for rank in range(nranks):  # it until their rendezvous timeout
                e = dict(env, **_rank_env(rank, nranks, port, job))
                out = None if rank == 0 else subprocess.DEVNULL
                procs.append(subprocess.Popen([sys.executable, "-m", "linkwise.bench.worker"],
                                              env=e, stdout=out))
        except BaseException:
            _kill(procs)
            raise
        _wait_all(procs, timeout, f"linkwise bench ({nranks} ranks)")
        return _read_result(result, "linkwise bench")
    finally:
        os.unlink(result)
        for seg in glob.glob(f"/dev/shm/linkwise-{job}-*"):
            try:
                os.unlink(seg)
            except OSError:
                pass


def _all_cpus():
    """The CPUs for mpirun: those `linkwise launch --bind` was given (LINKWISE_LAUNCH_CPUS) when
    this rank is bound to a slice of them, so that mpirun neither inherits the slice (squeezing
    its ranks onto it, told to oversubscribe) nor gets more than linkwise's ranks had; else this
    process's own (an outer taskset applies to both systems alike)."""
    given = config.get("LINKWISE_LAUNCH_CPUS")
    try:
        cpus = {int(c) for c in given.split(",") if c.strip()}
    except ValueError:
        raise ValueError(f"LINKWISE_LAUNCH_CPUS={given!r}: expected CPU numbers separated by commas") from None
    return thread_affinity(cpus)  # empty: unchanged


def launch_mpi(nranks: int, args_json: str, timeout: float, extra: str = "") -> dict:
    """Run the worker's MPI sweep under mpirun; returns rank 0's result document."""
    fd, result = tempfile.mkstemp(prefix="linkwise-bench-mpi-", suffix=".json")
    os.close(fd)
    env = _worker_env(args_json, ["mpi"], result)
    for var in [v for v in env if v.startswith(("LINKWISE_RANK", "LINKWISE_SIZE", "LINKWISE_LOCAL_",
                                                 "LINKWISE_MASTER_", "LINKWISE_JOB_ID"))]:
        del env[var]
    try:
        with _all_cpus():
            cmd = compare.mpirun_command(nranks, extra) + [sys.executable, "-m", "linkwise.bench.worker"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise LaunchError(f"mpirun did not finish within {timeout:g} s (--timeout)") from None
        if proc.returncode != 0:
            tail = text.decode(errors="replace")[-2000:]
            raise LaunchError(f"mpirun exited with status {proc.returncode}:\n{tail}")
        return _read_result(result, "mpirun")
    finally:
        os.unlink(result)


def mpi_how(nranks: int, extra: str = "") -> str:
    """The mpirun command as run (quoted for a shell), without the benchmark's own -x VAR
    (the user's --mpirun-args are shown whole, their -x included)."""
    with _all_cpus():
        cmd = compare.mpirun_command(nranks, extra, forward=False)
    return "second launch right after linkwise's: " + shlex.join([os.path.basename(cmd[0])] + cmd[1:])
