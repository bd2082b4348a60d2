"""`convert --executor ray` against the local executor on one machine: what Ray costs per task and per GB.

    python benchmarks/bench_ray.py [--source DIR | --size-gb 1] [--shard-mb 128] [--cpus 1,2] [--json out.json]

In one process: a local Ray is started once per CPU count (`ray.init(num_cpus=N)`, timed on its own),
then the same conversion runs on it (one task per output shard of at most `--shard-mb`) and on the
local executor with N worker processes, alternating; each row gives both conversions' times (as
`convert` reports them) and the outputs' identity. The per-task overhead is measured with empty tasks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import ray

from moeconv.api import plan as make_plan
from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint


def _digests(folder: Path) -> dict:
    return json.loads((folder / "moeconv.json").read_text())["files"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="a checkpoint (default: a synthetic GPTQ one of --size-gb)")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--workdir", type=Path, default=Path("bench-data"))
    parser.add_argument("--shard-mb", type=int, default=128)
    parser.add_argument("--cpus", default="1,2", help="comma-separated CPU counts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint, one repeat, one CPU")
    args = parser.parse_args()
    convert = importlib.import_module("moeconv.conversion").convert
    source = args.source
    if source is None:
        hidden, intermediate, experts = (256, 128, 8) if args.smoke else (2048, 768, 128)
        layers = 2 if args.smoke else max(1, round(args.size_gb * 1e9 / (experts * 3 * hidden * intermediate / 2 * 1.07)))
        source = args.workdir / f"qwen3-like-gptq-{layers}L-{experts}E-{hidden}H"
        if not (source / "model.safetensors.index.json").is_file():
            make_checkpoint(source, SynthSpec(architecture="qwen3_moe", source_format=GPTQ(4, 128, sym=False),
                                              layers=layers, experts=experts, hidden=hidden,
                                              intermediate=intermediate, vocab=256 if args.smoke else 4096))
    if args.smoke:
        args.repeats, args.cpus, args.shard_mb = 1, "1", 1
    plan = make_plan(source, max_shard_size=args.shard_mb * 10**6)
    size = plan.checkpoint.total_bytes
    results = []
    for cpus in [int(c) for c in args.cpus.split(",")]:
        started = time.perf_counter()
        ray.init(num_cpus=cpus, object_store_memory=256 * 2**20, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
        init_s = time.perf_counter() - started
        empty = ray.remote(num_cpus=1)(lambda: None)
        ray.get([empty.remote() for _ in range(20)])  # workers up
        started = time.perf_counter()
        ray.get([empty.remote() for _ in range(200)])
        task_ms = (time.perf_counter() - started) / 200 * 1e3
        times: dict[str, list[float]] = {"local": [], "ray": []}
        identical = True
        for _ in range(args.repeats):
            for executor in ("local", "ray"):
                out = args.workdir / f"bench-ray-{executor}"
                shutil.rmtree(out, ignore_errors=True)
                report = convert(plan, out, workers=cpus, executor=executor)
                times[executor].append(report.seconds)
            identical &= _digests(args.workdir / "bench-ray-local") == _digests(args.workdir / "bench-ray-ray")
        ray.shutdown()
        for executor in ("local", "ray"):
            shutil.rmtree(args.workdir / f"bench-ray-{executor}", ignore_errors=True)
        local_s, ray_s = statistics.median(times["local"]), statistics.median(times["ray"])
        row = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, Python {platform.python_version()}",
               "source_bytes": size, "shards": len(plan.shards), "cpus": cpus, "ray_init_seconds": round(init_s, 2),
               "ray_task_ms": round(task_ms, 2), "local_seconds": round(local_s, 3), "ray_seconds": round(ray_s, 3),
               "ray_to_local": round(ray_s / local_s, 2), "identical": identical, "runs": times}
        results.append(row)
        print(f"| {row['date']} | {size / 1e9:.2f} GB, {len(plan.shards)} shards | {cpus} | init {init_s:.1f} s | "
              f"{task_ms:.2f} ms/task | local {local_s:.2f} s | ray {ray_s:.2f} s ({row['ray_to_local']}x) | "
              f"identical {identical} |", flush=True)
        if not identical:
            sys.exit("the Ray output differs from the local one")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
