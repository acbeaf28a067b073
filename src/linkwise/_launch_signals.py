"""The signals of ``linkwise launch``: those it passes on to its ranks' process groups, job
control (Ctrl-Z and ``fg``), and what a rank's process does before exec.

Threading: the handlers run in the launcher's main thread (Python runs signal handlers
there); ``Relay`` is made and restored by that thread, and reads the rank list the main
thread fills.
"""
from __future__ import annotations

import os
import signal
import subprocess

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Job control: the terminal's Ctrl-Z, and a background job's access to the terminal.
STOP_SIGNALS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the rank's process group, also once the rank itself has exited: the group's id
    stays taken while the launcher has not reaped the rank (launch._exit_status), and after
    that while any process it started is still in it. A group found empty once is never
    signalled again (its id may go to another process)."""
    if getattr(proc, "group_gone", False):
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        proc.group_gone = True


class Relay:
    """The launcher's signal handlers, installed while it lives (restore() puts back the old).

    * SIGINT, SIGTERM, SIGHUP, SIGQUIT: passed on to every rank's group; a second one is sent
      as SIGKILL. ``seen`` lists them in order. A SIGHUP ignored at start (nohup) stays ignored.
    * SIGTSTP (Ctrl-Z), SIGTTIN, SIGTTOU: every rank's group is sent SIGTSTP, as the terminal
      sends it to a foreground job (a rank's group is never orphaned while the launcher, its
      parent in the same session, lives, so the kernel does not drop it); a launcher nested
      in a rank handles it in turn, which SIGSTOP would not let it do. Then the launcher
      stops itself with SIGSTOP, which the kernel does not drop where the launcher's own
      group is orphaned, as it would a default SIGTSTP. One of them ignored at start (``trap
      '' TSTP``, a runner that lets background jobs write to the terminal) stays ignored, in
      the ranks too, as a SIGHUP under nohup does: handled, it stopped a job meant to run on.
    * SIGCONT (``fg``, ``bg``, ``kill -CONT``): passed on, so the ranks go on with it.

    Installed before the ranks start, for two reasons: a signal that comes while they start
    is not lost, and a rank must not inherit an *ignored* SIGINT (a launcher started as a
    background job of a non-interactive shell has one): exec resets handled signals to the
    default, so the ranks' Python turns a forwarded SIGINT into KeyboardInterrupt."""

    def __init__(self, procs: list) -> None:
        self.procs = procs
        self.seen: list[int] = []
        kept = {s for s in (signal.SIGHUP,) + STOP_SIGNALS if signal.getsignal(s) == signal.SIG_IGN}
        handlers = {s: self._forward for s in FORWARDED_SIGNALS if s not in kept}
        handlers.update({s: self._stop for s in STOP_SIGNALS if s not in kept})
        handlers[signal.SIGCONT] = self._continue
        self._old = {s: signal.signal(s, h) for s, h in handlers.items()}

    def _forward(self, signum, _frame) -> None:
        self.seen.append(signum)
        sig = signum if len(self.seen) == 1 else signal.SIGKILL
        for p in self.procs:
            signal_group(p, sig)

    def _stop(self, _signum, _frame) -> None:
        for p in self.procs:
            signal_group(p, signal.SIGTSTP)
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued; _continue runs next

    def _continue(self, _signum, _frame) -> None:
        for p in self.procs:
            signal_group(p, signal.SIGCONT)

    def caught_up(self) -> None:
        """After the last rank started: one that came while they started reaches all."""
        if self.seen:
            for p in self.procs:
                signal_group(p, self.seen[0])

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def rank_preexec(watchdog_fd):
    """What a rank's child process does before exec: its own process group (so that a
    signal reaches whatever the rank starts), announced to the launcher's watchdog on
    ``watchdog_fd`` (None: none runs), which ends the group should the launcher die (see
    linkwise._launch_watchdog). Popen's process_group= would do the first from Python 3.11
    on; this works on 3.10 too. It runs between fork and exec (before Popen's close_fds, so
    the descriptor is still open), while the launcher has no other thread (the output threads
    start after the last rank), and makes four system calls. SIGPIPE is ignored around the
    write: Popen has set it to the default action by then (restore_signals), which killed
    every rank started once the watchdog was gone (killed, or its interpreter could not run
    the script) instead of raising EPIPE here; it is the default again before exec."""
    def preexec() -> None:
        os.setpgid(0, 0)
        if watchdog_fd is not None:
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
            try:
                os.write(watchdog_fd, b"%d\n" % os.getpid())
            except OSError:  # the watchdog died: the rank runs without it
                pass
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as Popen left it, not Python's SIG_IGN
    return preexec
