"""How verify's work runs: its phases (the progress each reports, and how long each took), the digests'
thread beside the main one, and the stop of that thread when verify ends early (an Event it looks at
between files)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def _silent(amount: int, total: int | None = None, phase: str | None = None) -> None:
    pass


class Scheduler:
    """verify's progress callback (`progress(0, total, phase)` starts a phase, `progress(n)` advances it),
    timing each phase from its start to the next one's, or to the last advance, into `seconds`, and what
    came before the first as `prepare`; with one background task (`background`), whose advances are
    held, summed, until `share` opens the current phase to them, then passed on under one lock."""

    def __init__(self, progress: Callable[..., None] | None, began: float):
        self.seconds: dict[str, float] = {}
        self.cancelled = threading.Event()  # set: the background task stops at its next file
        self._progress, self._phase, self._started = progress or _silent, None, began
        self._lock, self._held, self._shared = threading.Lock(), 0, False
        self._task: Future | None = None
        self._task_seconds: dict[str, float] = {}

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()  # an error or an interrupt, or a verdict without them: the digests stop at their next file

    def phase(self, name: str, total: int) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._phase is None:
                self.seconds["prepare"] = round(now - self._started, 3)
            self._phase, self._started = name, now
            self._progress(0, total, name)
            self.seconds[name] = 0.0

    def advance(self, amount: int) -> None:
        with self._lock:
            self._progress(amount)
            if self._phase is not None:
                self.seconds[self._phase] = round(time.perf_counter() - self._started, 3)

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """The seconds of one part of a phase, into `seconds[key]`."""
        started = time.perf_counter()
        yield
        self.seconds[key] = round(time.perf_counter() - started, 3)

    def background(self, function: Callable[..., Any], *args: Any) -> None:
        """function(*args, advance, seconds, cancelled) on a daemon thread (an interrupted verify does not wait
        for it at exit): `advance` its progress, `seconds` its parts' durations (they overlap the main
        thread's work), `cancelled` the Event it stops at."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(function(*args, self._advance_from_background, self._task_seconds, self.cancelled))
            except BaseException as error:  # handed to whoever reads the result
                future.set_exception(error)

        self._task = future
        threading.Thread(target=run, name="moeconv-digests", daemon=True).start()

    def share(self) -> None:
        """The current phase counts the background task's progress: what it held so far at once."""
        with self._lock:
            self._shared, held, self._held = True, self._held, 0
        if held:
            self.advance(held)

    def background_result(self) -> Any:
        """The background task's result (or its error), once it ends; its parts' seconds join `seconds`."""
        assert self._task is not None
        result = self._task.result()
        self.seconds.update(self._task_seconds)
        return result

    def cancel(self) -> None:
        self.cancelled.set()

    def _advance_from_background(self, amount: int) -> None:
        with self._lock:
            if not self._shared:
                self._held += amount
                return
        self.advance(amount)
