"""tests/data/float/dsv4-fp4-bytes is laid out as docs/FLOAT_SOURCES.md section 6 says, and that layout decodes to
what transformers' own DeepSeek-V4 reader makes of it, bit for bit.

The quantized bytes were written by moeconv's packer script (tests/packers/make_float_dsv4_bytes.py: no producer of
DeepSeek-V4's FP4-expert checkpoints runs here); the truth beside them (`dsv4-fp4-bytes.truth.safetensors`) is
transformers 5.24.0's reading of those files: `Fp8Dequantize._dequantize_one` of every stored linear, and the
parameters `DeepseekV4ForCausalLM.from_pretrained` loads on a CPU (dequantized). Here the files are read with numpy
alone and decoded with the doc's formulas, written out independently of moeconv and of transformers.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from test_float_fixtures import DATA, E2M1, e4m3fn, nibbles_high_first, nibbles_low_first

NAME = "dsv4-fp4-bytes"
LAYERS, EXPERTS, HIDDEN, INTERMEDIATE = 2, 4, 128, 64
EXPERT_SHAPES = {"w1": (INTERMEDIATE, HIDDEN), "w3": (INTERMEDIATE, HIDDEN), "w2": (HIDDEN, INTERMEDIATE)}
# DeepSeek-native dense linears and transformers' names for them (its conversion_mapping.py "deepseek_v4")
DENSE = {"attn.wq_a": "self_attn.q_a_proj", "attn.wq_b": "self_attn.q_b_proj", "attn.wkv": "self_attn.kv_proj",
         "attn.wo_a": "self_attn.o_a_proj", "attn.wo_b": "self_attn.o_b_proj",
         "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj", "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
         "ffn.shared_experts.w3": "mlp.shared_experts.up_proj"}
RAW = {"I8": np.uint8, "U8": np.uint8, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "BF16": np.uint16,
       "F32": np.float32, "I64": np.int64}


def read(path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype string, raw values: 1-byte dtypes as uint8, bf16 as uint16 bits)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    found = {}
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            found[name] = (entry["dtype"], np.frombuffer(raw[8 + length + start:8 + length + end],
                                                         RAW[entry["dtype"]]).reshape(entry["shape"]))
    return found


@pytest.fixture(scope="module")
def fixture():
    folder = DATA / NAME
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        held = read(folder / shard)
        assert {name for name, where in weight_map.items() if where == shard} == set(held), shard
        tensors.update(held)
    truth = {name: values for name, (_, values) in read(DATA / f"{NAME}.truth.safetensors").items()}
    config = json.loads((folder / "config.json").read_text())
    return tensors, weight_map, truth, config


def ue8m0(bytes_: np.ndarray, bias: int = 127) -> np.ndarray:
    return np.ldexp(1.0, bytes_.astype(np.int64) - bias)


def decode_fp4_expert(tensors, prefix: str, nibbles=nibbles_low_first, bias: int = 127) -> np.ndarray:
    """E2M1(code) * 2^(b - 127), one scale per 32 inputs of a row, in float32 (transformers' output dtype here)."""
    codes = E2M1[nibbles(tensors[f"{prefix}.weight"][1])]
    with np.errstate(over="ignore"):  # past float32's range is inf, as in transformers' float32 product
        return (codes * np.repeat(ue8m0(tensors[f"{prefix}.scale"][1], bias), 32, axis=1)).astype(np.float32)


def decode_fp8_dense(tensors, prefix: str) -> np.ndarray:
    """E4M3FN(byte) * 2^(b - 127), one scale per 128 x 128 tile (partial tiles at the edges count), float32."""
    weight = e4m3fn(tensors[f"{prefix}.weight"][1])
    scale = np.repeat(np.repeat(ue8m0(tensors[f"{prefix}.scale"][1]), 128, axis=0), 128, axis=1)
    return (weight * scale[:weight.shape[0], :weight.shape[1]]).astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32), b.view(np.uint32))


def test_the_config_is_deepseeks_fp8_config_with_fp4_experts(fixture):
    config = fixture[3]
    assert config["model_type"] == "deepseek_v4" and config["expert_dtype"] == "fp4"
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}


