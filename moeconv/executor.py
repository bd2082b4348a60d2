"""Runs a work list's independent tasks on worker processes, results in order.

Processes, not threads: on a 16-core host, threads stopped scaling at 2 to 4 workers (each job took
13x longer with 16 threads: the GIL; docs/BENCHMARKS.md), and the jobs share nothing but files,
which every worker opens itself (`worker_reader`, `worker_descriptor`). No task needs torch (every codec is
numpy), so the workers are forked from this process, at once, and share its pages (the plan); a fork
server that imported torch for them was removed with the last torch codec (docs/BENCHMARKS.md). Each
worker runs one BLAS/OpenMP thread, ignores SIGINT (the driver stops the pool) and dies with the driver (no
orphan writes on after a kill -9). One worker runs the tasks in this process. Everything runs on the
CPU: a GPU path was measured slower than these workers and removed (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from moeconv.checkpoint.reader import TensorReader
from moeconv.checkpoint.writer import usable_cores
from moeconv.storage import clients_started

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


def cpu_seconds(pid: int | str = "self") -> float | None:
    """The CPU time (user + system) a process has used so far (Linux /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class TreeMemory:
    """The memory of this process and every process below it (the workers), sampled on a thread every `interval` seconds and once more at `stop`: the peak of their summed
    PSS, the largest PSS a single one of them had, and the CPU seconds the tree used meanwhile (each
    process's from the first sample, the workers' whole). A peak shorter than the interval can be
    missed, and a process's last CPU after the last sample is: lower bounds.

    A sample is not free: reading a process's smaps_rollup walks its page tables, 3-5 ms for a worker that
    imported torch (docs/BENCHMARKS.md), so at 16 workers a sample every 0.1 s would keep most of a core
    busy. The wait after a sample is therefore at least 1 / DUTY times as long as the sample took."""

    INTERVAL = 0.1
    DUTY = 0.05  # the share of one core the sampling may take

    def __init__(self, interval: float = INTERVAL):
        import threading

        self.interval = interval
        self.samples = 0
        self.peak_mb: float | None = None  # the whole tree's
        self.largest_worker_mb: float | None = None
        self._cpu_first: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._stopped = threading.Event()
        self._take_cpu(os.getpid(), descendants(), first=True)
        self._thread = threading.Thread(target=self._run, name="moeconv-memory", daemon=True)
        self._thread.start()

    @property
    def cpu_seconds(self) -> float | None:
        """CPU seconds of the tree since this sampler started (None where /proc is not readable)."""
        if not self._cpu_last:
            return None
        return sum(last - self._cpu_first.get(pid, 0.0) for pid, last in self._cpu_last.items())

    def _take_cpu(self, parent: int, below: list[int], first: bool = False) -> None:
        for pid in (parent, *below):
            used = cpu_seconds(pid)
            if used is not None:
                if first:
                    self._cpu_first[pid] = used
                self._cpu_last[pid] = used

    def sample(self) -> None:
        self.samples += 1
        below = descendants()
        self._take_cpu(os.getpid(), below)
        parent = pss_mb()
        if parent is None:  # no smaps_rollup (not Linux, or before 4.14): nothing to report
            return
        workers = [found for found in map(pss_mb, below) if found is not None]
        self.peak_mb = max(self.peak_mb or 0.0, parent + sum(workers))
        if workers:
            self.largest_worker_mb = max(self.largest_worker_mb or 0.0, *workers)

    def _run(self) -> None:
        wait = self.interval
        while not self._stopped.wait(wait):
            started = time.perf_counter()
            self.sample()
            wait = max(self.interval, (time.perf_counter() - started) / self.DUTY)

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


def _start_worker(driver: int) -> None:
    """Dies with the driver (the process that runs the pool and forked it), first: a worker that outlived a
    `kill -9` of the driver would write on into the folder the user's resume works in, so the kernel kills
    it with its parent (PR_SET_PDEATHSIG). Then one thread for anything that reads these variables when it
    first starts its threads."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if driver and os.getppid() != driver:  # gone before PR_SET_PDEATHSIG was set (0: forked by a forkserver)
        os._exit(1)
    _reuse_freed_memory()
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"


# glibc's mallopt parameters (malloc.h) and what a worker sets them to.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HEAP_KEPT = {_M_MMAP_THRESHOLD: 256 << 20, _M_TRIM_THRESHOLD: 512 << 20, _M_TOP_PAD: 64 << 20}


def _reuse_freed_memory() -> None:
    """A task allocates arrays of megabytes (an expert's tensors and their temporaries). glibc serves
    those from fresh mmaps, returned on free, so every task page-faults its memory in again (zeroed by
    the kernel); kept in the heap instead, they are reused (docs/BENCHMARKS.md: half of a verify check's
    time). What a worker holds stays bounded by its largest task. Nothing where the C library has no
    mallopt (not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    for parameter, value in _HEAP_KEPT.items():
        mallopt(parameter, value)


def _share_heap_with_forks() -> None:
    """Keeps the pages of this process's objects (the plan: hundreds of MB for a large checkpoint)
    shared with the workers forked from it: a garbage collection writes into every object it visits,
    so collections in this process or in a worker would give each a private copy of those pages. Frozen
    objects are never visited; `Executor.close` thaws them. (The gc module's own advice for forking.)"""
    gc.collect()
    gc.freeze()


JOBS_PER_TASK = 8


def in_batches(executor: Any, function: Callable, tasks: Sequence[tuple]) -> Iterator[Any]:
    """`executor.map(function, tasks)` (an Executor or a RayMap), up to JOBS_PER_TASK tasks to each of the
    workers' tasks: a task per expert cost the parent half a millisecond of pickling each (the objects the
    tasks share, the codec and the output's entries, are pickled once a batch) and a future and a result
    each, 4.8 s of its interpreter at 25 GB on 16 workers (docs/BENCHMARKS.md). Fewer where batches would
    leave workers idle: every worker gets at least four (a small shard's jobs go one a task, as before)."""
    size = max(1, min(JOBS_PER_TASK, len(tasks) // (4 * executor.workers)))
    batches = [(function, tuple(tasks[start:start + size])) for start in range(0, len(tasks), size)]
    for results in executor.map(_each, batches):
        yield from results


def _each(function: Callable, batch: tuple[tuple, ...]) -> list[Any]:
    return [function(*task) for task in batch]


def default_workers() -> int:
    """One worker per core this process may use, at most 16."""
    return max(1, min(16, usable_cores()))


class Executor:
    """`map(function, tasks)`: function(*task) for each task, in order, at most 2 x workers in flight, on
    workers forked from this process (its objects frozen out of the collector meanwhile, so that their
    pages stay shared)."""

    def __init__(self, workers: int | None = None):
        import multiprocessing

        self.workers = workers or default_workers()
        self.worker_peak_rss_mb: float | None = None  # the largest worker's (pages shared with the parent included)
        self.memory = TreeMemory()  # this process and the workers, from their start while they live
        self._pool = None
        self._frozen = False  # this process's objects frozen out of the collector for the forks (close thaws)
        if self.workers > 1:
            try:
                _share_heap_with_forks()
                self._frozen = True
                # An object store client's runtime does not survive a fork (storage.clients_started): the
                # workers then fork from a fresh interpreter (forkserver), which dies with this process.
                fresh = clients_started()
                self._pool = ProcessPoolExecutor(max_workers=self.workers, initializer=_start_worker,
                                                 initargs=(0 if fresh else os.getpid(),),
                                                 mp_context=multiprocessing.get_context(
                                                     "forkserver" if fresh else "fork"))
                # Every worker now: the pool starts them as tasks arrive, and one that is idle is reused.
                for started in [self._pool.submit(os.getpid) for _ in range(self.workers)]:
                    started.result()
            except BaseException:
                self.close()
                raise

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
        self.memory.stop()  # its last sample while the workers still live
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
        _close_descriptor()
        if "reader" in _STATE:  # the in-process worker's: its descriptors must not outlive the run
            _STATE.pop("reader").close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
