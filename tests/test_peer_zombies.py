"""A peer that exited but is not reaped yet (a zombie) counts as dead where no pidfd tells
(kernels before 5.3, containers whose seccomp filter refuses pidfd_open): `linkwise launch`
keeps an exited rank unreaped until the job ends (its pid is its process group's id), and
kill(pid, 0), the fallback, succeeds for a zombie. Before, under `linkwise launch` a rank
whose shared-memory peer ended without closing its communicator waited until
LINKWISE_TIMEOUT (a peer that died by a signal was ended by the launcher's SIGTERM instead).
pidfd_open is refused here by a preloaded shim, as such a seccomp filter refuses it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

from test_launch import SRC

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>
long syscall(long n, ...) {
  static long (*real)(long, ...);
  if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  va_list ap;
  va_start(ap, n);
  long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long);
  long d = va_arg(ap, long), e = va_arg(ap, long), f = va_arg(ap, long);
  va_end(ap);
  if (n == SYS_pidfd_open) { errno = ENOSYS; return -1; }
  return real(n, a, b, c, d, e, f);
}
"""

PROGRAM = """
    import os, time
    import numpy as np
    import linkwise
    comm = linkwise.init()
    if comm.rank == 1:
        time.sleep(0.5)
        os._exit(0)  # no close(): the peer learns of it only from the process's end
    t0 = time.monotonic()
    try:
        comm.recv(np.zeros(4), 1)
    except linkwise.PeerError as e:
        print(f"PeerError after {time.monotonic() - t0:.1f} s:", e, flush=True)
"""


def _shim(tmp_path) -> str:
    src, lib = tmp_path / "no_pidfd.c", tmp_path / "no_pidfd.so"
    src.write_text(SHIM)
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    cc = shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler builds the pidfd_open shim (linkwise's own build needs one too)"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True)
    return str(lib)


def test_a_zombie_peer_counts_as_dead_without_pidfd(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = dict(os.environ, PYTHONPATH=SRC, LINKWISE_TIMEOUT="20", LD_PRELOAD=_shim(tmp_path),
               LINKWISE_TRANSPORT="shm")
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", str(script)],
                       env=env, capture_output=True, text=True, timeout=60)
    line = next((ln for ln in p.stdout.splitlines() if "PeerError after" in ln), None)
    assert line is not None, (p.stdout, p.stderr)
    assert float(line.split("after ")[1].split(" s")[0]) < 3.0, line
    assert "peer rank 1 died" in line, line
