"""Planning time for a checkpoint with Kimi-K2's tensor count, from headers (and detection's small sample).

A header-set of Kimi-K2's shape: `kimi_k2` (DeepSeek-V3) names, 61 layers of which the first is dense,
384 routed experts per MoE layer, a shared expert, MLA attention, compressed-tensors W4A16 g32 symmetric
(as Kimi-K2 ships), about 209k tensors. The tensors are tiny (hidden 64, expert intermediate 32): the
names, counts and header sizes are what planning sees; their values are a small synthetic checkpoint's,
repeated. Reports the time to open (parse and validate every header) and to plan, and peak RSS.

    .venv/bin/python benchmarks/bench_plan.py [--layers 61] [--experts 384] [--backend triton] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--smoke", action="store_true", help="3 layers x 8 experts: the test suite's run")
    args = parser.parse_args()
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
