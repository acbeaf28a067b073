"""A forked child may drop native objects it inherited (core/process_local.h): Python's garbage
collector frees, in the child, a communicator that was garbage in the parent when it forked
(multiprocessing, DataLoader workers, this suite's run_ranks). Its worker thread exists only
in the parent, so the child must neither join it nor destroy the condition variable it waits
on: before, the child hung in pthread_cond_destroy (or, joining, died of std::terminate)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, os, sys, time
    import numpy as np
    import linkwise
    gc.disable()  # the communicator below stays garbage until the child collects it
    c = linkwise.init()

    class NoAsync:  # latency entries that leave async calls to the worker, as several ranks' do
        serves_async = False

        def __init__(self, solo):
            self.solo = solo

        def __getattr__(self, name):
            return getattr(self.solo, name)
    c._fast_shm = NoAsync(c._fast_shm)
    c.all_reduce(np.ones(10), async_op=True).wait()
    assert c.__dict__.get("_coll_worker") is not None, "the worker thread was not started"
    c.close()
    c.cycle = c
    del c
    pid = os.fork()
    if pid == 0:
        gc.collect()  # frees the communicator, its worker and its engine here
        os._exit(0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child", os.waitstatus_to_exitcode(status))
            sys.exit(0)
        time.sleep(0.02)
    os.kill(pid, 9)
    print("child hung")
""")


def test_a_forked_child_frees_an_inherited_communicator_with_a_worker_thread():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "0"], out.stdout + out.stderr
