"""A few seconds of tests/coll_fuzz.py (random collective sequences against the NumPy
reference) under linkwise launch: plain on 3 ranks, split communicators with pending async
calls on 5. Longer runs: see that file's docstring."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import linkwise

HERE = Path(__file__).parent
SRC = str(Path(linkwise.__file__).resolve().parents[1])  # the linkwise under test


@pytest.mark.parametrize("n, extra", [(3, {}), (5, {"FUZZ_SPLIT": "1", "FUZZ_ASYNC": "1"})])
def test_random_sequences(n, extra):
    env = dict(os.environ, FUZZ_SECONDS="6", FUZZ_SEED=str(20 + n), **extra,
               PYTHONPATH=os.pathsep.join([str(HERE), SRC, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", str(n),
                        str(HERE / "coll_fuzz.py")], env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    done = re.findall(r"FUZZ OK (\d+) ranks (\d+) cases", p.stdout)
    sizes = sorted(int(k) for k, _ in done)
    assert sizes == ([2, 3] if extra else [3]), p.stdout[-2000:]
    assert all(int(c) >= 20 for _, c in done), done  # it ran, not just started
