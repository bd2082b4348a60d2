"""The executor's workers: one torch intra-op thread each, so threads never exceed the cores asked for;
and the memory of the whole process tree (this process and its workers), as the report gives it."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

import moeconv
from moeconv.executor import Executor, TreeMemory
from moeconv.synth import SynthSpec, make_checkpoint


def _threads_and_pid() -> tuple[int, int]:
    return torch.get_num_threads(), os.getpid()


# 1: in this process; 2: one per core here; 3: more workers than this machine's 2 cores.
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_worker_runs_one_torch_thread_and_the_caller_gets_its_own_back(workers):
    torch.set_num_threads(2)  # what torch picks by itself on a 2-core machine
    with Executor(workers) as executor:
        reported = list(executor.map(_threads_and_pid, [()] * 6))
    assert [threads for threads, _ in reported] == [1] * 6
    ran_in = {pid for _, pid in reported}
    assert (ran_in == {os.getpid()}) if workers == 1 else (os.getpid() not in ran_in)
    assert torch.get_num_threads() == 2


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
                children = [int(pid) for task in os.listdir("/proc/self/task")
                            for pid in open(f"/proc/self/task/{task}/children").read().split()]
                seen["workers_kb"] = sum(_pss_kb(pid) for pid in children)
                seen["parent_kb"] = _pss_kb(os.getpid())
                time.sleep(3 * TreeMemory.INTERVAL)  # the sampler's turns while both still hold
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
