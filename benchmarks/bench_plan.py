"""Planning time for a checkpoint with Kimi-K2's tensor count, from headers (and detection's small sample).

A header-set of Kimi-K2's shape: `kimi_k2` (DeepSeek-V3) names, 61 layers of which the first is dense,
384 routed experts per MoE layer, a shared expert, MLA attention, compressed-tensors W4A16 g32 symmetric
(as Kimi-K2 ships), about 209k tensors. The tensors are tiny (hidden 64, expert intermediate 32): the
names, counts and header sizes are what planning sees; their values are a small synthetic checkpoint's,
repeated. Reports the time to open (parse and validate every header) and to plan, and peak RSS.

    .venv/bin/python benchmarks/bench_plan.py [--layers 61] [--experts 384] [--backend triton] [--json OUT]

`--declared` (issue 43): instead, an index of Kimi-K3's size (96 shards, about 1.5 TB and 495k tensors, as
llama.cpp#26185 describes the release: compressed-tensors `mxfp4-pack-quantized`) with real tensor shapes
and no data: each shard is its safetensors header followed by a hole (a sparse file as long as the header
says), so the disk holds only the headers. K3's own config is not public here: the shapes are Qwen3-MoE names
(60 layers, 1,376 experts of H = 7168, I = 1536, MXFP4 in the layout llm-compressor's MXFP4A16 preset writes,
the fixture `tests/data/float/ct-mxfp4a16`), chosen for its tensor count and bytes. Reports the same, plus
`moeconv convert --dry-run` as a user runs it: its whole process's time and the peak memory of its tree.

    .venv/bin/python benchmarks/bench_plan.py --declared [--layers 60] [--experts 1376] [--shards 96]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from moeconv.checkpoint.reader import open_checkpoint
from moeconv.formats import CompressedTensors
from moeconv.plan import make_plan
from moeconv.synth import SynthSpec, make_checkpoint

TENSORS_PER_SHARD = 4000


def make_header_set(path: Path, layers: int, experts: int) -> int:
    """Writes the header-set; returns its tensor count."""
    template = make_checkpoint(path / "template", SynthSpec(
        architecture="kimi_k2", layers=2, dense_layers=1, experts=2, hidden=64, intermediate=32,
        dense_intermediate=64, source_format=CompressedTensors(bits=4, group_size=32, symmetric=True)))
    tensors = {}
    for shard in template.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    config = json.loads((template / "config.json").read_text())
    config.update(num_hidden_layers=layers, n_routed_experts=experts)
    out = path / "kimi"
    out.mkdir()
    names: dict[str, object] = {}
    for name, value in tensors.items():
        match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if match is None:
            names[name] = value
            continue
        layer, rest = int(match.group(1)), match.group(2)
        targets = [0] if layer == 0 else range(1, layers)
        expert = re.match(r"mlp\.experts\.(\d+)\.(.*)", rest)
        for target in targets:
            if expert is None:
                names[f"model.layers.{target}.{rest}"] = value
            elif expert.group(1) == "0":
                for e in range(experts):
                    names[f"model.layers.{target}.mlp.experts.{e}.{expert.group(2)}"] = value
    ordered = list(names)
    weight_map = {}
    count = -(-len(ordered) // TENSORS_PER_SHARD)
    for index in range(count):
        file_name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        chunk = ordered[index * TENSORS_PER_SHARD:(index + 1) * TENSORS_PER_SHARD]
        # every tensor its own storage: safetensors refuses shared ones
        save_file({name: names[name].clone() for name in chunk}, str(out / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in chunk})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    return len(ordered)


FLOAT_FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "data" / "float" / "ct-mxfp4a16"


def declared_tensors(layers: int, experts: int, hidden: int, intermediate: int,
                     vocab: int = 163840) -> dict[str, tuple[str, list[int]]]:
    """Name -> (safetensors dtype, shape) of a Qwen3-MoE checkpoint in compressed-tensors MXFP4 (every Linear
    but the routers and lm_head: weight_packed U8 (N, K/2), weight_scale U8 (N, K/32))."""
    heads, kv_heads, head_dim = 64, 8, 128
    tensors = {"model.embed_tokens.weight": ("BF16", [vocab, hidden]), "model.norm.weight": ("BF16", [hidden]),
               "lm_head.weight": ("BF16", [vocab, hidden])}

    def mxfp4(name: str, n: int, k: int) -> None:
        tensors[f"{name}.weight_packed"] = ("U8", [n, k // 2])
        tensors[f"{name}.weight_scale"] = ("U8", [n, k // 32])

    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = ("BF16", [hidden])
        for norm in ("q_norm", "k_norm"):
            tensors[f"{prefix}.self_attn.{norm}.weight"] = ("BF16", [head_dim])
        tensors[f"{prefix}.mlp.gate.weight"] = ("BF16", [experts, hidden])
        for proj, (n, k) in {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
                             "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}.items():
            mxfp4(f"{prefix}.self_attn.{proj}", n, k)
        for expert in range(experts):
            for proj, (n, k) in {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                                 "down_proj": (hidden, intermediate)}.items():
                mxfp4(f"{prefix}.mlp.experts.{expert}.{proj}", n, k)
    return tensors


def _nbytes(dtype: str, shape: list[int]) -> int:
    size = {"U8": 1, "BF16": 2}[dtype]
    for dim in shape:
        size *= dim
    return size


def make_declared_set(path: Path, layers: int, experts: int, hidden: int, intermediate: int, shards: int) -> tuple[int, int]:
    """Writes the header-only checkpoint (sparse shards); returns (tensor count, declared bytes)."""
    tensors = declared_tensors(layers, experts, hidden, intermediate)
    total = sum(_nbytes(*spec) for spec in tensors.values())
    path.mkdir(parents=True)
    names, weight_map, start = list(tensors), {}, 0
    for index in range(shards):  # consecutive runs of about total / shards bytes
        file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        header, offset, stop = {"__metadata__": {"format": "pt"}}, 0, start
        while stop < len(names) and (offset < total / shards or index == shards - 1):
            dtype, shape = tensors[names[stop]]
            size = _nbytes(dtype, shape)
            header[names[stop]] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            weight_map[names[stop]] = file_name
            offset, stop = offset + size, stop + 1
        start = stop
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(path / file_name, "wb") as shard:
            shard.write(len(encoded).to_bytes(8, "little") + encoded)
            shard.truncate(8 + len(encoded) + offset)  # the data: a hole
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = json.loads((FLOAT_FIXTURE / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", r"re:.*mlp\.gate$"]
    config.update(hidden_size=hidden, moe_intermediate_size=intermediate, intermediate_size=4 * intermediate,
                  num_hidden_layers=layers, num_experts=experts, num_local_experts=experts, num_experts_per_tok=8,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=163840)
    (path / "config.json").write_text(json.dumps(config))
    return len(tensors), total


def declared(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="moeconv-bench-plan-", dir=args.workdir) as scratch:
        source = Path(scratch) / "k3-sized"
        started = time.perf_counter()
        count, total = make_declared_set(source, args.layers, args.experts, args.hidden, args.intermediate, args.shards)
        written = time.perf_counter()
        checkpoint = open_checkpoint(source)
        opened = time.perf_counter()
        plan = make_plan(checkpoint, backend="compressed-tensors")
        planned = time.perf_counter()
        on_disk = sum(file.stat().st_blocks * 512 for file in source.iterdir())
        tree = Path(scratch) / "tree.json"
        command = [sys.executable, str(Path(__file__).parent / "tree_memory.py"), "--json", str(tree), "--",
                   sys.executable, "-m", "moeconv", "convert", str(source), "-o", str(Path(scratch) / "out"),
                   "--backend", "compressed-tensors", "--dry-run"]
        whole = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        whole = time.perf_counter() - whole
        if done.returncode != 0:
            raise SystemExit(f"convert --dry-run failed: {done.stderr.strip().splitlines()[-1:]}")
        memory = json.loads(tree.read_text())
    return {"tensors": count, "declared_bytes": total, "shards": args.shards, "bytes_on_disk": on_disk,
            "layers": args.layers, "experts": args.experts, "write_headers_s": round(written - started, 2),
            "open_s": round(opened - written, 2), "plan_s": round(planned - opened, 2), "jobs": len(plan.jobs),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            "dry_run_process_s": round(whole, 2), "dry_run_tree": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--smoke", action="store_true", help="3 layers x 8 experts: the test suite's run")
    parser.add_argument("--declared", action="store_true", help="Kimi-K3-sized, real shapes, headers only (above)")
    parser.add_argument("--shards", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--workdir", default=None, help="where the header-only checkpoint goes (a temporary folder)")
    args = parser.parse_args()
    if args.declared:
        if args.smoke:
            args.layers, args.experts, args.shards = 2, 8, 3
        elif "--layers" not in sys.argv and "--experts" not in sys.argv:
            args.layers, args.experts = 60, 1376
        result = declared(args)
        print(f"{result['tensors']} tensors, {result['declared_bytes'] / 1e12:.2f} TB declared in {args.shards} shards "
              f"({result['bytes_on_disk'] / 1e6:.1f} MB on disk): open {result['open_s']} s, plan {result['plan_s']} s, "
              f"{result['jobs']} jobs, peak RSS {result['peak_rss_mb']} MB; convert --dry-run as a process "
              f"{result['dry_run_process_s']} s, {json.dumps(result['dry_run_tree'])}")
        if args.json:
            args.json.write_text(json.dumps(result) + "\n")
        return
    if args.smoke:
        args.layers, args.experts = 3, 8
    with tempfile.TemporaryDirectory(prefix="moeconv-bench-plan-") as scratch:
        count = make_header_set(Path(scratch), args.layers, args.experts)
        started = time.perf_counter()
        checkpoint = open_checkpoint(Path(scratch) / "kimi")
        opened = time.perf_counter()
        plan = make_plan(checkpoint, backend=args.backend)
        planned = time.perf_counter()
    result = {"tensors": count, "layers": args.layers, "experts": args.experts, "backend": args.backend,
              "open_s": round(opened - started, 2), "plan_s": round(planned - opened, 2),
              "jobs": len(plan.jobs), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    print(f"{count} tensors: open {result['open_s']} s, plan ({args.backend}) {result['plan_s']} s, "
          f"{result['jobs']} jobs, peak RSS {result['peak_rss_mb']} MB")
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
