"""Make tests/data/gptqmodel_act_order/: tiny Qwen3-MoE checkpoints quantized with act-order by the REAL
GPTQModel (full GPTQ with calibration, not only its packer).

Runs in .venv-packers (scripts/install-packers.sh): GPTQModel 7.7.0, transformers 5.x, torch 2.13 CPU.
From the repo root:

    GPTQMODEL_CPU_WORKERS=2 .venv-packers/bin/python tests/packers/make_gptqmodel_act_order.py

The float model is a random bf16 Qwen3MoeForCausalLM (hidden 64, moe_intermediate 64, 4 experts, top-2,
2 layers), quantized 4-bit, group 32, asymmetric, desc_act=True, in two variants:

  down_only/   desc_act only on the routed experts' down_proj (GPTQModel's `dynamic` overrides turn it
               off for every other module): the case moeconv folds into static groups;
  everywhere/  desc_act on every linear: gate/up act-order over the hidden dimension, which moeconv
               must refuse.

Beside down_only, `down_only.reference.safetensors` holds GPTQModel's OWN reading of what it wrote:
for every routed expert linear `<prefix>.weight` (N, K) float32 from the loaded quantized module's
`dequantize_weight()` (GPTQModel's code, honouring g_idx) computed in float64 (exact), plus `inputs`
(T, 64) float32 and, per expert, `<expert>.output` (T, 64): the quantized expert MLP's forward,
down(silu(gate(x)) * up(x)), run by GPTQModel's own modules in float16. moeconv's tests compare their conversions with these.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1] / "data" / "gptqmodel_act_order"
H, I, E, LAYERS, GROUP = 64, 64, 4, 2, 32


def build_float_model(folder: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, intermediate_size=128, num_experts=E,
                            num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, vocab_size=256, max_position_embeddings=128,
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("{}")


def quantize(float_dir: Path, out: Path, variant: str) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    dynamic = None
    if variant == "down_only":
        # Positive overrides for every linear but the experts' down_proj: desc_act off there.
        dynamic = {r"+:^(?!.*\.mlp\.experts\.\d+\.down_proj).*$": {"desc_act": False}}
    config = QuantizeConfig(bits=4, group_size=GROUP, desc_act=True, sym=False, device="cpu", dynamic=dynamic)
    model = GPTQModel.load(str(float_dir), config)
    gen = torch.Generator().manual_seed(1)
    calibration = [{"input_ids": torch.randint(0, 256, (1, 64), generator=gen),
                    "attention_mask": torch.ones(1, 64, dtype=torch.long)} for _ in range(32)]
    model.quantize(calibration, batch_size=4)
    model.save(str(out))


def reference(out: Path, path: Path) -> None:
    from gptqmodel import GPTQModel
    from safetensors.torch import save_file

    model = GPTQModel.load(str(out), device="cpu", dtype=torch.float16)  # bf16 would cast its int shift buffers
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, H, generator=gen, dtype=torch.float32)
    tensors = {"inputs": x}
    modules = dict(model.model.named_modules())
    for name, module in modules.items():  # before any forward: TorchAtenLinear's first forward repacks its buffers
        if ".mlp.experts." in name and name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj"):
            scales = module.scales
            module.scales = scales.double()  # dequantize in float64: exact, no fp16 rounding of s·(q − z)
            # float32 holds s·(q − z) exactly (an fp16 scale times a 4-bit integer)
            tensors[f"{name}.weight"] = module.dequantize_weight().T.float().contiguous()
            module.scales = scales
    for name, module in modules.items():
        if name.rsplit(".", 2)[-2:-1] == ["experts"] and name.rsplit(".", 1)[-1].isdigit():
            with torch.no_grad():
                gate = module.gate_proj(x.to(module.gate_proj.scales.dtype))
                up = module.up_proj(x.to(module.up_proj.scales.dtype))
                y = module.down_proj(torch.nn.functional.silu(gate) * up)
            tensors[f"{name}.output"] = y.float().contiguous()
    save_file(tensors, str(path))


def main() -> None:
    if sys.argv[1:2] == ["--reference"]:  # a fresh process: after quantize() GPTQModel loads qzeros as float
        return reference(ROOT / sys.argv[2], ROOT / f"{sys.argv[2]}.reference.safetensors")
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # GPTQModel's pool fails on 2 cores otherwise
    os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # no native pack extension build
    ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = Path(tmp) / "float"
        build_float_model(float_dir)
        for variant in ("down_only", "everywhere"):
            out = ROOT / variant
            shutil.rmtree(out, ignore_errors=True)
            quantize(float_dir, out, variant)
            if variant == "down_only":  # the other one is refused
                subprocess.run([sys.executable, __file__, "--reference", variant], check=True)
            print(variant, sorted(p.name for p in out.iterdir()))
    print("make_gptqmodel_act_order: OK")


if __name__ == "__main__":
    sys.exit(main())
