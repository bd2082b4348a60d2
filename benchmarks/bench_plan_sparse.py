"""`convert --dry-run` of a checkpoint the size of Kimi-K3 (1.56 TB in 96 shards), written as headers only.

The tensors' names, shapes and dtypes are a real-width synthetic checkpoint's (kimi_k2: DeepSeek-V3 names,
MLA attention, compressed-tensors W4A16 g32 symmetric, hidden 7168, routed experts of intermediate
`--intermediate`), replicated to `--layers` layers of `--experts` experts and cut into `--shards` shards;
each shard is its header followed by a hole (a sparse file: `truncate` to the declared size), so the disk
holds megabytes while the headers declare the whole checkpoint. The few tensors detection reads are zeros.
Reports the declared bytes, the time to open (every header parsed and checked) and to plan, the peak memory
of the `moeconv convert --dry-run` process (its own RSS, from /usr/bin/time's format or getrusage).

    .venv/bin/python benchmarks/bench_plan_sparse.py [--layers 61] [--experts 384] [--intermediate 5632]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeconv.formats import CompressedTensors  # noqa: E402
from moeconv.synth import SynthSpec, make_checkpoint  # noqa: E402

SIZES = {"I32": 4, "F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "I64": 8}


def template_entries(folder: Path) -> tuple[dict[str, tuple[str, list[int]]], dict]:
    entries = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as handle:
            length = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(length))
        entries.update({name: (info["dtype"], info["shape"]) for name, info in header.items()
                        if name != "__metadata__"})
    return entries, json.loads((folder / "config.json").read_text())


def write_sparse(target: Path, entries: dict, config: dict, layers: int, experts: int, shards: int) -> int:
    names: dict[str, tuple[str, list[int]]] = {}
    for name, entry in entries.items():
        match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if match is None:
            names[name] = entry
            continue
        layer, rest = int(match.group(1)), match.group(2)
        expert = re.match(r"mlp\.experts\.(\d+)\.(.*)", rest)
        for target_layer in [0] if layer == 0 else range(1, layers):
            if expert is None:
                names[f"model.layers.{target_layer}.{rest}"] = entry
            elif expert.group(1) == "0":
                for e in range(experts):
                    names[f"model.layers.{target_layer}.mlp.experts.{e}.{expert.group(2)}"] = entry
    ordered = list(names)
    per_shard = -(-len(ordered) // shards)
    weight_map, declared = {}, 0
    for index in range(shards):
        file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in ordered[index * per_shard:(index + 1) * per_shard]:
            dtype, shape = names[name]
            size = SIZES[dtype]
            for dim in shape:
                size *= dim
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file_name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(target / file_name, "wb") as handle:
            handle.write(struct.pack("<Q", len(raw)) + raw)
            handle.truncate(8 + len(raw) + offset)  # the data: a hole
        declared += 8 + len(raw) + offset
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers,
                                                    "n_routed_experts": experts}))
    return declared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--shards", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--smoke", action="store_true", help="3 layers of 4 small experts: the test suite's run")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.experts, args.intermediate, args.hidden, args.shards = 3, 4, 256, 512, 4
    work = Path(tempfile.mkdtemp(prefix="moeconv-bench-sparse-", dir=args.work))
    started = time.perf_counter()
    template = make_checkpoint(work / "template", SynthSpec(
        architecture="kimi_k2", layers=2, dense_layers=1, experts=1, hidden=args.hidden, intermediate=args.intermediate,
        dense_intermediate=256, vocab=256, source_format=CompressedTensors(bits=4, group_size=32, symmetric=True)))
    entries, config = template_entries(template)
    (work / "k3").mkdir()
    declared = write_sparse(work / "k3", entries, config, args.layers, args.experts, args.shards)
    built = time.perf_counter() - started
    on_disk = sum(os.stat(path).st_blocks * 512 for path in (work / "k3").iterdir())
    command = [sys.executable, "-c", "import resource, sys, time; from moeconv.cli import main; "
               "t = time.perf_counter(); sys.argv = ['moeconv'] + sys.argv[1:]\n"
               "try:\n    main()\nfinally:\n    print(json.dumps({'seconds': time.perf_counter() - t, "
               "'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), file=sys.stderr)",
               "convert", str(work / "k3"), "--dry-run", "--json"]
    command[2] = "import json\n" + command[2]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    measured = json.loads(result.stderr.strip().splitlines()[-1])
    plan = json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr[-1000:]}
    result = {"shards": args.shards, "tensors": len(json.loads(
        (work / "k3" / "model.safetensors.index.json").read_text())["weight_map"]),
        "declared_bytes": declared, "declared_TB": round(declared / 1e12, 3), "on_disk_MB": round(on_disk / 1e6, 1),
        "build_seconds": round(built, 1), "dry_run_seconds": round(measured["seconds"], 2),
        "dry_run_peak_rss_mb": measured["peak_rss_mb"], "exit": result.returncode,
        "plan": {key: plan.get(key) for key in ("backend", "format", "moe_layers", "output_bytes", "error")
                 if key in plan}}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")
    if result["exit"]:
        raise SystemExit(plan.get("error", "the dry run failed"))


if __name__ == "__main__":
    main()
