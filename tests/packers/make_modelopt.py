"""Tiny Qwen3-MoE checkpoints quantized by the REAL NVIDIA ModelOpt 0.47.0 (PyPI `nvidia-modelopt`) and written
by its HF checkpoint exporter (`modelopt.torch.export.export_hf_checkpoint`), with what ModelOpt's own
quantizer makes of each linear as the truth.

Runs in its own venv (ModelOpt 0.47.0 pins transformers<5.15,>=4.57 in its `hf` extra, and its INT4 export
of a transformers-5 MoE fails: see below), never in the main venv. From the repo root:

    python3.11 -m venv .venv-modelopt
    .venv-modelopt/bin/pip install --no-deps -r tests/packers/requirements-modelopt.txt
    .venv-modelopt/bin/python tests/packers/make_modelopt.py tests/data/modelopt [NAME ...]

About a minute on 2 cores, all on CPU. Each variant is a random bf16 Qwen3MoeForCausalLM (seeded; one MoE
layer of 2 experts, hidden 128 and moe_intermediate 64, or 256 and 128; a 16-token WordLevel tokenizer built offline), saved
and loaded back with `from_pretrained` (ModelOpt's exporter reads `config.architectures`), quantized with
`mtq.quantize(model, CFG, forward_loop)` on 4 seeded random batches, CFG one of ModelOpt's presets with
its int4 block size set (VARIANTS: 32, and ModelOpt's default 128 on a wider model), and exported into `OUT/NAME/`. Both presets export as
`quant_method: modelopt`, `quant_algo: W4A16_AWQ` (ModelOpt calls any 4-bit integer block quantizer
int4_awq, convert_hf_config.py / quant_utils.get_quantization_format), so:

- `int4-g32` (INT4_BLOCKWISE_WEIGHT_ONLY_CFG, max calibration): no `pre_quant_scale` tensors at all
  (hf_quant_config.json still says `pre_quant_scale: true`);
- `int4-awq-g32` (INT4_AWQ_CFG, AWQ-lite): a `pre_quant_scale` (K,) bf16 on every expert projection
  (averaged over the experts at export) and on o_proj (q/k/v's are folded into input_layernorm), not 1.

What the exporter writes for every quantized linear (quant_utils.pack_int4_in_uint8 and
get_scaling_factor): `weight` uint8 (N/2, K), signed 4-bit codes q in [-8, 7] packed along N, row 2m in the
low nibble of byte (m, k) and row 2m+1 in the high one; `weight_scale` float32 (N, K/g) = amax / 7, the
amax of each block of g inputs; no zero points. Before packing, the exporter sets each expert's gate and
up block amaxes to their element-wise maximum (layer_utils.sync_moe_gate_up_amax: it warns "mismatched
weight_scale_2").

`OUT/NAME.truth.safetensors` (written for variants without pre_quant_scale): for every linear ModelOpt
quantized, its quantizer's reading of the float weight as the exporter left the quantizer (amax synced):
`<prefix>.scales` float32 (N, G) = ModelOpt's get_scaling_factor(weight_quantizer); `<prefix>.codes`
uint8 (N, K) = q + 8 with q = round(w / scale) clamped to [-8, 7], the exporter's arithmetic (the bf16
weight divided by the float32 scale, in float32); `<prefix>.zeros` uint8 (N, G), all 8 (symmetric).
ModelOpt's fake quantization (the quantizer's forward, computed in bf16) rounds a few ties the other way
(1 to 4 codes in 8192 per linear): `OUT/made.json` records that count per linear, the versions, and the
digest of each float model.

ModelOpt 0.47.0's INT4 export of a transformers-5 Qwen3-MoE (5.14.1, the newest its `hf` extra allows, and
5.24.0) fails on CPU with `TypeError: object of type 'QuantQwen3MoeExperts' has no len()` in
`requantize_resmooth_fused_llm_layers` (layer_utils.get_experts_list takes len() of the fused experts);
with transformers 4.57.6 (experts as a ModuleList) it exports, hence the pin.
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

# name -> (ModelOpt preset, int4 block size, (hidden, moe_intermediate), whether the output has a truth: no
# pre_quant_scale to refuse). g128 is ModelOpt's default block; its down projection (K = 128) has one group.
VARIANTS = {
    "int4-g32": ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", 32, (128, 64), True),
    "int4-awq-g32": ("INT4_AWQ_CFG", 32, (128, 64), False),
    "int4-g128": ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", 128, (256, 128), True),
}
VOCAB = 16


def build_float_model(folder: Path, hidden: int, intermediate: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, intermediate_size=hidden,
                            num_experts=2, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=hidden // 4, vocab_size=VOCAB, max_position_embeddings=64,
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1",
                            eos_token="t2").save_pretrained(folder)


def preset(name: str, block: int) -> dict:
    """ModelOpt's preset with its int4 block size set to `block`."""
    import modelopt.torch.quantization as mtq

    config = copy.deepcopy(getattr(mtq, name))
    found = 0
    for entry in config["quant_cfg"]:
        if isinstance(entry, dict) and entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"] = {**entry["cfg"]["block_sizes"], -1: block}
            found += 1
    if found != 1:
        raise SystemExit(f"make_modelopt: {name} has {found} weight quantizer entries, not one")
    return config


