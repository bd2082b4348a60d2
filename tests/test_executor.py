"""The executor's workers: one OpenMP/MKL thread each, so threads never exceed the cores asked for;
and the memory of the whole process tree (this process and its workers), as the report gives it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import moeconv
from moeconv.executor import Executor, TreeMemory
from moeconv.synth import SynthSpec, make_checkpoint


def _threads_and_pid() -> tuple[str | None, str | None, int]:
    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS"), os.getpid()


# 1: in this process; 2: one per core here; 3: more workers than this machine's 2 cores.
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_worker_runs_one_thread_and_the_caller_keeps_its_own(workers):
    before = os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS")
    with Executor(workers) as executor:
        reported = list(executor.map(_threads_and_pid, [()] * 6))
    ran_in = {pid for *_, pid in reported}
    if workers == 1:
        assert ran_in == {os.getpid()} and {tuple(threads) for *threads, _ in reported} == {before}
    else:
        assert os.getpid() not in ran_in and {tuple(threads) for *threads, _ in reported} == {("1", "1")}
    assert (os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS")) == before


HELD_MB = 96


def _hold(megabytes: int, folder: str) -> int:
    """Keeps `megabytes` of private, touched memory until `folder/release` exists (30 s at most), having
    said so with a file named by this worker's pid; returns the pid."""
    held = bytes([1]) * (megabytes << 20)
    Path(folder, str(os.getpid())).touch()
    for _ in range(300):
        if Path(folder, "release").exists():
            break
        time.sleep(0.1)
    return os.getpid() + len(held) * 0


def _pss_kb(pid: int) -> int:
    """The test's own reading of /proc/PID/smaps_rollup's total Pss line."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            name, value, *_ = line.split()
            if name == "Pss:":
                return int(value)
    raise AssertionError(f"no Pss line for {pid}")


def _below(pid: int) -> list[int]:
    """The test's own walk of the kernel's children lists: every process below `pid`."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in map(int, open(f"/proc/{pid}/task/{task}/children").read().split()):
            found += [child, *_below(child)]
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux smaps_rollup")
def test_the_tree_memory_counts_every_worker_while_it_holds_memory(tmp_path):
    with Executor(2) as executor:
        seen: dict[str, int] = {}

        def look() -> None:  # once both workers hold their memory, read every child's Pss ourselves
            try:
                for _ in range(300):
                    if len([path for path in tmp_path.iterdir() if path.name.isdigit()]) == 2:
                        break
                    time.sleep(0.05)
                below = _below(os.getpid())  # the workers
                seen["workers_kb"] = sum(_pss_kb(pid) for pid in below)
                seen["parent_kb"] = _pss_kb(os.getpid())
                taken = executor.memory.samples
                for _ in range(600):  # two of the sampler's turns while both still hold
                    if executor.memory.samples >= taken + 2:
                        break
                    time.sleep(0.05)
            finally:
                (tmp_path / "release").touch()

        looker = threading.Thread(target=look)
        looker.start()
        pids = list(executor.map(_hold, [(HELD_MB, str(tmp_path))] * 2))
        looker.join()
    memory = executor.memory  # sampled every TreeMemory.INTERVAL while the workers lived
    assert len(set(pids)) == 2  # two workers, holding at the same time (each waited for the release)
    parent_mb, workers_mb = seen["parent_kb"] / 1024, seen["workers_kb"] / 1024
    assert workers_mb >= 2 * HELD_MB  # what the test saw itself: both holdings, in the workers
    assert memory.peak_mb >= 0.95 * (parent_mb + workers_mb)
    assert memory.peak_mb >= parent_mb + 2 * HELD_MB
    assert memory.peak_mb <= parent_mb + workers_mb + 2 * HELD_MB  # no page counted twice over
    assert HELD_MB <= memory.largest_worker_mb <= workers_mb


