"""A synthetic compressed-tensors MXFP4 MoE source of realistic expert sizes, for the conversion benchmark.

    python benchmarks/float_source.py TARGET [--layers 1] [--experts 128] [--hidden 2048] [--intermediate 768]

Writes a Qwen3-MoE checkpoint (Qwen3-30B-A3B-like shapes by default: H = 2048, I = 768, 128 experts, 32 query
and 4 key/value heads of 128) in the layout llm-compressor's MXFP4A16 preset writes (docs/FLOAT_SOURCES.md,
section 3; the fixture `tests/data/float/ct-mxfp4a16`): every Linear but the routers and `lm_head` as
`weight_packed` U8 (N, K/2) and `weight_scale` U8 (N, K/32), one linear per expert, the config's
`quantization_config` as that fixture's with these shapes. The codes are random bytes (all 16 E2M1 codes)
and the scale bytes random in 118..126 (2^-9 .. 2^-1, as real weights' are), not a quantized model: what
the converter and verify do per byte does not depend on the values. One layer is quick to write; grow it
to the benchmark's size with `benchmarks/grow_checkpoint.py`, which repeats its bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "data" / "float" / "ct-mxfp4a16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    h, i, heads, kv_heads, head_dim = args.hidden, args.intermediate, 32, 4, 128

    def bf16(*shape: int) -> np.ndarray:  # bf16 bits of N(0, 0.02): the top half of float32's
        return (rng.normal(0, 0.02, shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def mxfp4(n: int, k: int) -> dict[str, np.ndarray]:
        return {"weight_packed": rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                "weight_scale": rng.integers(118, 127, (n, k // 32), dtype=np.uint8)}

    args.target.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0

    def shard(name: str, tensors: dict[str, np.ndarray], bf16_names: set[str]) -> None:
        nonlocal total
        # numpy has no bf16: its bits are held as uint16 and viewed as bf16 by torch
        save_file({tensor: torch.from_numpy(array).view(torch.bfloat16) if tensor in bf16_names
                   else torch.from_numpy(array) for tensor, array in tensors.items()}, args.target / name)
        for tensor, array in tensors.items():
            weight_map[tensor] = name
            total += array.nbytes

    count = args.layers + 1
    rest = {"model.embed_tokens.weight": bf16(args.vocab, h), "model.norm.weight": bf16(h),
            "lm_head.weight": bf16(args.vocab, h)}
    shard(f"model-00001-of-{count:05d}.safetensors", rest, set(rest))
    for layer in range(args.layers):
        prefix = f"model.layers.{layer}"
        tensors: dict[str, np.ndarray] = {}
        floats = {f"{prefix}.input_layernorm.weight": bf16(h), f"{prefix}.post_attention_layernorm.weight": bf16(h),
                  f"{prefix}.self_attn.q_norm.weight": bf16(head_dim),
                  f"{prefix}.self_attn.k_norm.weight": bf16(head_dim),
                  f"{prefix}.mlp.gate.weight": bf16(args.experts, h)}
        tensors.update(floats)
        for proj, (n, k) in {"q_proj": (heads * head_dim, h), "k_proj": (kv_heads * head_dim, h),
                             "v_proj": (kv_heads * head_dim, h), "o_proj": (h, heads * head_dim)}.items():
            tensors.update({f"{prefix}.self_attn.{proj}.{key}": value for key, value in mxfp4(n, k).items()})
        for expert in range(args.experts):
            for proj, (n, k) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
                tensors.update({f"{prefix}.mlp.experts.{expert}.{proj}.{key}": value
                                for key, value in mxfp4(n, k).items()})
        shard(f"model-{layer + 2:05d}-of-{count:05d}.safetensors", tensors, set(floats))
    (args.target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = json.loads((FIXTURE / "config.json").read_text())
    quantization = copy.deepcopy(config["quantization_config"])
    # every layer's router, as a pattern, so that the config holds after grow_checkpoint.py adds layers
    quantization["ignore"] = ["lm_head", r"re:.*mlp\.gate$"]
    config.update(hidden_size=h, moe_intermediate_size=i, intermediate_size=4 * i, num_hidden_layers=args.layers,
                  num_local_experts=args.experts, num_experts=args.experts, num_experts_per_tok=min(8, args.experts),
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  vocab_size=args.vocab, max_position_embeddings=4096, quantization_config=quantization)
    (args.target / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {args.target}: {args.layers} layer(s) x {args.experts} experts, {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
