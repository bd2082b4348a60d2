"""Make tests/data/llmc_fused/: tiny Qwen3-MoE checkpoints quantized by the REAL llm-compressor.

Versions: llmcompressor 0.12.0, compressed-tensors 0.17.1, transformers 5.10.1, torch 2.12.0
(llmcompressor 0.12.0 pins torch<=2.12.0, so pip replaced the CPU torch 2.13.0). Python 3.11, CPU.
Run from the repo root: .venv-llmc/bin/python tests/packers/make_llmc_fused.py

The source model is a random bf16 Qwen3MoeForCausalLM (hidden 64, moe_intermediate 32, 4 experts,
top-2, 2 layers). Its experts are fused 3-D parameters in memory (mlp.experts.gate_up_proj (E, 2I, H),
mlp.experts.down_proj (E, H, I)). They are written FUSED on disk the way Qwen's own checkpoints store
them, then loaded back with from_pretrained and passed to oneshot() with a data-free QuantizationModifier.

The scheme is W4A16 / W4A16_ASYM (int4 weights, group strategy, targets Linear, ignore lm_head) with
group_size 32 instead of the preset's 128: with the preset, 128 does not divide H=64 or I=32, and
oneshot fails with "unflatten: Provided sizes [-1, 128] don't multiply up to the size of dim 1 (64)".

What 0.12.0 writes: oneshot linearizes the fused experts into per-expert nn.Linear modules
(gate = gate_up_proj[e, :I], up = gate_up_proj[e, I:]), so the checkpoint holds per-expert tensors
model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight_{packed,scale,shape}
(+ weight_zero_point for asym). No fused experts.gate_up_proj_packed tensors are written.

Output, per variant (sym/, asym/): config.json, generation_config.json, recipe.yaml, model.safetensors,
and float_experts.safetensors (the pre-quantization fused expert tensors, bf16).
The script then checks that the packed codes and scales are a per-row group quantization of each expert's
gate / up / down weights and prints the errors.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "llmc_fused")
H, I, E, LAYERS, GROUP = 64, 32, 4, 2, 32


def build_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, intermediate_size=64, num_experts=E,
        num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=128, dtype="bfloat16",
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    # the default init gives std 0.02 weights; spread them so that groups differ clearly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate_up_proj") or name.endswith("down_proj"):
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul(0.05).to(p.dtype))
    return model


def quantize(sym: bool, out: str) -> None:
    from transformers import AutoModelForCausalLM
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = build_model()
    sd = model.state_dict()
    experts = {k: v.contiguous() for k, v in sd.items() if ".mlp.experts." in k}
    for k, v in experts.items():
        if ".layers.0." in k:
            print(f"  in memory: {k} {tuple(v.shape)} {v.dtype}")
    os.makedirs(out, exist_ok=True)
    save_file(experts, os.path.join(out, "float_experts.safetensors"), metadata={"format": "pt"})

    with tempfile.TemporaryDirectory() as src:
        # a fused-on-disk float checkpoint, as Qwen ships Qwen3.5/3.6-MoE (transformers' own
        # save_pretrained would split the experts into per-expert 2-D tensors)
        model.config.save_pretrained(src)
        save_file({k: v.contiguous() for k, v in sd.items()},
                  os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        scheme = {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
            "symmetric": sym, "dynamic": False}}}
        t = time.time()
        oneshot(model=model, recipe=QuantizationModifier(config_groups=scheme, ignore=["lm_head"]))
        print(f"  oneshot {time.time() - t:.2f}s; experts module now "
              f"{type(model.model.layers[0].mlp.experts).__name__}")
        # the save wrapper reads the source folder (model.name_or_path) for a recipe: save inside `with`
        model.save_pretrained(out, save_compressed=True)
    for junk in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(out, junk)):
            os.remove(os.path.join(out, junk))


def unpack_last(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 words -> unsigned 4-bit codes along the last dim, value j of a word in bits 4j..4j+3."""
    w = packed.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], dim=-1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


def unpack_first(packed: torch.Tensor, n: int) -> torch.Tensor:
    """zero points: packed along dim 0."""
    return unpack_last(packed.t().contiguous(), n).t()