class _SlowSample(TreeMemory):
    """A tree whose every sample takes 50 ms more (as 16 workers' smaps_rollup can), timed by the test."""

    def __init__(self) -> None:
        self.busy, self.longest = 0.0, 0.0
        super().__init__()

    def sample(self) -> None:
        started = time.perf_counter()
        time.sleep(0.05)
        super().sample()
        took = time.perf_counter() - started
        self.busy, self.longest = self.busy + took, max(self.longest, took)


def test_the_memory_sampler_takes_a_bounded_share_of_a_core():
    memory = _SlowSample()
    started = time.perf_counter()
    time.sleep(2.0)
    busy, samples, longest, elapsed = memory.busy, memory.samples, memory.longest, time.perf_counter() - started
    memory.stop()
    # Every 0.1 s regardless, 2 s would hold about 13 samples and a third of the time spent sampling. Each
    # wait is at least 1 / DUTY times its sample: a few samples, DUTY of the time but for the last one's.
    assert 1 <= samples <= 3, samples
    assert busy <= elapsed * TreeMemory.DUTY + longest, (busy, elapsed, longest)


def test_the_report_gives_the_tree_memory_in_json_and_in_words(tmp_path, capsys):
    from helpers import run_main

    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    report = moeconv.convert(source, tmp_path / "out", workers=2)
    if report.tree_peak_pss_mb is None:
        pytest.skip("no smaps_rollup on this system")
    found = report.to_json()
    assert found["tree_peak_pss_mb"] >= found["largest_worker_pss_mb"] > 0
    # The parent's RSS high-water mark is not a bound of the tree's PSS (shared pages are split), but
    # the tree holds at least the workers' private pages beside the parent's own.
    assert found["tree_peak_pss_mb"] > found["largest_worker_pss_mb"] + 1
    code, out, _ = run_main(capsys, "convert", source, "-o", tmp_path / "words", "--workers", "2", "-q")
    row = next(line for line in out.splitlines() if "peak memory" in line)
    assert code == 0 and re.search(r"peak memory\s*│\s*\d+ MB, the whole process tree", row), out


def _spin(seconds: float) -> int:
    """Busy for `seconds` of this worker's own CPU time; returns the pid."""
    begin = time.process_time()
    while time.process_time() - begin < seconds:
        pass
    return os.getpid()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc/PID/stat")
def test_the_tree_cpu_counts_the_workers_cpu():
    with Executor(2) as executor:
        pids = list(executor.map(_spin, [(0.6,)] * 2))
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert executor.memory.cpu_seconds >= 2 * 0.6 * 0.9  # ticks are 10 ms: within a tick per process
    assert executor.memory.cpu_seconds < 2 * 0.6 + 10  # not everything since boot


POOL_PARENTS = """
import os, sys
from moeconv.executor import Executor
with Executor(2) as pool:
    seen = set(pool.map(eval, [("('torch' in __import__('sys').modules, __import__('os').getppid())",)] * 4))
print(seen == {(False, os.getpid())}, "torch" in sys.modules)
"""


