"""Every kind of linkwise::Error that native code throws reaches Python as its documented
exception (core/status.h: Invalid -> ValueError, Type -> TypeError, Timeout ->
linkwise.TimeoutError), from the native entry points called straight, in one process (a
one-rank communicator sends to itself). On the GPU machine's build a bad timeout
(wait.cc's throw_bad_timeout) crashed the interpreter with SIGSEGV instead of raising
ValueError, so the calls run in a child process: a crash fails the test with the child's
signal and faulthandler's traceback instead of taking pytest down with it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import linkwise

SRC = str(Path(linkwise.__file__).resolve().parents[1])

# Each case prints "<name>|<exception class>|<message>" (or "<name>|no error|<result>").
CHILD = r"""
import numpy as np
import linkwise
from linkwise import _native

comm = linkwise.init()  # no launcher: one rank
native = comm._native
x = np.zeros(4, np.float32)

def case(name, call):
    try:
        got = call()
    except Exception as e:
        print(f"{name}|{type(e).__module__}.{type(e).__name__}|{e}", flush=True)
    else:
        print(f"{name}|no error|{got!r}", flush=True)

for label, bad in (("nan", float("nan")), ("neg", -1.0), ("zero", 0.0), ("inf", float("inf"))):
    case(f"wait_all-{label}", lambda: _native.wait_all([], bad))
    case(f"isend-{label}", lambda: comm.isend(x, 0, 5, timeout=bad))
    case(f"irecv-{label}", lambda: comm.irecv(x, 0, 5, timeout=bad))
    case(f"native-send-{label}", lambda: native.send(x, 0, 5, bad))
    pending = comm.irecv(np.zeros(4, np.float32), 0, 6)
    case(f"wait-{label}", lambda: pending.wait(timeout=bad))
    case(f"wait_all-list-{label}", lambda: _native.wait_all([pending], bad))
    comm.send(np.ones(4, np.float32), 0, 6)
    case(f"after-{label}", lambda: pending.wait(timeout=5))

buf = np.arange(9, dtype=np.float32)
case("invalid-bindings", lambda: native.sendrecv(buf[:8], 0, 9, buf[1:], 0, 9, 5.0))
case("invalid-params", lambda: _native.coll(native, 99, None, None, 0, 0, 0, 0, 0, 0, [], -1, [], 5.0))
wrong_dtype = comm.irecv(np.zeros(4, np.int32), 0, 7)
comm.isend(np.zeros(4, np.float32), 0, 7).wait(timeout=5)
case("type-engine", lambda: wrong_dtype.wait(timeout=5))
never = comm.irecv(np.zeros(4, np.float32), 0, 8)
case("timeout-engine", lambda: never.wait(timeout=0.05))
print("done", flush=True)
"""


def _run_child(tmp_path) -> dict[str, tuple[str, str]]:
    script = tmp_path / "native_errors.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=SRC)
    p = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("done"), (
        f"child exited with {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    lines = [line.split("|", 2) for line in p.stdout.splitlines() if "|" in line]
    return {name: (cls, msg) for name, cls, msg in lines}


def test_native_errors_raise_their_python_exceptions(tmp_path):
    got = _run_child(tmp_path)
    for label, shown in (("nan", "nan"), ("neg", "-1"), ("zero", "0"), ("inf", "inf")):
        for name, op in (("wait_all", "wait_all"), ("isend", "isend"), ("irecv", "irecv"),
                         ("native-send", "send"), ("wait", "wait"), ("wait_all-list", "wait_all")):
            assert got[f"{name}-{label}"] == (
                "builtins.ValueError", f"{op}: timeout {shown}: give seconds, a positive finite number"), name
        # the refused calls posted nothing: the pending receive still takes its message
        assert got[f"after-{label}"] == ("no error", "16")
    cls, msg = got["invalid-bindings"]
    assert cls == "builtins.ValueError" and msg.startswith("sendrecv: x and out share memory")
    assert got["invalid-params"] == ("builtins.ValueError", "collective kind out of range")
    cls, msg = got["type-engine"]
    assert cls == "builtins.TypeError" and "sent float32 data (tag 7) but the receive buffer holds int32" in msg
    cls, msg = got["timeout-engine"]
    assert cls == "linkwise.errors.TimeoutError" and "did not complete within 0.05 s" in msg
