"""Make tests/data/float/modelopt-nvfp4: a tiny Qwen3-MoE quantized to NVFP4 by the REAL NVIDIA ModelOpt on CPU and
written by its HF exporter, with ModelOpt's own NVFP4 dequantization of every expert projection as the truth.

Versions: nvidia-modelopt 0.47.0, transformers 4.57.6, torch 2.13.0 (CPU), Python 3.11: the same venv as
tests/packers/make_modelopt.py (tests/packers/requirements-modelopt.txt says why transformers 4.57). From the repo root:

    python3.11 -m venv .venv-modelopt
    .venv-modelopt/bin/pip install --no-deps -r tests/packers/requirements-modelopt.txt
    .venv-modelopt/bin/python tests/packers/make_float_modelopt.py tests/data/float

About 40 s on 2 cores. The float model matches make_float_llmc.py's in shape (seeded random bf16 Qwen3MoeForCausalLM,
hidden 64, moe_intermediate 32, 4 experts, 2 layers, vocabulary 16; expert weights N(0, 0.05), with row 0's first 32
inputs scaled by 1e-3 and row 1's by 1e-5). `mtq.quantize(model, NVFP4_DEFAULT_CFG, forward_loop)` on 8 seeded random
batches, then `export_hf_checkpoint(model, export_dir=out, max_shard_size="20KB")`. NVFP4 quantization and export run
on CPU here: nothing asked for CUDA.

What it writes (docs/FLOAT_SOURCES.md section 4): `hf_quant_config.json` with `quant_algo: NVFP4`, `group_size: 16`,
`exclude_modules` (lm_head, embed_tokens, each router `mlp.gate`); `config.json` `quantization_config` with
`quant_method: modelopt`. Per expert projection `model.layers.L.mlp.experts.E.{gate,up,down}_proj.`: `weight` uint8
(N, K/2), E2M1 codes with element 2j in the low nibble (NVFP4QTensor.quantize); `weight_scale` float8_e4m3fn
(N, K/16), clamped to [2^-9, 448]; `weight_scale_2` float32 scalar () = amax / (6 * 448), one per gate/up pair
(sync_moe_gate_up_amax); `input_scale` float32 scalar () = input amax / (6 * 448), shared by gate and up. Decoding:
code * weight_scale * weight_scale_2, so weight_scale_2 is the reciprocal of compressed-tensors' weight_global_scale.
The routers stay bf16 (E, H). Layer 0's experts are split across shards 1 and 2.

Beside it, `modelopt-nvfp4.truth.safetensors`: `<prefix>.weight` float32 = `NVFP4QTensor(shape, float32,
weight).dequantize(scale=weight_scale, double_scale=weight_scale_2, block_sizes={-1: 16})` of the tensors just
written (ModelOpt reads code 0x8 as +0.0), and `<prefix>.float_weight` the bf16 weight before quantization.
`made-modelopt.json`: versions, preset, the float model's digest.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

H, I, E, LAYERS, VOCAB = 64, 32, 4, 2, 16
SHARD = "20KB"
# name -> ModelOpt preset
VARIANTS = {"modelopt-nvfp4": "NVFP4_DEFAULT_CFG"}


def build_float_model(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, intermediate_size=64, num_experts=E,
                            num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, vocab_size=VOCAB, max_position_embeddings=64,
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul(0.05).to(p.dtype))
                p[0, :32].mul_(1e-3)
                p[1, :32].mul_(1e-5)
    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1",
                            eos_token="t2").save_pretrained(folder)


def calibrate(model) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(8):
            model(torch.randint(0, VOCAB, (2, 16), generator=generator))


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


def truth(out: Path, floats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every expert projection as ModelOpt's own NVFP4QTensor.dequantize (float32 output) reads the files just
    written (`<prefix>.weight`), beside the bf16 weight before quantization (`<prefix>.float_weight`)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    tensors = read_checkpoint(out)
    found = {}
    for name in sorted(tensors):
        if not name.endswith(".weight_scale_2") or ".mlp.experts." not in name:
            continue
        prefix = name.removesuffix(".weight_scale_2")
        packed = tensors[f"{prefix}.weight"]
        shape = torch.Size((packed.shape[0], packed.shape[1] * 2))
        qtensor = NVFP4QTensor(shape, torch.float32, packed)
        found[f"{prefix}.weight"] = qtensor.dequantize(
            dtype=torch.float32, scale=tensors[f"{prefix}.weight_scale"],
            double_scale=tensors[f"{prefix}.weight_scale_2"], block_sizes={-1: 16}).contiguous()
        found[f"{prefix}.float_weight"] = floats[prefix].contiguous()
    return found


def make(root: Path, names: list[str]) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    made_path = root / "made-modelopt.json"
    made = json.loads(made_path.read_text()) if made_path.exists() else {}
    made["versions"] = {"nvidia-modelopt": modelopt.__version__, "transformers": transformers.__version__,
                        "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = Path(tmp) / "float"
        build_float_model(float_dir)
        digest = hashlib.sha256((float_dir / "model.safetensors").read_bytes()).hexdigest()
        for name in names:
            model = Qwen3MoeForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16)
            floats = {prefix: module.weight.detach().clone() for prefix, module in model.named_modules()
                      if ".mlp.experts." in prefix and hasattr(module, "weight")}
            model = mtq.quantize(model, copy.deepcopy(getattr(mtq, VARIANTS[name])), calibrate)
            out = root / name
            shutil.rmtree(out, ignore_errors=True)
            export_hf_checkpoint(model, export_dir=out, max_shard_size=SHARD)
            found = truth(out, floats)
            save_file(found, str(root / f"{name}.truth.safetensors"))
            made[name] = {"preset": VARIANTS[name], "float_sha256": digest, "truth_tensors": len(found)}
            print(name, json.loads((out / "config.json").read_text())["quantization_config"], flush=True)
    made_path.write_text(json.dumps(made, indent=1, sort_keys=True) + "\n")


def main() -> int:
    make(Path(sys.argv[1]), sys.argv[2:] or list(VARIANTS))
    print("make_float_modelopt: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
