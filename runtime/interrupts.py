"""Holding Ctrl-C across bookkeeping that must not be cut in half.

The engine's host state (page tables, placeholders, the donated KV state) changes in steps that must finish
once begun; only waiting on the device may be interrupted. Inside `deferred()` a SIGINT is remembered and
raised as KeyboardInterrupt when the block ends, after `on_interrupt` hooks put back what the caller would
otherwise lose. Python delivers signals to the main thread only, so elsewhere this is a plain block.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable


class deferred:
    """with deferred() as d: ...; d.on_interrupt(fn): fn runs if the block ends by raising the held interrupt.

    A second Ctrl-C inside the block is not held: it raises at once (a stuck block must stay stoppable).
    """

    def __enter__(self) -> deferred:
        self.received, self._hooks, self._previous = False, [], None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = True

    def on_interrupt(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._previous is None:
            return
        signal.signal(signal.SIGINT, self._previous)
        if self.received and exc_type is None and self._previous != signal.SIG_IGN:
            try:
                if callable(self._previous):
                    self._previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
                else:
                    raise KeyboardInterrupt
            except BaseException:
                for hook in self._hooks:  # only when the block ends by raising
                    hook()
                raise
