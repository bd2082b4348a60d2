"""Where the CPU-seconds of `convert` and `verify --level lossless` go, one process, one worker (issue 42).

    python benchmarks/profile_cpu.py SRC --backends humming,triton [--workdir DIR] [--json out.json]

Each command runs in this process with `--workers 1` under cProfile (the main thread: planning, reading,
decoding, encoding, comparing, writing), beside `time.thread_time` of the main thread and the process's CPU
time, so the other threads' share (the digests, which hash in threads of their own) is the difference.
Functions are put in buckets by name (`BUCKETS`, cumulative time, so a bucket includes what it calls); the
rest of the main thread is "other" (imports, planning, the manifest). A source read from the page cache
(it is read once first), so the reads are copies from memory.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

BUCKETS = {  # bucket -> (file suffix, function name) pairs whose cumulative time it counts
    "unpack codes": [("moeconv/packing.py", "unpack_array")],
    "pack codes": [("moeconv/packing.py", "pack_array")],
    "read (pread into arrays)": [("moeconv/checkpoint/reader.py", "_bytes")],
    "write (pwrite)": [("~", "<built-in method posix.pwrite>")],
    "resume fingerprint (CRC-32)": [("~", "<built-in method zlib.crc32>")],
    "compare": [("numpy/_core/numeric.py", "array_equal")],
}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def profiled(argv: list[str]) -> dict[str, float]:
    from typer.main import get_command

    from moeconv.cli import app

    profile = cProfile.Profile()
    wall, cpu, main = time.perf_counter(), _cpu(), time.thread_time()
    profile.enable()
    try:
        get_command(app).main(argv, standalone_mode=False)
    finally:
        profile.disable()
    row = {"wall_s": time.perf_counter() - wall, "process_cpu_s": _cpu() - cpu, "main_thread_cpu_s": time.thread_time() - main}
    row["other_threads_cpu_s"] = row["process_cpu_s"] - row["main_thread_cpu_s"]
    stats = pstats.Stats(profile).stats
    for bucket, keys in BUCKETS.items():
        row[bucket] = sum(cumulative for (path, _, name), (_, _, _, cumulative, _) in stats.items()
                          if any(path.endswith(suffix) and name == fn for suffix, fn in keys))
    row["profiled_s"] = pstats.Stats(profile).total_tt
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("--backends", default="humming,triton,compressed-tensors")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for file in Path(args.source).iterdir():  # into the page cache
        file.read_bytes()
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    rows = []
    try:
        for backend in args.backends.split(","):
            out = work / backend
            convert = profiled(["convert", args.source, "-o", str(out), "--backend", backend, "--workers", "1", "-q"])
            verify = profiled(["verify", str(out), "--level", "lossless", "--workers", "1", "-q"])
            for command, row in (("convert", convert), ("verify", verify)):
                row.update(backend=backend, command=command, threads=threading.active_count())
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