def test_every_linear_has_the_documented_tensors(fixture):
    tensors, weight_map = fixture[0], fixture[1]
    split = 0
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for w, (n, k) in EXPERT_SHAPES.items():
                prefix = f"layers.{layer}.ffn.experts.{expert}.{w}"
                assert (tensors[f"{prefix}.weight"][0], tensors[f"{prefix}.weight"][1].shape) == ("I8", (n, k // 2))
                assert (tensors[f"{prefix}.scale"][0], tensors[f"{prefix}.scale"][1].shape) == ("F8_E8M0", (n, k // 32))
                split += weight_map[f"{prefix}.weight"] != weight_map[f"{prefix}.scale"]
        for native in DENSE:
            weight, scale = tensors[f"layers.{layer}.{native}.weight"], tensors[f"layers.{layer}.{native}.scale"]
            n, k = weight[1].shape
            assert weight[0] == "F8_E4M3" and scale[0] == "F8_E8M0"
            assert scale[1].shape == (-(-n // 128), -(-k // 128))
        assert tensors[f"layers.{layer}.ffn.gate.weight"][0] == "BF16"  # the router stays unquantized
    assert split == 2 * 3 + 4 * 3  # layer 0's experts 2-3 and all of layer 1: weight and scale in two shards
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn"} <= set(tensors)
    assert not any(name.startswith("model.") for name in tensors)


def test_the_documented_decoding_is_transformers_dequantization_bit_for_bit(fixture):
    tensors, _, truth, _ = fixture
    checked = 0
    for name in tensors:
        if name.endswith(".weight") and name.removesuffix("weight") + "scale" in tensors:
            prefix = name.removesuffix(".weight")
            decoded = decode_fp4_expert(tensors, prefix) if ".experts." in name else decode_fp8_dense(tensors, prefix)
            assert same_bits(decoded, truth[f"{name}.dequant"]), name
            checked += 1
    assert checked == LAYERS * (EXPERTS * 3 + len(DENSE))


def test_a_wrong_nibble_order_or_exponent_bias_does_not_reproduce_it(fixture):
    tensors, _, truth, _ = fixture
    prefix = "layers.0.ffn.experts.0.w1"
    assert not same_bits(decode_fp4_expert(tensors, prefix, nibbles=nibbles_high_first), truth[f"{prefix}.weight.dequant"])
    assert not same_bits(decode_fp4_expert(tensors, prefix, bias=128), truth[f"{prefix}.weight.dequant"])


def test_the_loaded_model_stacks_w1_then_w3_not_interleaved(fixture):
    """transformers' model holds gate_up_proj [E, 2I, H] as w1's rows then w3's (MergeModulelist, Concatenate on
    dim 1), down_proj [E, H, I] as w2: contiguous halves, unlike gpt-oss's interleaved rows."""
    tensors, _, truth, _ = fixture
    for layer in range(LAYERS):
        gate_up = truth[f"model.layers.{layer}.mlp.experts.gate_up_proj.loaded"]
        down = truth[f"model.layers.{layer}.mlp.experts.down_proj.loaded"]
        assert gate_up.shape == (EXPERTS, 2 * INTERMEDIATE, HIDDEN) and down.shape == (EXPERTS, HIDDEN, INTERMEDIATE)
        for expert in range(EXPERTS):
            prefix = f"layers.{layer}.ffn.experts.{expert}"
            w1, w3 = (decode_fp4_expert(tensors, f"{prefix}.{w}") for w in ("w1", "w3"))
            assert same_bits(np.concatenate([w1, w3]), gate_up[expert])
            assert not same_bits(np.stack([w1, w3], axis=1).reshape(2 * INTERMEDIATE, HIDDEN), gate_up[expert])
            assert same_bits(decode_fp4_expert(tensors, f"{prefix}.w2"), down[expert])
        for native, name in DENSE.items():
            assert same_bits(decode_fp8_dense(tensors, f"layers.{layer}.{native}"),
                             truth[f"model.layers.{layer}.{name}.weight.loaded"]), native


def test_the_fixture_exercises_every_code_and_the_scale_edges(fixture):
    tensors, _, truth, _ = fixture
    codes = nibbles_low_first(tensors["layers.0.ffn.experts.0.w1.weight"][1])
    assert set(np.unique(codes)) == set(range(16))
    edges = tensors["layers.0.ffn.experts.1.w1.scale"][1].reshape(-1)[:6]
    assert list(edges) == [0, 1, 126, 127, 128, 254]
    # scale byte 254 (2^127) times a code above 0.5 is past float32's range: inf in transformers' float32 output
    loaded = truth["model.layers.0.mlp.experts.gate_up_proj.loaded"][1]
    assert np.isinf(loaded).any() and not np.isnan(loaded).any()
    assert not any(values.dtype == np.uint8 and (values == 0xFF).any()
                   for name, (dtype, values) in tensors.items() if dtype == "F8_E8M0")
