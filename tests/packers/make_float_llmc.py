"""Make tests/data/float/ct-*: tiny Qwen3-MoE checkpoints quantized to NVFP4 / MXFP4 by the REAL llm-compressor,
with compressed-tensors' own decompression of every expert projection as the truth.

Versions: llmcompressor 0.14.0.1, compressed-tensors 0.19.0 (its pin), transformers 5.17.0, torch 2.13.0 (CPU),
Python 3.11; the venv is tests/packers/requirements-llmc.txt. From the repo root:

    python3.11 -m venv .venv-llmc
    .venv-llmc/bin/pip install --no-deps -r tests/packers/requirements-llmc.txt
    .venv-llmc/bin/python tests/packers/make_float_llmc.py tests/data/float [NAME ...]

About a minute on 2 cores. The float model is a seeded random bf16 Qwen3MoeForCausalLM (hidden 64, moe_intermediate
32, 4 experts, top-2, 2 layers; expert weights N(0, 0.05), with row 0's first 32 inputs scaled by 1e-3 and row 1's by
1e-5 in every expert projection so that tiny blocks, subnormal E4M3 scales and low UE8M0 bytes occur), saved by
transformers and loaded back. `oneshot(model, recipe=QuantizationModifier(targets="Linear", scheme=S,
ignore=["lm_head", "re:.*mlp.gate$"]))`, then `save_pretrained(out, save_compressed=True, max_shard_size="20KB")`:

- `ct-nvfp4`: S = "NVFP4" (W4A4). It needs calibration: data-free, oneshot fails with
  `TypeError: 'NoneType' object is not iterable` (pipelines/sequential/pipeline.py, `next(iter(dataloader))`), so it
  gets 8 seeded random token sequences of 16 as a tokenized Dataset.
- `ct-nvfp4a16`: S = "NVFP4A16" (weights only), data-free.
- `ct-mxfp4a16`: S = "MXFP4A16" (weights only), data-free. (The MXFP4 preset, dynamic activations, runs data-free
  too; its weights are the same format.)
- `ct-mxfp4-fp8block`: S = {"MXFP4A16": [experts regex], "FP8_BLOCK": [attention projections regex]}, data-free:
  a `mixed-precision` checkpoint, MXFP4 experts beside FP8-block (128x128, bf16 scales) attention.

What it writes (docs/FLOAT_SOURCES.md sections 2-3): oneshot linearizes the fused transformers-5 experts into
per-expert Linear modules (modeling/moe/linearize.py, post-load fallback), so every expert projection is 2-D,
`model.layers.L.mlp.experts.E.{gate,up,down}_proj.`:
- NVFP4: `weight_packed` uint8 (N, K/2), E2M1 codes with element 2j in the low nibble of byte j;
  `weight_scale` float8_e4m3fn (N, K/16); `weight_global_scale` float32 (1,) = 448*6/amax(W) computed in bf16, one
  per gate/up pair (fuse_weight_observers); `ct-nvfp4` also `input_global_scale` float32 (1,). Decoding: code *
  (scale / global), the global being the reciprocal of ModelOpt's weight_scale_2 convention.
- MXFP4: `weight_packed` uint8 (N, K/2), same nibble order; `weight_scale` uint8 (N, K/32), UE8M0 2^(b-127).
- FP8_BLOCK (the mixed variant's attention): `weight` float8_e4m3fn (N, K), `weight_scale` bf16 (ceil(N/128),
  ceil(K/128)) = tile amax / 448.
No weight_shape tensors, no biases (Qwen3-MoE has none); the routers `mlp.gate.weight` stay bf16 (E, H) and are in
`ignore`; lm_head, the embeddings and the norms stay bf16. With max_shard_size 20KB the experts span 2 to 4
shards.

Beside each, `NAME.truth.safetensors`, for every FP4 expert projection and every FP8 linear: `<prefix>.weight`
float32 = its group's registered compressor's `decompress(state_dict, scheme)` of the tensors just written (bf16,
cast exactly), and `<prefix>.float_weight` the bf16 weight before quantization. `made-llmc.json`: versions,
scheme, the float model's digest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

H, I, E, LAYERS, VOCAB = 64, 32, 4, 2, 128
SHARD = "20KB"
# name -> (llm-compressor preset scheme, or preset -> targets, and whether oneshot needs calibration data)
VARIANTS = {
    "ct-nvfp4": ("NVFP4", True),
    "ct-nvfp4a16": ("NVFP4A16", False),
    "ct-mxfp4a16": ("MXFP4A16", False),
    "ct-mxfp4-fp8block": ({"MXFP4A16": [r"re:.*mlp\.experts\..*"], "FP8_BLOCK": [r"re:.*self_attn\..*_proj$"]}, False),
}
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def build_float_model(folder: Path) -> dict[str, torch.Tensor]:
    """A seeded random bf16 Qwen3-MoE saved by transformers (per-expert 2-D tensors on disk); returns every
    expert and attention projection's weight as saved."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, intermediate_size=64, num_experts=E,
                            num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, vocab_size=VOCAB, max_position_embeddings=64,
                            tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        # spread the default std-0.02 init so that blocks get different scales, and give the first block of rows
        # 0 and 1 of every expert projection a tiny range (small and subnormal block scales)
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul(0.05).to(p.dtype))
                p[..., 0, :32].mul_(1e-3)
                p[..., 1, :32].mul_(1e-5)
    model.save_pretrained(folder)
    found = {}
    for shard in folder.glob("*.safetensors"):
        found.update({k: v for k, v in load_file(shard).items()
                      if ".mlp.experts." in k or (".self_attn." in k and k.endswith("_proj.weight"))})
    return found


