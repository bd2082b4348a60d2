"""Make tests/data/float/dsv4-fp4-bytes: a DeepSeek-V4 checkpoint with FP4 routed experts beside FP8-block dense
linears (`expert_dtype: fp4` under an FP8 config), whose quantized BYTES moeconv makes, and whose truth is
transformers' own DeepSeek-V4 reader (docs/FLOAT_SOURCES.md section 6).

No producer of this layout runs here: DeepSeek's own release was quantized by DeepSeek, and transformers 5.24.0 and
vLLM 0.33.0 only read it (transformers quantizes FP8 on the fly on a GPU only, `FineGrainedFP8HfQuantizer
.validate_environment`). So the quantized tensors are written here in the layout both readers take:
  layers.L.ffn.experts.E.w{1,3}.weight  I8 [I, H/2]     two E2M1 codes a byte, element 2j in the low nibble
  layers.L.ffn.experts.E.w{1,3}.scale   F8_E8M0 [I, H/32]  one UE8M0 scale per 32 inputs of a row
  layers.L.ffn.experts.E.w2.weight      I8 [H, I/2], .scale F8_E8M0 [H, I/32]
  every other linear (attn.wq_a, wq_b, wkv, wo_a, wo_b; ffn.shared_experts.w1..w3): .weight F8_E4M3 [N, K] and
      .scale F8_E8M0 [ceil(N/128), ceil(K/128)], one scale per 128 x 128 tile
  config.json: `"expert_dtype": "fp4"` at the top, `quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
      "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}`
These are the names and dtypes transformers' reader maps (`conversion_mapping.py` "deepseek_v4", its FP8 quantizer's
`.scale` -> `weight_scale_inv` renaming, `integrations/finegrained_fp8.py` `FP8Experts` with expert_dtype "fp4",
`Fp8Dequantize`) and vLLM 0.33's loader maps (`vllm/models/deepseek_v4/cpu/model.py`
`_make_deepseek_v4_weights_mapper("fp4")`, `vllm/models/deepseek_v4/quant_config.py`). The codes are random (all 16
E2M1 codes occur; FP8 bytes avoid the NaN bytes 0x7F and 0xFF), the expert scale bytes mostly near 127 with the
edges 0, 1, 126, 127, 128, 254 in expert 1 (not 0xFF, NaN in E8M0); the dense tiles' scale bytes are 110..130.
Everything else (embeddings, norms, router weight and bias, hyper-connection parameters, attention sinks, head) is
what transformers 5.24.0 saves for a seeded random bf16 DeepseekV4ForCausalLM (2 layers, 4 routed experts and one
shared, hidden 128, moe_intermediate 64, sliding-window attention layers only, no MTP), under the DeepSeek-native
names those two readers map from (`embed.weight`, `layers.L.*`, `norm.weight`, `head.weight`, `hc_head_*`).

The truth beside it (`dsv4-fp4-bytes.truth.safetensors`) is transformers' reading of the files just written:
  <stored name>.dequant  F32  `Fp8Dequantize._dequantize_one(weight, scale, output_dtype=torch.float32)` of every
                              quantized linear as stored (FP4 experts and FP8 dense alike)
  <parameter>.loaded     F32  the parameters of `DeepseekV4ForCausalLM.from_pretrained(fixture, dtype=torch.float32)`
                              on this CPU (the FP8 quantizer then dequantizes: no GPU), for every expert, shared
                              expert and attention projection: `model.layers.L.mlp.experts.gate_up_proj` [E, 2I, H]
                              (w1 rows, then w3 rows), `down_proj` [E, H, I]
A code above 0.5 under scale byte 254 is inf in float32, as transformers has it.

Run from the repo root, in .venv-packers (transformers 5.24.0, torch 2.13 CPU):
    .venv-packers/bin/python tests/packers/make_float_dsv4_bytes.py tests/data/float
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

NAME = "dsv4-fp4-bytes"
SEED = 46
LAYERS, E, H, I = 2, 4, 128, 64
EDGE_SCALES = (0, 1, 126, 127, 128, 254)
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128]}
EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
DENSE = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$")


def config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=256, hidden_size=H, moe_intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, q_lora_rank=64, n_routed_experts=E, n_shared_experts=1,
        num_experts_per_tok=2, hc_mult=2, o_groups=2, o_lora_rank=64, index_n_heads=2, index_head_dim=32,
        index_topk=8, num_nextn_predict_layers=0, sliding_window=16, max_position_embeddings=256,
        layer_types=["sliding_attention"] * LAYERS, mlp_layer_types=["moe"] * LAYERS)


def native(name: str) -> str:
    """transformers' saved name -> DeepSeek's own (what `conversion_mapping.py` "deepseek_v4" maps from:
    `^embed\\.weight`, `^head\\.weight`, `^hc_head_fn`, ...; vLLM's mapper likewise takes `layers.`, `embed.`,
    `norm.`, `hc_head`)."""
    name = name.removeprefix("model.")
    return {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
            "hc_head.hc_scale": "hc_head_scale"}.get(name, name)


def fp4_expert(rng: np.random.Generator, n: int, k: int, expert: int) -> tuple[np.ndarray, np.ndarray]:
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    codes[0, :16] = np.arange(16, dtype=np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = rng.integers(112, 136, size=(n, k // 32), dtype=np.uint8)
    if expert == 1:
        scales.reshape(-1)[:len(EDGE_SCALES)] = EDGE_SCALES
    return packed.view(np.int8), scales


def fp8_dense(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    weight = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0x3F  # no NaN byte
    scales = rng.integers(110, 131, size=(-(-n // 128), -(-k // 128)), dtype=np.uint8)
    return weight, scales


def truth(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    stored = {}
    for shard in sorted(out.glob("*.safetensors")):
        stored.update(load_file(shard))
    dequantize = Fp8Dequantize(hf_quantizer=None)
    found = {}
    for name in sorted(stored):
        if name.endswith(".weight") and name.removesuffix("weight") + "scale" in stored:
            found[f"{name}.dequant"] = dequantize._dequantize_one(
                stored[name], stored[name.removesuffix("weight") + "scale"], output_dtype=torch.float32).contiguous()
    model = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, parameter in model.named_parameters():
        if ".mlp." in name or ".self_attn." in name:
            found[f"{name}.loaded"] = parameter.detach().to(torch.float32).contiguous()
    return found


def main() -> int:
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    root = Path(sys.argv[1])
    rng = np.random.default_rng(SEED)
    print("versions: transformers", transformers.__version__, "torch", torch.__version__)
    torch.manual_seed(SEED)
    model = DeepseekV4ForCausalLM(config()).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            saved.update(load_file(shard))
        config_json = json.loads((Path(tmp) / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(saved.items()):
        name = native(name)
        if EXPERT.match(name):
            expert = int(name.split(".")[4])
            packed, scales = fp4_expert(rng, tensor.shape[0], tensor.shape[1], expert)
            tensors[name] = torch.from_numpy(packed)
            tensors[name.removesuffix("weight") + "scale"] = torch.from_numpy(scales).view(torch.float8_e8m0fnu)
        elif DENSE.match(name):
            weight, scales = fp8_dense(rng, tensor.shape[0], tensor.shape[1])
            tensors[name] = torch.from_numpy(weight).view(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "scale"] = torch.from_numpy(scales).view(torch.float8_e8m0fnu)
        else:
            tensors[name] = tensor
    config_json["quantization_config"] = QUANTIZATION_CONFIG
    config_json["expert_dtype"] = "fp4"
    names = sorted(tensors)
    # layer 0's experts over two shards; experts 2-3 of layer 0 and all of layer 1 with weight and scale in different
    # shards
    def pick(pattern: str) -> list[str]:
        return [n for n in names if re.match(pattern, n)]
    shards = [pick(r"layers\.0\.ffn\.experts\.[01]\."),
              pick(r"layers\.0\.ffn\.experts\.[23]\..*weight$") + pick(r"layers\.1\.ffn\.experts\..*scale$"),
              pick(r"layers\.1\.ffn\.experts\..*weight$") + pick(r"layers\.0\.ffn\.experts\.[23]\..*scale$")]
    taken = {n for shard in shards for n in shard}
    shards.append([n for n in names if n not in taken])
    out = root / NAME
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    assert set(weight_map) == set(tensors), set(tensors) ^ set(weight_map)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    save_file(truth(out), str(root / f"{NAME}.truth.safetensors"))
    (root / "made-dsv4-bytes.json").write_text(json.dumps(
        {"fixture": NAME, "bytes": "moeconv (tests/packers/make_float_dsv4_bytes.py)",
         "truth": "transformers.integrations.finegrained_fp8.Fp8Dequantize._dequantize_one and "
                  "DeepseekV4ForCausalLM.from_pretrained on CPU (FineGrainedFP8 dequantize)",
         "transformers": transformers.__version__, "torch": torch.__version__, "seed": SEED}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
