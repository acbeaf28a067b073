"""The watchdog of ``linkwise launch``: ends the ranks' process groups when the launcher dies
without ending them itself (SIGKILL, the OOM killer, a crash).

The launcher starts it (:class:`Watchdog`) before any rank: this file run as a script by a
fresh interpreter (``python -I -S``: standard library only, nothing of the user's environment),
in a session of its own, so that neither the terminal's signals (Ctrl-C, Ctrl-Z, a hangup) nor
a signal to the launcher's whole process group reach it. Its stdin is the read end of a pipe
whose write end only the launcher holds (close-on-exec). Each rank's process, between fork and
exec, once in its own process group, writes that group's id (its pid) there: ``<pgid>\\n``
(launch_signals.rank_preexec). It holds the write end until its exec, so even a launcher
killed while it starts a rank leaves no rank unannounced. When the launcher ends normally,
after it has killed those groups itself, it writes ``exit\\n``: the watchdog exits without
signalling anything. End of file without ``exit`` means the launcher is gone: the watchdog
sends SIGTERM, once, to every group it was given, then SIGCONT (for a job stopped by Ctrl-Z),
SIGKILL ``TERM_GRACE`` seconds later to those still there, and exits. It signals no group it
was not given.

PR_SET_PDEATHSIG, which the ranks had before, reached the rank only, not what it started, and
it fired again at each of the launcher's threads that the rank was handed to while the process
died: two SIGTERMs or more, which many programs take as "now" (a nested launcher escalates to
SIGKILL).

Process ids: a group's id is the pid of the rank that leads it, and the launcher does not reap
a rank before it has killed the rank's group (launch._exit_status waits with WNOWAIT), so
while the launcher lives no id given here can pass to another process. Once it died, its
ranks are reaped by init (or a subreaper), and an emptied group's id could in principle go to
a new process group before the watchdog's SIGKILL: that takes the kernel's pid counter
wrapping around within ``TERM_GRACE`` seconds.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

TERM_GRACE = 3.0  # as launch.TERM_GRACE: between SIGTERM and SIGKILL


class Watchdog:
    """The launcher's handle on its watchdog. Threading: used by the launcher's main thread only."""

    def __init__(self, say) -> None:
        self.fd = None  # the pipe's write end, which the ranks' preexec writes to; None: no watchdog
        self.proc = None
        r, w = os.pipe()  # both close on exec: no rank keeps either
        argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())]
        try:
            self.proc = subprocess.Popen(argv, stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True, cwd="/")
        except (OSError, subprocess.SubprocessError) as exc:
            os.close(w)
            say(f"linkwise launch: cannot start the watchdog ({exc}): if the launcher is killed, its "
                f"ranks may outlive it")
        else:
            self.fd = w
        finally:
            os.close(r)

    def close(self) -> None:
        """The launcher ends normally (it has killed the groups itself): the watchdog exits
        without signalling anything; waited for, briefly."""
        if self.fd is None:
            return
        try:
            os.write(self.fd, b"exit\n")
        except OSError:  # the watchdog died
            pass
        os.close(self.fd)
        self.fd = None
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:  # it cannot act any more: "exit" went first
            self.proc.kill()
            self.proc.wait()


def _signal(groups: list[int], sig: int) -> list[int]:
    """Signal each group; the groups that still exist."""
    left = []
    for g in groups:
        try:
            os.killpg(g, sig)
            left.append(g)
        except (ProcessLookupError, PermissionError):
            pass
    return left


def main() -> int:
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP):
        signal.signal(s, signal.SIG_IGN)
    groups: list[int] = []
    for line in sys.stdin.buffer:  # until the launcher writes "exit" or every writer is gone
        if line == b"exit\n":
            return 0
        if line.strip().isdigit() and int(line) not in groups:
            groups.append(int(line))
    left = _signal(groups, signal.SIGTERM)
    left = _signal(left, signal.SIGCONT)
    deadline = time.monotonic() + TERM_GRACE
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _signal(left, 0)
    _signal(left, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
