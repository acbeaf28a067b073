"""Shared helpers for the GPU review probes (imported by probe_*.py from the same folder)."""
import os
import sys
import time
import traceback

NAME = os.path.basename(sys.argv[0])


def setenv(**kw):
    for k, v in kw.items():
        os.environ[k] = str(v)


def rank() -> int:
    return int(os.environ.get("LINKWISE_RANK", "0"))


def say(kind, msg):
    print(f"{kind} {NAME} rank {rank()}: {msg}", flush=True)


def PASS(msg):
    say("PASS", msg)


def FAIL(msg):
    say("FAIL", msg)


def INFO(msg):
    say("INFO", msg)


def verdict(ok, msg):
    (PASS if ok else FAIL)(msg)


def exc_text(e) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def init(need_ranks=1):
    import linkwise
    import torch
    comm = linkwise.init()
    if comm.size < need_ranks:
        FAIL(f"needs {need_ranks} ranks (run with python -m linkwise.cli launch -n {need_ranks})")
        os._exit(0)
    g = comm.cuda()
    torch.cuda.set_device(g.device)
    return comm, g, torch


def finish(comm=None):
    """Bounded teardown: a host barrier (errors ignored), then exit without the close barrier."""
    try:
        sys.stdout.flush()
        if comm is not None and comm.size > 1:
            comm.barrier()
    except BaseException:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(main):
    try:
        main()
    except BaseException as e:  # noqa: BLE001
        FAIL("probe crashed: " + exc_text(e) + "\n" + traceback.format_exc()[-1500:])
        sys.stdout.flush()
        os._exit(0)
