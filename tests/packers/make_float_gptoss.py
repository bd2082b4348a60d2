"""DOCSTRING (filled in below once the producer's output is known)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

H, I, E, LAYERS, VOCAB = 64, 64, 4, 2, 128
SHARD = "40KB"
NAME = "gptoss-mxfp4"


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


def quantize(src: Path, out: Path) -> None:
    """transformers' own MXFP4 path: quantize on load (Mxfp4HfQuantizer, integrations/mxfp4.Mxfp4Quantize ->
    quantize_to_mxfp4, the hub's triton_kernels downcast_to_mxfp_torch), then save_pretrained (the quantizer's
    get_state_dict_and_metadata -> Mxfp4ReverseDeserialize)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = GptOssForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(), dtype=torch.bfloat16,
                                              use_kernels=True)
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
    print("versions: transformers", transformers.__version__, "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float"
        floats = build_float_model(src)
        out = root / NAME
        shutil.rmtree(out, ignore_errors=True)
        quantize(src, out)
        save_file(truth(out, floats), str(root / f"{NAME}.truth.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
