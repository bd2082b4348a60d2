"""Runs a work list's independent tasks on worker processes, results in order.

Processes, not threads: on a 16-core host, threads stopped scaling at 2 to 4 workers (each job took
13x longer with 16 threads: the GIL; docs/BENCHMARKS.md), and the jobs share nothing but files,
which every worker opens itself (`worker_reader`, `worker_descriptor`). Workers are forked, so the
task functions and the plan objects need no import in the child; each runs one torch thread, ignores
SIGINT (the parent stops the pool) and dies with the parent (no orphan writes on after a kill -9).
One worker runs the tasks in this process. Everything runs on the CPU: a GPU path was measured slower
than these workers and removed (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from moeconv.checkpoint.reader import TensorReader
from moeconv.checkpoint.writer import usable_cores

_STATE: dict[str, Any] = {}  # this process's reader and write descriptor


def worker_reader() -> TensorReader:
    """This process's reader of source and output tensors (one descriptor per file, kept open)."""
    if "reader" not in _STATE:
        _STATE["reader"] = TensorReader()
    return _STATE["reader"]


def worker_descriptor(path: Path) -> int:
    """This process's write descriptor of `path` (the shard being written; the previous one is closed)."""
    if _STATE.get("path") != path:
        _close_descriptor()
        _STATE["fd"], _STATE["path"] = os.open(path, os.O_WRONLY), path
    return _STATE["fd"]


def _close_descriptor() -> None:
    if "fd" in _STATE:
        os.close(_STATE.pop("fd"))
        _STATE.pop("path")


def peak_rss_mb() -> float | None:
    """This process's resident-memory high-water mark. VmHWM (Linux) starts at exec; getrusage's
    maxrss would also count the pages of a large parent the process was forked from."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return None


def pss_mb(pid: int | str = "self") -> float | None:
    """A process's proportional set size now (Linux `smaps_rollup`): its private pages plus its share
    of each page it shares, so summed over processes each page counts once. None where not readable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next(int(line.split()[1]) for line in rollup if line.startswith("Pss:")) / 1024
    except (OSError, StopIteration, ValueError):
        return None


def descendants(pid: int | str = "self") -> list[int]:
    """Every process below `pid` (its workers, theirs, ...), from the kernel's children lists."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as children:
                below = [int(child) for child in children.read().split()]
        except (OSError, ValueError):
            continue
        for child in below:
            found += [child, *descendants(child)]
    return found


class TreeMemory:
    """The memory of this process and every process below it (the workers), sampled on a thread every
    `interval` seconds and once more at `stop`: the peak of their summed PSS, and the largest PSS a
    single one of them had. A peak shorter than the interval can be missed: a lower bound of the peak."""

    INTERVAL = 0.1

    def __init__(self, interval: float = INTERVAL):
        import threading

        self.interval = interval
        self.peak_mb: float | None = None  # the whole tree's
        self.largest_worker_mb: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeconv-memory", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        parent = pss_mb()
        if parent is None:  # no smaps_rollup (not Linux, or before 4.14): nothing to report
            return
        workers = [found for found in map(pss_mb, descendants()) if found is not None]
        self.peak_mb = max(self.peak_mb or 0.0, parent + sum(workers))
        if workers:
            self.largest_worker_mb = max(self.largest_worker_mb or 0.0, *workers)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._thread.join()
            self.sample()

    def __enter__(self) -> TreeMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _in_worker(function: Callable, task: tuple) -> tuple[Any, float | None]:
    return function(*task), peak_rss_mb()


def _start_worker(parent: int) -> None:
    """Dies with the parent, first: a worker holds the parent's lock on the output (inherited by the
    fork), so a worker that outlived a `kill -9` of its parent would refuse the user's resume. Then one
    intra-op thread (OpenMP / MKL read these when torch first starts them) for every --workers value:
    the workers together keep at most one thread per worker busy."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before PR_SET_PDEATHSIG was set
        os._exit(1)
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"
    import torch

    torch.set_num_threads(1)


def default_workers() -> int:
    """One worker per core this process may use, at most 16."""
    return max(1, min(16, usable_cores()))


class Executor:
    """`map(function, tasks)`: function(*task) for each task, in order, at most 2 x workers in flight."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or default_workers()
        self.worker_peak_rss_mb: float | None = None  # the largest worker's (pages shared with the parent included)
        self.memory: TreeMemory | None = None
        self._pool = None
        self._default_threads: int | None = None
        if self.workers > 1:
            import multiprocessing

            # Imported here, before the fork, so that every worker shares this process's torch pages
            # instead of importing its own: on the 16-core host, 16 workers importing torch each took the
            # tree from 1.0 to 5.4 GB and the conversion from 6.3 to 11.1 s (docs/BENCHMARKS.md). Planning
            # (inspect, --dry-run, the survey) still runs without it.
            import torch  # noqa: F401

            self._pool = ProcessPoolExecutor(max_workers=self.workers, initializer=_start_worker,
                                             initargs=(os.getpid(),), mp_context=multiprocessing.get_context("fork"))
            # Fork every worker now, before the caller starts threads of its own (the shard hashers).
            for started in [self._pool.submit(os.getpid) for _ in range(self.workers)]:
                started.result()
        else:
            # One intra-op thread, as in every worker: with torch's default (every core) a single
            # worker kept about 13 cores busy on a 16-core host for the work of one.
            import torch

            self._default_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        self.memory = TreeMemory()  # this process and the workers, while they live

    def map(self, function: Callable, tasks: Iterable[tuple]) -> Iterator[Any]:
        if self._pool is None:
            for task in tasks:
                yield function(*task)
            return
        pending: deque = deque()
        for task in tasks:
            pending.append(self._pool.submit(_in_worker, function, task))
            if len(pending) >= 2 * self.workers:
                yield self._taken(pending.popleft())
        while pending:
            yield self._taken(pending.popleft())

    def _taken(self, future) -> Any:
        result, peak = future.result()
        if peak is not None:
            self.worker_peak_rss_mb = max(self.worker_peak_rss_mb or 0.0, peak)
        return result

    def close(self) -> None:
        if self.memory is not None:
            self.memory.stop()  # its last sample while the workers still live
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        _close_descriptor()
        if "reader" in _STATE:  # the in-process worker's: its descriptors must not outlive the run
            _STATE.pop("reader").close()
        if self._default_threads is not None:
            import torch

            torch.set_num_threads(self._default_threads)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
