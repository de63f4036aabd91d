"""Signals at safe points. An exception a signal handler raises (Ctrl-C, an alarm's timeout) inside
a step would leave the engine in a half-state. Under `deferred_interrupts()` the handlers still run
at once, but the first exception one raises is held and raised when a block (an inner one too)
ends. Only in the main thread, where Python runs signal handlers."""

from __future__ import annotations

import signal
import threading

# Signals whose Python handlers are commonly made to raise (checked on every outermost block).
DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name))


class _Deferral:
    """The process's signal deferral: nesting depth, the held exception, the handlers it wraps."""

    def __init__(self):
        self.depth = 0
        self.held: BaseException | None = None
        self.wrapped: list[tuple[int, object]] = []  # (signal, the handler it had)

    def __call__(self) -> "_Deferral":
        return self

    def _guard(self, handler):
        def guarded(signum, frame):
            try:
                handler(signum, frame)
            except BaseException as e:  # noqa: BLE001 - held, raised when the block ends
                if self.held is None:
                    self.held = e
        return guarded

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.depth == 0:
            for signum in DEFERRED_SIGNALS:
                handler = signal.getsignal(signum)
                if callable(handler):
                    signal.signal(signum, self._guard(handler))
                    self.wrapped.append((signum, handler))
        self.depth += 1

    def __exit__(self, *exc) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth -= 1
        if self.depth == 0:
            while self.wrapped:
                signal.signal(*self.wrapped.pop())
        held, self.held = self.held, None
        if held is not None:
            raise held


deferred_interrupts = _Deferral()
