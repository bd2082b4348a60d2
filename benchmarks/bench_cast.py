"""`convert --cast` throughput against writing the same bytes (issue 41: a BF16 output is 4x its MXFP4 input,
fp8-block about 2x, nvfp4 about the same).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cast.py [--size-gb 1] [--workdir bench-cast] [--workers 2]

Builds a synthetic compressed-tensors MXFP4 Qwen3-MoE source (Qwen3-30B-A3B-like experts: H = 2048, I = 768,
64 experts a layer; codes at random, scale bytes 122 .. 127, so every block of each cast is exact), then for
each cast runs `moeconv convert --cast` (a separate process, the census and the write) and, beside it, a plain
write of as many bytes as the output holds (one file, written in 64 MiB pieces, fsync'd: what any tool writing
that output pays at least). The source is read from the page cache after the first pass. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "float" / "ct-mxfp4a16"
H, I, EXPERTS = 2048, 768, 64


def write_safetensors(path: Path, tensors: dict) -> None:
    """name -> (safetensors dtype, array), laid out by hand (8-byte length, JSON header, data)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, array) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        for _, array in tensors.values():
            handle.write(np.ascontiguousarray(array).tobytes())


def make_source(folder: Path, size_gb: float) -> Path:
    per_layer = 3 * EXPERTS * H * I * (0.5 + 1 / 32)
    layers = max(1, round(size_gb * 1e9 / per_layer))
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(hidden_size=H, moe_intermediate_size=I, intermediate_size=I, num_local_experts=EXPERTS,
                  num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=1024)
    bf16 = lambda shape: ("BF16", (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16))  # noqa: E731
    weight_map = {}
    for layer in range(layers):
        at, tensors = f"model.layers.{layer}", {}
        if layer == 0:
            tensors.update({"model.embed_tokens.weight": bf16((1024, H)), "lm_head.weight": bf16((1024, H)),
                            "model.norm.weight": bf16((H,))})
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{at}.{name}.weight"] = bf16((H,))
        for name in ("q_norm", "k_norm"):
            tensors[f"{at}.self_attn.{name}.weight"] = bf16((128,))
        tensors[f"{at}.mlp.gate.weight"] = bf16((EXPERTS, H))
        linears = [(f"{at}.self_attn.{name}", n, k) for name, n, k in
                   (("q_proj", 2048, H), ("k_proj", 512, H), ("v_proj", 512, H), ("o_proj", H, 2048))]
        linears += [(f"{at}.mlp.experts.{e}.{name}", n, k) for e in range(EXPERTS)
                    for name, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I))]
        for prefix, n, k in linears:
            tensors[f"{prefix}.weight_packed"] = ("U8", rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
            tensors[f"{prefix}.weight_scale"] = ("U8", rng.integers(122, 128, (n, k // 32), dtype=np.uint8))
        shard = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        write_safetensors(folder / shard, tensors)
        weight_map.update(dict.fromkeys(tensors, shard))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def flushed_write(path: Path, nbytes: int) -> float:
    piece = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    started = time.perf_counter()
    with open(path, "wb") as handle:
        left = nbytes
        while left > 0:
            left -= handle.write(piece[:min(left, len(piece))])
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--workdir", type=Path, default=Path("bench-cast"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    source = make_source(args.workdir / "source", args.size_gb)
    source_bytes = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    subprocess.run(["cat", *map(str, source.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
    results = {"source_bytes": source_bytes, "workers": args.workers, "casts": {}}
    for cast in ("bf16", "fp8-block", "nvfp4"):
        out = args.workdir / cast
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "moeconv", "convert", str(source), "-o", str(out), "--cast", cast,
                               "--workers", str(args.workers), "--json", "-q"], capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode:
            sys.exit(done.stderr)
        output_bytes = sum(path.stat().st_size for path in out.glob("*.safetensors"))
        shutil.rmtree(out)
        write_seconds = flushed_write(args.workdir / "flushed", output_bytes)
        results["casts"][cast] = {"seconds": round(seconds, 2), "output_bytes": output_bytes,
                                  "source_mb_per_s": round(source_bytes / seconds / 1e6, 1),
                                  "flushed_write_seconds": round(write_seconds, 2),
                                  "ratio_to_flushed_write": round(seconds / write_seconds, 2)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