def dequant(f, prefix: str, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    shape = f.get_tensor(prefix + "weight_shape").tolist()
    codes = unpack_last(f.get_tensor(prefix + "weight_packed"), shape[1])
    scale = f.get_tensor(prefix + "weight_scale").float()
    if sym:
        zp = torch.full_like(scale, 8)
    else:
        zp = unpack_first(f.get_tensor(prefix + "weight_zero_point"), shape[0]).float()
    g = shape[1] // scale.shape[1]
    s = scale.repeat_interleave(g, dim=1)
    z = zp.repeat_interleave(g, dim=1)
    return (codes.float() - z) * s, s


def ref_qparams(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' min-max group qparams for int4, recomputed here in the weight's dtype (bf16),
    as its observer and calculate_qparams do: (scale, zero point in [-8, 7])."""
    g = w.unflatten(-1, (-1, GROUP))
    lo = torch.clamp(g.amin(-1), max=0)
    hi = torch.clamp(g.amax(-1), min=0)
    if sym:
        scale = torch.maximum(lo.abs(), hi) / 7.5
        zp = torch.zeros_like(scale)
    else:
        scale = (hi - lo) / 15.0
        zp = torch.round(torch.clamp(-8 - lo / scale, -8, 7))
    return scale, zp


def ref_codes(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    """codes 0..15 as compressed-tensors quantize() makes them (x / scale + zp in bf16, round, clamp) + 8."""
    s = scale.repeat_interleave(GROUP, dim=1)
    z = zp.repeat_interleave(GROUP, dim=1)
    return torch.clamp(torch.round(w / s + z), -8, 7).to(torch.int64) + 8


def check(out: str, sym: bool) -> dict:
    """Dequantize each expert's gate/up/down and compare with the float weights."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    fl = safe_open(os.path.join(out, "float_experts.safetensors"), "pt")
    worst = {"gate": 0.0, "up": 0.0, "down": 0.0}
    wrong = {"gate_vs_up_half": float("inf"), "gate_vs_even_rows": float("inf"), "up_vs_gate_half": float("inf")}
    scale_rel, zp_diff, code_off1, code_off_more, ct_mismatch, n_codes = 0.0, 0, 0, 0, 0, 0
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        for layer in range(LAYERS):
            base = f"model.layers.{layer}.mlp.experts."
            gu = fl.get_tensor(base + "gate_up_proj")
            dn = fl.get_tensor(base + "down_proj")
            for e in range(E):
                for proj, ref in (("gate", gu[e, :I]), ("up", gu[e, I:]), ("down", dn[e])):
                    prefix = f"{base}{e}.{proj}_proj."
                    deq, s = dequant(f, prefix, sym)
                    # error in units of the step; <= 0.5 (+ bf16 rounding) when the layout is right
                    worst[proj] = max(worst[proj], ((deq - ref.float()).abs() / s).max().item())
                    if proj == "gate":
                        wrong["gate_vs_up_half"] = min(
                            wrong["gate_vs_up_half"], ((deq - gu[e, I:].float()).abs() / s).max().item())
                        wrong["gate_vs_even_rows"] = min(
                            wrong["gate_vs_even_rows"], ((deq - gu[e, 0::2].float()).abs() / s).max().item())
                    if proj == "up":
                        wrong["up_vs_gate_half"] = min(
                            wrong["up_vs_gate_half"], ((deq - gu[e, :I].float()).abs() / s).max().item())
                    # qparams and codes against an independent per-row group quantization
                    scale_ref, zp_ref = ref_qparams(ref, sym)
                    scale = f.get_tensor(prefix + "weight_scale")
                    scale_rel = max(scale_rel, ((scale.float() - scale_ref.float()).abs()
                                                / scale_ref.float()).max().item())
                    shape = f.get_tensor(prefix + "weight_shape").tolist()
                    packed = f.get_tensor(prefix + "weight_packed")
                    codes = unpack_last(packed, shape[1])
                    if not sym:
                        zp = unpack_first(f.get_tensor(prefix + "weight_zero_point"), shape[0])
                        zp_diff = max(zp_diff, (zp - 8 - zp_ref.to(torch.int64)).abs().max().item())
                    code_ref = ref_codes(ref, scale_ref, zp_ref)
                    d = (codes - code_ref).abs()
                    code_off1 += int((d == 1).sum())
                    code_off_more += int((d > 1).sum())
                    n_codes += d.numel()
                    ct = unpack_from_int32(packed, 4, torch.Size(shape)).to(torch.int64) + 8
                    ct_mismatch += int((ct != codes).sum())
    return {
        "max_abs_err_in_steps": worst,
        "wrong_layout_min_max_err_in_steps": wrong,
        "scale_max_rel_diff_vs_recomputed": scale_rel,
        "zero_code_max_diff_vs_recomputed": zp_diff,
        "codes_off_by_1_vs_recomputed": code_off1,
        "codes_off_by_more_vs_recomputed": code_off_more,
        "codes_total": n_codes,
        "my_unpack_vs_ct_unpack_from_int32_mismatch": ct_mismatch,
    }


def listing(out: str) -> None:
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.startswith("model.layers.0.mlp.experts.0."):
                t = f.get_tensor(k)
                extra = f" = {t.tolist()}" if k.endswith("_shape") else ""
                print(f"  {k} {t.dtype} {tuple(t.shape)}{extra}")
        n = [k for k in f.keys() if ".mlp.experts." in k]
        print(f"  ({len(n)} expert tensors in all; any fused name: {any('gate_up_proj' in k for k in n)})")
    q = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    print("  config_groups:", json.dumps(q["config_groups"]))
    print("  ignore:", q["ignore"])


def main() -> int:
    import compressed_tensors, llmcompressor, transformers

    print("versions:", "llmcompressor", llmcompressor.__version__, "compressed-tensors",
          compressed_tensors.__version__, "transformers", transformers.__version__, "torch", torch.__version__)
    for name, sym in (("sym", True), ("asym", False)):
        out = os.path.join(ROOT, name)
        if os.path.isdir(out):
            shutil.rmtree(out)
        print(f"== {name}")
        quantize(sym, out)
        listing(out)
        print("  check:", json.dumps(check(out, sym)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
