"""Where a conversion's time goes: wall seconds summed per stage (over all worker threads), for a few
worker counts, in one process (no import or startup cost). For diagnosing throughput, not for the
benchmark table: python scripts/profile_convert.py SOURCE [--backend triton] [--workers 1,4,16]"""

from __future__ import annotations

import argparse
import collections
import importlib
import shutil
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source", type=Path)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--workers", default="1,4,16")
    args = parser.parse_args()
    totals: dict[str, float] = collections.defaultdict(float)
    lock = threading.Lock()

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                with lock:
                    totals[label] += time.perf_counter() - started
        setattr(owner, name, wrapper)

    reader = importlib.import_module("moeconv.checkpoint.reader")
    writer = importlib.import_module("moeconv.checkpoint.writer")
    plan_module = importlib.import_module("moeconv.plan")
    convert = importlib.import_module("moeconv.conversion")
    timed(reader.TensorReader, "_read", "pread")
    timed(reader, "fingerprint", "source fingerprint (sha256)")
    timed(writer.ShardWriter, "write", "pwrite")
    timed(writer.ShardWriter, "close", "close + fsync")
    timed(writer.BlockHasher, "finish", "waiting for the output digest")
    for job in (plan_module.ExpertJob, plan_module.LinearJob):
        timed(job, "convert", "read + transform")
    started = time.perf_counter()
    plan = plan_module.make_plan(args.source, backend=args.backend)
    print(f"plan {time.perf_counter() - started:.2f} s; transcoder {plan.summary()['transcoder']}")
    output = args.source.parent / "profile-out"
    for workers in map(int, args.workers.split(",")):
        totals.clear()
        shutil.rmtree(output, ignore_errors=True)
        started = time.perf_counter()
        convert.convert(plan, output, workers=workers)
        print(f"workers {workers}: {time.perf_counter() - started:.2f} s wall; " +
              ", ".join(f"{label} {seconds:.2f}" for label, seconds in sorted(totals.items(), key=lambda t: -t[1])),
              flush=True)
    shutil.rmtree(output, ignore_errors=True)


if __name__ == "__main__":
    main()
