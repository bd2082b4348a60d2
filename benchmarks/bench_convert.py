"""Conversion throughput and peak memory against a plain copy of the same files, in the same run.

    python benchmarks/bench_convert.py [--size-gb 3] [--workdir bench-data] [--json out.json]
        [--format gptq|awq] [--backends triton,humming] [--workers 1,2,4] [--source CKPT] [--verify]

Builds (or reuses) a synthetic GPTQ checkpoint with realistic expert sizes (Qwen3-30B-A3B-like:
H = 2048, I = 768, 128 experts per layer, 4-bit, g = 128, asymmetric v1), then alternates
`cp -r` + `sync` and `moeconv convert` several times, each a separate process, and reports the median
time, GB/s, the ratio convert/copy, moeconv's peak RSS (VmHWM, which it reports itself) and the peak
PSS of its whole process tree (the parent and its workers, as it reports it), for each backend and
worker count asked for. `convert_seconds` is the whole process (Python and torch
start-up, planning, conversion); `conversion_seconds` is what moeconv reports for the conversion
itself (from the output folder's creation to its rename). Both read the
source from the page cache after the first warm-up pass, so the ratio compares the work, not the
disk's cold-read speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moeconv.formats import AWQ, GPTQ
from moeconv.synth import SynthSpec, make_checkpoint


def timed(command: list[str]) -> tuple[float, dict]:
    """(seconds, moeconv's --json report or {}) of one child process, the report with `cpu_seconds`
    added: the child's and every process below it that it waited for (getrusage; verify reports no tree
    CPU of its own). moeconv reports its own peak RSS (VmHWM, counted from exec); a child's wait4 maxrss
    would include this process's pages."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{command} failed")
    report = json.loads(done.stdout) if "--json" in command else {}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, {**report, "cpu_seconds": round(cpu, 2)}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=3.0, help="approximate source size")
    parser.add_argument("--workdir", type=Path, default=Path("bench-data"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint, one repeat (checks the script runs)")
    parser.add_argument("--format", choices=("gptq", "awq"), default="gptq")
    parser.add_argument("--backends", default="triton", help="comma-separated")
    parser.add_argument("--workers", default="", help="comma-separated worker counts (default: moeconv's own)")
    parser.add_argument("--source", type=Path, help="an existing checkpoint instead of a synthetic one "
                                                    "(e.g. one grown by benchmarks/grow_checkpoint.py)")
    parser.add_argument("--verify", action="store_true",
                        help="also time `verify --level lossless` of each backend's last output (whole process)")
    args = parser.parse_args()

    hidden, intermediate, experts = (256, 128, 8) if args.smoke else (2048, 768, 128)
    if args.smoke:
        args.repeats = 1
    layer_bytes = experts * 3 * hidden * intermediate // 2 * 1.07  # 4-bit codes + scales/zeros, roughly
    layers = 2 if args.smoke else max(1, round(args.size_gb * 1e9 / layer_bytes))
    source_format = GPTQ(bits=4, group_size=128, sym=False) if args.format == "gptq" else AWQ(4, 128)
    spec = SynthSpec(architecture="qwen3_moe", source_format=source_format,
                     layers=layers, experts=experts, hidden=hidden, intermediate=intermediate,
                     vocab=256 if args.smoke else 4096)
    source = args.source or args.workdir / f"qwen3-like-{args.format}-{layers}L-{experts}E-{hidden}H"
    label = args.format
    if args.source:
        source_config = json.loads((source / "config.json").read_text())
        layers = source_config["num_hidden_layers"]
        quantization = source_config.get("quantization_config") or {}
        label = quantization.get("format") or quantization.get("quant_method") or "unquantized"  # what --source is
    elif not (source / "model.safetensors.index.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        started = time.perf_counter()
        make_checkpoint(source, spec)
        print(f"built {source} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    size = folder_bytes(source)
    args.workdir.mkdir(parents=True, exist_ok=True)  # with --source, nothing else makes it
    moeconv = [sys.executable, "-m", "moeconv"]
    # -L: a Hub cache snapshot's files are links to its blobs (benchmarks/hub_cache.py); the copy copies the bytes
    copy = ["sh", "-c", f'cp -rL "{source}" "{args.workdir / "copy"}" && sync "{args.workdir / "copy"}"/*']
    results = []
    for backend in args.backends.split(","):
        for workers in [int(w) for w in args.workers.split(",") if w] or [None]:
            command = [*moeconv, "convert", str(source), "-o", str(args.workdir / "converted"), "-q", "--json",
                       "--backend", backend, *(["--workers", str(workers)] if workers else [])]
            copies, converts = [], []
            for _ in range(args.repeats):
                # moeconv fsyncs what it writes (a finished shard must survive a power loss, for resume),
                # so the copy is flushed to disk too: `sync FILE...` fsyncs the copied files.
                for runs, run in ((copies, copy), (converts, command)):
                    for earlier in ("copy", "converted"):  # the disk may hold the source and one of them only
                        shutil.rmtree(args.workdir / earlier, ignore_errors=True)
                    runs.append(timed(run))
            verified = timed([*moeconv, "verify", str(args.workdir / "converted"), "--level", "lossless", "-q",
                              "--json"]) if args.verify else None
            for target in ("copy", "converted"):
                shutil.rmtree(args.workdir / target, ignore_errors=True)
            copy_s = statistics.median(t for t, _ in copies)
            convert_s = statistics.median(t for t, _ in converts)
            conversion_s = statistics.median(report["seconds"] for _, report in converts)
            result = {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                "format": label, "backend": backend, "workers": workers, "device": converts[0][1]["device"],
                "source_bytes": size, "layers": layers, "experts": experts,
                "copy_seconds": round(copy_s, 3), "convert_seconds": round(convert_s, 3),
                "conversion_seconds": round(conversion_s, 3),
                "conversion_ratio_to_copy": round(conversion_s / copy_s, 2),
                "copy_gb_per_s": round(size / copy_s / 1e9, 3), "convert_gb_per_s": round(size / convert_s / 1e9, 3),
                "ratio_convert_to_copy": round(convert_s / copy_s, 2),
                "convert_peak_rss_mb": round(max(report["peak_rss_mb"] for _, report in converts)),
                "tree_peak_pss_mb": max((report["tree_peak_pss_mb"] for _, report in converts
                                         if report["tree_peak_pss_mb"] is not None), default=None),
                "tree_cpu_seconds": [report["tree_cpu_seconds"] for _, report in converts],
                "cpu_seconds": [report["cpu_seconds"] for _, report in converts],
                "runs": {"copy": [t for t, _ in copies], "convert": [t for t, _ in converts],
                         "conversion": [report["seconds"] for _, report in converts]},
            }
            if verified:
                result["verify_seconds"] = round(verified[0], 3)
                result["verify_ok"] = verified[1]["ok"]
                result["verify_phase_seconds"] = verified[1]["phase_seconds"]
                result["verify_cpu_seconds"] = verified[1]["cpu_seconds"]
                result["verify_provenance"] = verified[1].get("provenance")
                result["verify_ratio_to_conversion"] = round(verified[0] / conversion_s, 2)
            results.append(result)
            print(f"| {result['date']} | {label} {size / 1e9:.2f} GB, {layers} layers x {experts} experts | "
                  f"{backend} | {workers or 'default'} | {result['device']} | copy {copy_s:.2f} s "
                  f"({result['copy_gb_per_s']} GB/s) | convert {convert_s:.2f} s ({result['convert_gb_per_s']} GB/s) | "
                  f"{result['ratio_convert_to_copy']}x | conversion {conversion_s:.2f} s "
                  f"({result['conversion_ratio_to_copy']}x) | {result['convert_peak_rss_mb']} MB | "
                  f"tree {result['tree_peak_pss_mb']} MB |"
                  + (f" verify {verified[0]:.2f} s ({result['verify_ratio_to_conversion']}x conversion, "
                     f"{verified[1]['cpu_seconds']} CPU s) |"
                     if verified else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