def calibrate(model) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            model(torch.randint(0, VOCAB, (2, 16), generator=generator))


def truth(model, floats: dict[str, torch.Tensor], block: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every quantized linear as ModelOpt's quantizer reads its float weight (see the module doc), and how
    many of its codes ModelOpt's own fake quantization rounds the other way."""
    from modelopt.torch.export.quant_utils import get_scaling_factor

    modules = dict(model.named_modules())
    found, ties = {}, {}
    for prefix, weight in floats.items():
        quantizer = modules[prefix].weight_quantizer
        n, k = weight.shape
        scales = get_scaling_factor(quantizer).reshape(n, k // block)
        per_column = scales[:, torch.arange(k) // block]
        steps = (weight / per_column).round().clamp(-8, 7)
        found[f"{prefix}.codes"] = (steps + 8).to(torch.uint8)
        found[f"{prefix}.zeros"] = torch.full(scales.shape, 8, dtype=torch.uint8)
        found[f"{prefix}.scales"] = scales.contiguous()
        with torch.no_grad():
            fake = quantizer(weight).float() / per_column
        if bool(((fake - fake.round()).abs() > 0.05).any()):
            raise SystemExit(f"make_modelopt: {prefix}: the fake quantization is not on whole steps of the scale")
        ties[prefix] = int((fake.round() != steps).sum())
    return found, ties


def make(root: Path, names: list[str]) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    made_path = root / "made.json"
    made = json.loads(made_path.read_text()) if made_path.exists() else {}
    made["versions"] = {"nvidia-modelopt": modelopt.__version__, "transformers": transformers.__version__,
                        "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cfg_name, block, (hidden, intermediate), has_truth = VARIANTS[name]
            float_dir = Path(tmp) / f"float-{hidden}-{intermediate}"
            if not float_dir.exists():
                build_float_model(float_dir, hidden, intermediate)
            digest = hashlib.sha256((float_dir / "model.safetensors").read_bytes()).hexdigest()
            model = Qwen3MoeForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16)
            model = mtq.quantize(model, preset(cfg_name, block), calibrate)
            floats = {prefix: module.weight.detach().clone() for prefix, module in model.named_modules()
                      if getattr(getattr(module, "weight_quantizer", None), "is_enabled", False)}
            out = root / name
            shutil.rmtree(out, ignore_errors=True)
            export_hf_checkpoint(model, export_dir=out)
            for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (float_dir / tokenizer_file).exists():
                    shutil.copy(float_dir / tokenizer_file, out / tokenizer_file)
            record = {"preset": cfg_name, "block_size": block, "float_sha256": digest}
            (root / f"{name}.truth.safetensors").unlink(missing_ok=True)
            if has_truth:
                found, ties = truth(model, floats, block)
                save_file(found, str(root / f"{name}.truth.safetensors"))
                record["fake_quant_ties"] = ties
            made[name] = record
            print(name, json.loads((out / "config.json").read_text())["quantization_config"], flush=True)
    made_path.write_text(json.dumps(made, indent=1, sort_keys=True) + "\n")


def main() -> int:
    make(Path(sys.argv[1]), sys.argv[2:] or list(VARIANTS))
    print("make_modelopt: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
