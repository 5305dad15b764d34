"""A process that is stopping on purpose exits 0 whatever SIGTERM reaches it on the way out
(``lifetime.ignore_stop_signals``, which ``dualpath engine`` calls once it stops).

The child below installs a SIGTERM handler, as the engine and its supervisor do, then ends;
while Python finalizes it blocks on its stdin (a global's ``__del__``), so the test's SIGTERM
lands at a known point of the exit, not by timing."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import signal, sys
    from dualpath.lifetime import ignore_stop_signals

    signal.signal(signal.SIGTERM, lambda signum, frame: None)

    class HeldExit:
        def __del__(self):
            print("finalizing", flush=True)
            sys.stdin.read()  # until the test closes it

    held = HeldExit()
    if sys.argv[1] == "ignore":
        ignore_stop_signals()
    """
)


def _exit_code_after_a_sigterm_while_finalizing(mode: str) -> int:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "finalizing\n"
    child.send_signal(signal.SIGTERM)
    child.stdin.close()
    try:
        return child.wait(60)
    finally:
        child.stdout.close()


@pytest.mark.parametrize(
    ("mode", "exit_code"),
    [
        ("keep", -signal.SIGTERM),  # why: finalizing Python put the default handler back
        ("ignore", 0),
    ],
)
def test_a_sigterm_while_the_process_exits_keeps_its_exit_code(mode: str, exit_code: int) -> None:
    assert _exit_code_after_a_sigterm_while_finalizing(mode) == exit_code
