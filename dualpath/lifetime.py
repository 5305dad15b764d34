"""Child processes that never outlive their parent.

``die_with_parent`` asks Linux to send SIGTERM to the calling process when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), so a killed launcher or benchmark leaves no engine or server
behind. Call it in the child (first thing, or as ``subprocess.Popen(preexec_fn=...)``). Off
Linux it does nothing. The signal fires when the *thread* that started the child exits, so
start long-lived children from a long-lived thread.

``ignore_stop_signals`` is for a process that is already stopping on purpose: a SIGTERM or
SIGINT from then on asks for the stop under way. Without it, one that arrives while Python
finalizes (which puts the default handlers back) kills the process, and a clean exit 0 is
seen as -15; one that arrives while it closes raises in the middle of closing.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
