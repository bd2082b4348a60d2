"""gpt-oss MXFP4 as transformers writes it: an attempt that stops where transformers needs the Hugging Face Hub, so
there is no tests/data/float/gptoss-mxfp4 (docs/FLOAT_SOURCES.md section 5).

Versions: transformers 5.24.0, torch 2.13.0 (CPU), triton 3.9.0, kernels 0.18.3, Python 3.11
(tests/packers/requirements-gptoss.txt). From the repo root:

    python3.11 -m venv .venv-gptoss
    .venv-gptoss/bin/pip install --no-deps -r tests/packers/requirements-gptoss.txt
    .venv-gptoss/bin/python tests/packers/make_float_gptoss.py tests/data/float [NAME ...]

It builds a seeded random bf16 GptOssForCausalLM (hidden 96, intermediate 32, 4 experts, 2 layers) and asks
transformers' own MXFP4 path to quantize it: `from_pretrained(float, quantization_config=Mxfp4Config(),
use_kernels=True)` (Mxfp4HfQuantizer; integrations/mxfp4.py Mxfp4Quantize -> quantize_to_mxfp4 -> the hub kernel's
`triton_kernels.numerics_details.mxfp.downcast_to_mxfp_torch`), then `save_pretrained(max_shard_size="40KB")`
(get_state_dict_and_metadata -> Mxfp4ReverseDeserialize). Where that works, it would write the stacked
`mlp.experts.{gate_up,down}_proj_{blocks,scales}` and, as the truth, transformers' own
`convert_moe_packed_tensors` (float32) beside the bf16 weights.

On this machine it cannot:
- in .venv-packers (no triton): `ValueError: MXFP4 quantization requires Triton: CUDA requires Triton >= 3.4.0,
  XPU/CPU requires Triton >= 3.5.0. Please install triton: `pip install triton``;
- here: `replace_with_mxfp4_linear` calls `get_kernel("kernels-community/gpt-oss-triton-kernels", version=1)`, the
  Hub is unreachable (`httpx2.ConnectError: [Errno -2] Name or service not known`), raised as `ValueError: Kernel
  repository 'kernels-community/gpt-oss-triton-kernels' could not verify publisher trust status. Set
  trust_remote_code=True or add the repository ID to the trust_remote_code allowlist to allow loading kernels from
  untrusted sources.`; with HF_HUB_OFFLINE=1 (the trust check skipped) it is `ValueError: Version 1 of
  'kernels-community/gpt-oss-triton-kernels' is not available in the local cache and Hugging Face Hub is in offline
  mode. ...`;
- with use_kernels=False (the default) transformers sets dequantize=True on CPU, with a warning, and saves bf16
  `gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H] (and bf16 biases, router) under `quantization_config:
  {"quant_method": "mxfp4", "modules_to_not_convert": null}`. That is variant `gptoss-cpu-dequantized`, committed
  as what it is: a real producer's checkpoint that claims MXFP4 and holds no `*_blocks` / `*_scales` (no truth
  file: nothing in it is quantized).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

H, I, E, LAYERS, VOCAB = 96, 32, 4, 2, 32
SHARD = "40KB"
# name -> use_kernels: what transformers saves on CPU by default, and the MXFP4 checkpoint (needs the Hub kernel)
VARIANTS = {"gptoss-cpu-dequantized": False, "gptoss-mxfp4": True}


def build_float_model(folder: Path) -> dict[str, torch.Tensor]:
    """A seeded random bf16 GptOssForCausalLM saved by transformers; returns its stacked expert tensors."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                          num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          vocab_size=VOCAB, max_position_embeddings=64, sliding_window=16,
                          layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.copy_(torch.randn_like(p, dtype=torch.float32).mul(0.05).to(p.dtype))
    model.save_pretrained(folder)
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".mlp.experts." in name}


def quantize(src: Path, out: Path, use_kernels: bool) -> None:
    """transformers' own MXFP4 path: quantize on load (Mxfp4HfQuantizer, integrations/mxfp4.Mxfp4Quantize ->
    quantize_to_mxfp4, the hub's triton_kernels downcast_to_mxfp_torch), then save_pretrained (the quantizer's
    get_state_dict_and_metadata -> Mxfp4ReverseDeserialize)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = GptOssForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(), dtype=torch.bfloat16,
                                              use_kernels=use_kernels)
    model.save_pretrained(out, max_shard_size=SHARD)


def truth(out: Path, floats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stacked expert projection as transformers' own dequantization (integrations/mxfp4.
    convert_moe_packed_tensors, float32 output) reads the files just written, beside the bf16 weights."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    found = {}
    for name in sorted(tensors):
        if name.endswith("_blocks"):
            prefix = name.removesuffix("_blocks")
            found[f"{prefix}.weight"] = convert_moe_packed_tensors(
                tensors[name], tensors[f"{prefix}_scales"], dtype=torch.float32).contiguous()
            found[f"{prefix}.float_weight"] = floats[prefix].contiguous()
    return found


def main() -> int:
    import transformers
    from safetensors.torch import save_file

    root = Path(sys.argv[1])
    names = sys.argv[2:] or list(VARIANTS)
    print("versions: transformers", transformers.__version__, "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float"
        floats = build_float_model(src)
        for name in names:
            out = root / name
            shutil.rmtree(out, ignore_errors=True)
            quantize(src, out, VARIANTS[name])
            found = truth(out, floats)
            if found:
                save_file(found, str(root / f"{name}.truth.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
