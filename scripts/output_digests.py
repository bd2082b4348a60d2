"""sha256 of every output file moeconv writes, for every backend on a matrix of synthetic checkpoints.

Used to prove a refactoring changes no output byte: run it on the old and the new code and compare
the two JSON files (`python scripts/output_digests.py OUT.json`, then `diff`). Everything is made
under one fixed folder, so the source paths recorded in the manifests are the same in both runs.
"""

from __future__ import annotations

import hashlib
import json
import sys
import shutil
from pathlib import Path

from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

FORMATS = {
    "gptq4-asym-v1": GPTQ(bits=4, group_size=32, sym=False),
    "gptq4-sym": GPTQ(bits=4, group_size=64, sym=True),
    "gptq8-asym-v2": GPTQ(bits=8, group_size=32, sym=False, checkpoint_format="gptq_v2"),
    "gptq4-channel": GPTQ(bits=4, group_size=-1, sym=False),
    "awq4": AWQ(bits=4, group_size=32),
    "ct-w4a16-asym": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w4a16-sym": CompressedTensors(bits=4, group_size=64, symmetric=True),
    "ct-w8a8": CompressedTensors(bits=8, group_size=-1, symmetric=True, activation_bits=8, format="int-quantized"),
}
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
BACKENDS = ("triton", "humming", "cpu", "compressed-tensors")


def digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def main(out: str) -> None:
    from moeconv.conversion import convert
    from moeconv.plan import make_plan

    results: dict[str, object] = {}
    work = Path("/tmp/moeconv-output-digests")
    shutil.rmtree(work, ignore_errors=True)
    for label, fmt in FORMATS.items():
        for arch in ARCHITECTURES:
            source = make_checkpoint(work / f"{label}-{arch}", SynthSpec(
                architecture=arch, source_format=fmt, dense_layers=1 if arch == "deepseek_v3" else 0,
                hidden=256, intermediate=128), max_shard_size=300_000)
            for backend in BACKENDS:
                key = f"{label}/{arch}/{backend}"
                try:
                    plan = make_plan(source, backend=backend, regroup=True, max_shard_size=400_000)
                except MoeconvError as error:
                    results[key] = f"refused: {error}"
                    continue
                output = work / f"out-{label}-{arch}-{backend}"
                convert(plan, output)
                results[key] = digests(output)
                print(key, "ok", flush=True)
    shutil.rmtree(work)
    Path(out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
