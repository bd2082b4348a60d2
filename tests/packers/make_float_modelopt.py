"""DOCSTRING (filled in below once the producer's output is known)."""

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