def test_workers_are_forked_from_the_process_that_runs_the_pool_and_import_no_torch():
    """No task needs torch (every codec is numpy): the workers are this process's children, forked at once,
    with no fork server between (one imported torch for them until issue 39)."""
    done = subprocess.run([sys.executable, "-c", POOL_PARENTS], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True False", done.stdout + done.stderr


DRIVER = """
import os, sys, time
from moeconv.executor import Executor
with Executor(2) as pool:
    print(*pool.map(os.getpid, [()] * 4), flush=True)
    time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc")
def test_workers_end_when_their_driver_is_killed():
    """kill -9 of the process that runs the pool: its workers (its own children) end within seconds, instead
    of waiting forever on a queue whose writing end they hold themselves."""
    import signal
    import subprocess
    import sys

    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        workers = {int(pid) for pid in driver.stdout.readline().split()}
        assert workers and driver.pid not in workers
        servers = set()
        for pid in workers:
            with open(f"/proc/{pid}/stat") as stat:
                servers.add(int(stat.read().rsplit(")", 1)[1].split()[1]))
        assert servers == {driver.pid}  # forked by the driver itself
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(map(_gone, workers)):
        time.sleep(0.1)
    assert all(map(_gone, workers)), [pid for pid in workers if not _gone(pid)]


def _returned_on_freeing(nbytes: int = 48 << 20) -> int:
    """Bytes of resident memory this process gives back to the kernel when it frees a touched array of
    `nbytes`: about none where freed memory is kept for reuse, about all of it where it is returned (as
    glibc's defaults return an array over their 32 MiB mmap limit)."""
    import numpy as np

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    array = np.ones(nbytes, dtype=np.uint8)
    during = resident()
    del array
    return during - resident()


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt, /proc")
def test_a_worker_keeps_the_memory_a_task_frees():
    """A worker keeps freed memory in its heap (executor._reuse_freed_memory), so the next task's arrays
    do not page-fault in anew (half of a verify check's time on the dev machine). The control: a fresh
    interpreter with glibc's defaults returns the same array's memory to the kernel."""
    control = subprocess.run([sys.executable, "-c", "import tests.test_executor as t; print(t._returned_on_freeing())"],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert int(control.stdout) > 40 << 20, control.stdout + control.stderr
    with Executor(2) as executor:
        returned = list(executor.map(_returned_on_freeing, [()] * 4))
    assert max(returned) < 8 << 20, returned


def _private_after_collecting() -> int:
    """This worker's private dirty bytes after a full garbage collection (Linux smaps_rollup)."""
    import gc

    gc.collect()
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith("Private_Dirty:")) << 10


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps_rollup")
def test_workers_share_the_parents_objects_through_their_collections(monkeypatch):
    """A plan of a large checkpoint is hundreds of MB of small objects in the driver. Workers forked
    from it keep those pages shared only if their garbage collections do not visit them (gc.freeze in
    executor._share_heap_with_forks); the control, without the freeze, copies them into every worker."""
    import moeconv.executor as executor_module

    held = [[str(i), (i, i + 1)] for i in range(400_000)]  # about 80 MB of gc-tracked objects
    import gc

    with Executor(2) as executor:
        assert gc.get_freeze_count() > 0
        frozen = list(executor.map(_private_after_collecting, [()] * 2))
    assert gc.get_freeze_count() == 0  # thawed when the pool closes
    monkeypatch.setattr(executor_module, "_share_heap_with_forks", lambda: None)
    with Executor(2) as executor:
        copied = list(executor.map(_private_after_collecting, [()] * 2))
    del held
    assert min(copied) > 40 << 20, copied  # the control: a collection copied the graph's pages
    assert max(frozen) < 20 << 20, frozen


class _Recording:
    """An executor with `workers` that runs map's tasks here and records how many jobs each task held."""

    def __init__(self, workers: int):
        self.workers, self.batches = workers, []

    def map(self, function, tasks):
        for task in tasks:
            self.batches.append(len(task[1]))
            yield function(*task)


@pytest.mark.parametrize("jobs, workers, per_task", [(1000, 4, 8), (100, 4, 6), (36, 16, 1), (0, 2, None), (7, 1, 1)])
def test_in_batches_gives_every_result_in_order_and_keeps_the_workers_busy(jobs, workers, per_task):
    from moeconv.executor import JOBS_PER_TASK, in_batches

    executor = _Recording(workers)
    tasks = [(i, i % 7) for i in range(jobs)]
    assert list(in_batches(executor, pow, tasks)) == [i ** (i % 7) for i in range(jobs)]
    assert sum(executor.batches) == jobs
    if jobs:  # up to JOBS_PER_TASK a task, and at least four tasks a worker where there are jobs for it
        assert set(executor.batches[:-1]) <= {per_task} and executor.batches[-1] <= per_task <= JOBS_PER_TASK
        assert len(executor.batches) >= min(jobs, 4 * workers)
    else:
        assert executor.batches == []
