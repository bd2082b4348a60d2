"""`convert --cast` throughput against writing the same bytes (issue 41: a BF16 output is 4x its MXFP4 input,
fp8-block about 2x, nvfp4 about the same).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cast.py [--size-gb 1] [--workdir bench-cast] [--workers 2]
                                                          [--family qwen3-moe|gpt-oss]

Builds a synthetic compressed-tensors MXFP4 Qwen3-MoE source (Qwen3-30B-A3B-like experts: H = 2048, I = 768,
64 experts a layer; codes at random, scale bytes 122 .. 127, so every block of each cast is exact), then for
each cast runs `moeconv convert --cast` (a separate process, the census and the write) and, beside it, a plain
write of as many bytes as the output holds (one file, written in 64 MiB pieces, fsync'd: what any tool writing
that output pays at least). The source is read from the page cache after the first pass. Prints JSON.

`--family gpt-oss`: a gpt-oss MXFP4 source instead (gpt-oss-20b's shapes: H = I = 2880, 32 experts a layer, 64
query and 8 key/value heads of 64; experts stacked per layer as gpt-oss stores them, `gate_up_proj_blocks
[E, 2I, H/32, 16]` with gate and up interleaved, `*_scales`, BF16 `*_bias`; docs/FLOAT_SOURCES.md section 5),
scale bytes 118 .. 126, and only the cast that takes it (bf16: gpt-oss's own stacked BF16 form).
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
GPT_OSS_FIXTURE = ROOT / "tests" / "data" / "float" / "gptoss-mxfp4-bytes"
H, I, EXPERTS = 2048, 768, 64
GPT_OSS = {"hidden": 2880, "intermediate": 2880, "experts": 32, "heads": 64, "kv_heads": 8, "head_dim": 64}


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
    layers = max(1, round(size_gb * 1e9 / (3 * EXPERTS * H * I * (0.5 + 1 / 32))))

    def layer_tensors(at: str, bf16, rng) -> dict:
        tensors = {f"{at}.self_attn.{name}.weight": bf16((128,)) for name in ("q_norm", "k_norm")}
        tensors[f"{at}.mlp.gate.weight"] = bf16((EXPERTS, H))
        linears = [(f"{at}.self_attn.{name}", n, k) for name, n, k in
                   (("q_proj", 2048, H), ("k_proj", 512, H), ("v_proj", 512, H), ("o_proj", H, 2048))]
        linears += [(f"{at}.mlp.experts.{e}.{name}", n, k) for e in range(EXPERTS)
                    for name, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I))]
        for prefix, n, k in linears:
            tensors[f"{prefix}.weight_packed"] = ("U8", rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
            tensors[f"{prefix}.weight_scale"] = ("U8", rng.integers(122, 128, (n, k // 32), dtype=np.uint8))
        return tensors

    return _write_source(folder, FIXTURE, {"hidden_size": H, "moe_intermediate_size": I, "intermediate_size": I,
                                           "num_local_experts": EXPERTS, "num_attention_heads": 16,
                                           "num_key_value_heads": 4, "head_dim": 128}, layers, H, layer_tensors)


def make_gpt_oss_source(folder: Path, size_gb: float) -> Path:
    h, i, experts = GPT_OSS["hidden"], GPT_OSS["intermediate"], GPT_OSS["experts"]
    q, kv = GPT_OSS["heads"] * GPT_OSS["head_dim"], GPT_OSS["kv_heads"] * GPT_OSS["head_dim"]
    layers = max(1, round(size_gb * 1e9 / (3 * experts * h * i * (0.5 + 1 / 32))))

    def layer_tensors(at: str, bf16, rng) -> dict:
        tensors = {}
        for name, n, k in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            tensors[f"{at}.self_attn.{name}.weight"], tensors[f"{at}.self_attn.{name}.bias"] = bf16((n, k)), bf16((n,))
        tensors[f"{at}.self_attn.sinks"] = bf16((GPT_OSS["heads"],))
        tensors[f"{at}.mlp.router.weight"], tensors[f"{at}.mlp.router.bias"] = bf16((experts, h)), bf16((experts,))
        for name, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            tensors[f"{at}.mlp.experts.{name}_blocks"] = ("U8", rng.integers(0, 256, (experts, n, k // 32, 16),
                                                                                dtype=np.uint8))
            tensors[f"{at}.mlp.experts.{name}_scales"] = ("U8", rng.integers(118, 127, (experts, n, k // 32),
                                                                                dtype=np.uint8))
            tensors[f"{at}.mlp.experts.{name}_bias"] = bf16((experts, n))
        return tensors

    return _write_source(folder, GPT_OSS_FIXTURE, {
        "hidden_size": h, "intermediate_size": i, "num_local_experts": experts, "num_experts_per_tok": 4,
        "num_attention_heads": GPT_OSS["heads"], "num_key_value_heads": GPT_OSS["kv_heads"],
        "head_dim": GPT_OSS["head_dim"],
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)},
        layers, h, layer_tensors)


def _write_source(folder: Path, fixture: Path, sizes: dict, layers: int, hidden: int, layer_tensors) -> Path:
    """A synthetic source of `layers` layers, one shard each, its config the fixture's with `sizes`: the embeddings
    and norms every family has, and `layer_tensors(prefix, bf16, rng)`'s tensors in each layer. Kept if there."""
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    config = {**json.loads((fixture / "config.json").read_text()), **sizes, "num_hidden_layers": layers,
              "vocab_size": 1024}
    bf16 = lambda shape: ("BF16", (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16))  # noqa: E731
    weight_map = {}
    for layer in range(layers):
        at, tensors = f"model.layers.{layer}", {}
        if layer == 0:
            tensors.update({"model.embed_tokens.weight": bf16((1024, hidden)), "lm_head.weight": bf16((1024, hidden)),
                            "model.norm.weight": bf16((hidden,))})
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{at}.{name}.weight"] = bf16((hidden,))
        tensors.update(layer_tensors(at, bf16, rng))
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
    parser.add_argument("--family", choices=("qwen3-moe", "gpt-oss"), default="qwen3-moe")
    args = parser.parse_args()
    gpt_oss = args.family == "gpt-oss"
    source = (make_gpt_oss_source if gpt_oss else make_source)(args.workdir / f"source-{args.family}", args.size_gb)
    source_bytes = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    subprocess.run(["cat", *map(str, source.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
    results = {"family": args.family, "source_bytes": source_bytes, "workers": args.workers, "casts": {}}
    for cast in ("bf16",) if gpt_oss else ("bf16", "fp8-block", "nvfp4"):
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
