"""Make tests/data/float/gptoss-mxfp4-bytes: a gpt-oss MXFP4 checkpoint whose expert BYTES moeconv makes, and whose
truth is transformers' own MXFP4 reader (docs/FLOAT_SOURCES.md section 5).

No real producer writes a gpt-oss MXFP4 checkpoint on this machine (transformers' quantizer needs a kernel from the
Hugging Face Hub: tests/packers/make_float_gptoss.py records the attempts). So the stacked expert tensors are written
here, in the layout transformers' reader takes (`integrations/mxfp4.py`: `Mxfp4GptOssExperts`,
`_convert_moe_packed_tensors`, `Mxfp4ReverseDeserialize`), with random E2M1 codes (every code 0x0..0xF occurs) and
UE8M0 scale bytes that include the edges (0: 2^-127, 1, 126, 127, 128, 254: 2^127; not 0xFF, which the OCP spec
reserves for NaN). Everything else (attention, norms, embeddings, lm_head, router weight and bias, the expert biases)
is what transformers 5.24.0 saves for a seeded random bf16 GptOssForCausalLM (the model of make_float_gptoss.py:
2 layers, 4 experts, hidden 96, intermediate 32).

Layout per layer (E experts, I intermediate, H hidden), as transformers reads it:
  mlp.experts.gate_up_proj_blocks  U8 [E, 2I, H/32, 16]  32 codes of a block along H, element 2j in the low nibble
  mlp.experts.gate_up_proj_scales  U8 [E, 2I, H/32]      UE8M0
  mlp.experts.gate_up_proj_bias    BF16 [E, 2I]
  mlp.experts.down_proj_blocks     U8 [E, H, I/32, 16]
  mlp.experts.down_proj_scales     U8 [E, H, I/32]
  mlp.experts.down_proj_bias       BF16 [E, H]
Rows of gate_up are interleaved: row 2i is gate row i, row 2i + 1 up row i (GptOssExperts: gate_up[..., ::2],
gate_up[..., 1::2]). The shards split the experts: layer 0's gate_up and down in different files, layer 1's too.

The truth beside it (`gptoss-mxfp4-bytes.truth.safetensors`) is transformers' reading of the files just written, not
moeconv's:
  <layer>.mlp.experts.gate_up_proj.weight  F64 [E, H, 2I]  `_convert_moe_packed_tensors(blocks, scales,
  <layer>.mlp.experts.down_proj.weight     F64 [E, I, H]     dtype=torch.float64)`: exact, no rounding
  <layer>.mlp.experts.gate_up_proj.loaded  F32 [E, H, 2I]  the parameters of `GptOssForCausalLM.from_pretrained(
  <layer>.mlp.experts.down_proj.loaded     F32 [E, I, H]     fixture, quantization_config=Mxfp4Config(dequantize=True),
  <layer>.mlp.experts.gate_up_proj_bias.loaded, down_proj_bias.loaded, router.weight.loaded, router.bias.loaded
                                                             dtype=torch.float32)`: what the model computes with
The loaded ones are float32, so a code of magnitude > 0.5 under scale byte 254 reads as inf there, as transformers
has it (docs/FLOAT_SOURCES.md section 1).

Run from the repo root, in .venv-packers (transformers 5.24.0, torch CPU; no Triton needed to dequantize):
    .venv-packers/bin/python tests/packers/make_float_gptoss_bytes.py tests/data/float
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_float_gptoss import E, H, I, LAYERS, build_float_model  # noqa: E402

NAME = "gptoss-mxfp4-bytes"
SEED = 40
EDGE_SCALES = (0, 1, 126, 127, 128, 254)
# What openai/gpt-oss-20b's config.json says (its quantization_config), the module names of this model
QUANTIZATION_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def stacked(rng: np.random.Generator, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[E, rows, k/32, 16] code bytes (every E2M1 code present) and [E, rows, k/32] UE8M0 bytes: mostly near 127,
    the edges placed in the first blocks of expert 1."""
    codes = rng.integers(0, 16, size=(E, rows, k), dtype=np.uint8)
    codes[0, 0, :16] = np.arange(16, dtype=np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(E, rows, k // 32, 16)
    scales = rng.integers(112, 136, size=(E, rows, k // 32), dtype=np.uint8)
    scales[1].reshape(-1)[:len(EDGE_SCALES)] = EDGE_SCALES
    return blocks, scales


def write(out: Path, tensors: dict[str, torch.Tensor], shards: list[list[str]], config: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: tensors[name].contiguous() for name in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    assert set(weight_map) == set(tensors), set(tensors) ^ set(weight_map)
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def truth(out: Path) -> dict[str, torch.Tensor]:
    """transformers' reading of `out`: its dequantization function on the stored tensors (float64), and the
    parameters of the model it loads with dequantize=True (float32)."""
    from safetensors.torch import load_file
    from transformers import GptOssForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    stored = {}
    for shard in sorted(out.glob("*.safetensors")):
        stored.update(load_file(shard))
    found = {}
    for name in sorted(stored):
        if name.endswith("_blocks"):
            prefix = name.removesuffix("_blocks")
            found[f"{prefix}.weight"] = _convert_moe_packed_tensors(
                stored[name], stored[f"{prefix}_scales"], dtype=torch.float64).contiguous()
    model = GptOssForCausalLM.from_pretrained(out, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32)
    for name, parameter in model.named_parameters():
        if ".mlp." in name:
            found[f"{name}.loaded"] = parameter.detach().to(torch.float32).contiguous()
    return found


def main() -> int:
    import transformers
    from safetensors.torch import load_file, save_file

    root = Path(sys.argv[1])
    rng = np.random.default_rng(SEED)
    print("versions: transformers", transformers.__version__, "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float"
        build_float_model(src)
        tensors = {}
        for shard in sorted(src.glob("*.safetensors")):
            tensors.update(load_file(shard))
        config = json.loads((src / "config.json").read_text())
    for layer in range(LAYERS):
        experts = f"model.layers.{layer}.mlp.experts"
        del tensors[f"{experts}.gate_up_proj"], tensors[f"{experts}.down_proj"]
        for projection, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks, scales = stacked(rng, rows, k)
            tensors[f"{experts}.{projection}_blocks"] = torch.from_numpy(blocks)
            tensors[f"{experts}.{projection}_scales"] = torch.from_numpy(scales)
    config["quantization_config"] = QUANTIZATION_CONFIG
    names = sorted(tensors)
    shards = [[name for name in names if "layers.0.mlp.experts.gate_up" in name],
              [name for name in names if "layers.0.mlp.experts.down" in name or "layers.1.mlp.experts.gate_up" in name],
              [name for name in names if "layers.1.mlp.experts.down" in name]]
    shards.append([name for name in names if not any(name in shard for shard in shards)])
    out = root / NAME
    shutil.rmtree(out, ignore_errors=True)
    write(out, tensors, shards, config)
    save_file(truth(out), str(root / f"{NAME}.truth.safetensors"))
    (root / "made-gptoss-bytes.json").write_text(json.dumps(
        {"fixture": NAME, "bytes": "moeconv (tests/packers/make_float_gptoss_bytes.py)",
         "truth": "transformers.integrations.mxfp4._convert_moe_packed_tensors and GptOssForCausalLM.from_pretrained "
                  "with Mxfp4Config(dequantize=True)", "transformers": transformers.__version__,
         "torch": torch.__version__, "seed": SEED}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