def calibration_set():
    """8 seeded random token sequences of 16, tokenized already (the model has no tokenizer)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (8, 16), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 16] * 8})


def quantize(scheme: str | dict, calibrated: bool, src: Path, out: Path) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    started = time.time()
    data = {"dataset": calibration_set(), "num_calibration_samples": 8, "max_seq_length": 16} if calibrated else {}
    targets = {"targets": "Linear"} if isinstance(scheme, str) else {}
    oneshot(model=model, recipe=QuantizationModifier(scheme=scheme, ignore=IGNORE, **targets), **data)
    print(f"  oneshot {time.time() - started:.2f}s; experts module {type(model.model.layers[0].mlp.experts).__name__}")
    model.save_pretrained(out, save_compressed=True, max_shard_size=SHARD)


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


def truth(out: Path, floats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every FP4 expert projection, and every FP8 linear, as compressed-tensors' own compressor for its group
    decompresses it from the files just written (`<prefix>.weight`, its bf16 output cast to float32, exactly),
    beside the bf16 weight before quantization (`<prefix>.float_weight`)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    groups = {group.format: group for group in config.config_groups.values()}
    tensors = read_checkpoint(out)
    found = {}
    for name in sorted(tensors):
        prefix = name.removesuffix(".weight_scale")
        if prefix == name:
            continue
        if f"{prefix}.weight_packed" in tensors and ".mlp.experts." in prefix:
            (group,) = (groups[f] for f in FP4_FORMATS if f in groups)
        elif tensors.get(f"{prefix}.weight", torch.empty(0)).dtype == torch.float8_e4m3fn:
            group = groups["float-quantized"]
        else:
            continue
        local = {key[len(prefix) + 1:]: value for key, value in tensors.items() if key.startswith(prefix + ".")}
        weight = BaseCompressor.get_value_from_registry(group.format).decompress(local, group)["weight"]
        found[f"{prefix}.weight"] = weight.float().contiguous()
        found[f"{prefix}.float_weight"] = floats[f"{prefix}.weight"].contiguous()
    return found


def main() -> int:
    import compressed_tensors
    import llmcompressor
    import transformers

    from safetensors.torch import save_file

    root = Path(sys.argv[1])
    names = sys.argv[2:] or list(VARIANTS)
    root.mkdir(parents=True, exist_ok=True)
    made_path = root / "made-llmc.json"
    made = json.loads(made_path.read_text()) if made_path.exists() else {}
    made["versions"] = {"llmcompressor": llmcompressor.__version__,
                        "compressed-tensors": compressed_tensors.__version__,
                        "transformers": transformers.__version__, "torch": torch.__version__}
    print("versions:", "llmcompressor", llmcompressor.__version__, "compressed-tensors", compressed_tensors.__version__,
          "transformers", transformers.__version__, "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float"
        floats = build_float_model(src)
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(src.glob("*.safetensors")))).hexdigest()
        for name in names:
            scheme, calibrated = VARIANTS[name]
            out = root / name
            shutil.rmtree(out, ignore_errors=True)
            quantize(scheme, calibrated, src, out)
            found = truth(out, floats)
            save_file(found, str(root / f"{name}.truth.safetensors"))
            made[name] = {"scheme": scheme, "calibrated": calibrated, "float_sha256": digest,
                          "truth_tensors": len(found)}
            print(name, json.dumps(json.loads((out / "config.json").read_text())["quantization_config"]))
    made_path.write_text(json.dumps(made, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
