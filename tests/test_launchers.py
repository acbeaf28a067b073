"""linkwise.init() under real launchers: linkwise launch, Open MPI's mpirun, torchrun.

Each starts 3 (or 2) ranks of a script that passes its rank around a ring over shared memory."""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import numpy as np, linkwise
    comm = linkwise.init()
    x = np.full(4, comm.rank, np.int32); y = np.empty_like(x)
    r = comm.irecv(y, (comm.rank - 1) % comm.size)
    comm.send(x, (comm.rank + 1) % comm.size)
    r.wait()
    print(f"RESULT {comm.rank} {comm.size} {comm.launcher} {int(y[0])}", flush=True)
""")


def _run(cmd, tmp_path, n):
    script = tmp_path / "ring.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    if env.get("PYTHONPATH"):  # the scripts run in tmp_path: keep a relative PYTHONPATH valid
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep))
    out = subprocess.run(cmd + [str(script)], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # ranks share one stdout: lines may interleave, so pick the fields out wherever they are
    rows = sorted(list(m) for m in re.findall(r"RESULT (\d+) (\d+) (\w+) (\d+)", out.stdout))
    assert len(rows) == n, out.stdout + out.stderr
    return rows


def test_linkwise_launch(tmp_path):
    rows = _run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "3"], tmp_path, 3)
    assert rows == [[str(r), "3", "linkwise", str((r - 1) % 3)] for r in range(3)]


def test_mpirun(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed")
    rows = _run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "3", sys.executable], tmp_path, 3)
    assert rows == [[str(r), "3", "openmpi", str((r - 1) % 3)] for r in range(3)]


def test_torchrun(tmp_path):
    pytest.importorskip("torch.distributed.run")  # torchrun of this interpreter
    rows = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                tmp_path, 2)
    assert rows == [[str(r), "2", "torchrun", str((r - 1) % 2)] for r in range(2)]
