"""Preemption: the signals that ask a training run to stop at the next step.

A scheduler that takes the machines back sends SIGTERM first (Slurm, Kubernetes,
`scontrol requeue`), or a signal the job asked for ahead of its time limit
(`sbatch --signal=B:USR1@120`, named by `--preemption_signal`). While training,
such a signal does not end the process: it is remembered, the rank sends the
request with its next step (`Trainer.train_step_agreeing`), and every rank stops
after that same step, writes a checkpoint and exits with `EXIT_PREEMPTED`.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

# The exit status of a run stopped by a preemption signal after its checkpoint:
# EX_TEMPFAIL, "try again later". The same command with --resume continues it.
EXIT_PREEMPTED = 75

# Signals that cannot be caught.
UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})


def parse_signal(name: str) -> signal.Signals:
    """`USR1`, `SIGUSR1` or a number, as a signal; ValueError naming what is accepted."""
    text = name.strip().upper()
    try:
        found = (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
        )
    except (KeyError, ValueError):
        raise ValueError(
            f"--preemption_signal: expected a signal name such as USR1 or SIGUSR1, got {name!r}"
        ) from None
    if found.name in UNCATCHABLE:
        raise ValueError(f"--preemption_signal: {found.name} cannot be caught, choose another")
    return found


class StopSignals:
    """While entered, SIGTERM and `extra` (if given) set `seen` instead of ending
    the process; the previous handlers come back on exit. Only the main thread
    can install handlers; elsewhere (tests driving a loop from a thread) the
    signals are left alone and `seen` stays None."""

    def __init__(self, extra: signal.Signals | None = None) -> None:
        self.signals = [signal.SIGTERM] + ([extra] if extra and extra != signal.SIGTERM else [])
        self.seen: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.seen is None:
            self.seen = signal.Signals(number)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
                # Any thread may take the signal; the collectives' threads (Gloo,
                # MPI) must see their system calls restarted, not failing with EINTR.
                signal.siginterrupt(sig, False)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
