"""Ctrl-C at safe points: SIGINT is held while the engine changes its state, then raised.

A KeyboardInterrupt can land between any two bytecodes. Landing inside a step (half the
requests accounted for), inside the clean-up after an earlier interrupt, or inside a
tensor-parallel step (rank 0 leaves the collectives its workers are still in) would leave the
engine in a half-state. So engine code that must not be cut runs under `deferred_interrupts()`:
a SIGINT there only sets a flag, and KeyboardInterrupt is raised when the block ends, with the
engine consistent. A second Ctrl-C while one is held adds nothing.

Only in the main thread (the only one Python delivers signals to), and only while SIGINT has
Python's default handler: a handler of the caller's own is left alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class _Deferral:
    """The process's SIGINT deferral: nesting depth, the held interrupt, the handler it replaced."""

    def __init__(self):
        self.depth = 0
        self.held = False
        self.previous = None

    def _hold(self, signum, frame) -> None:
        self.held = True

    @contextlib.contextmanager
    def __call__(self):
        if threading.current_thread() is not threading.main_thread() or (
                self.depth == 0 and signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            yield
            return
        if self.depth == 0:
            self.previous = signal.signal(signal.SIGINT, self._hold)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                signal.signal(signal.SIGINT, self.previous)
            if self.held:
                self.held = False
                raise KeyboardInterrupt


deferred_interrupts = _Deferral()
