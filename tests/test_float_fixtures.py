"""The float-coded fixtures in tests/data/float/ are what their producers wrote, and docs/FLOAT_SOURCES.md decodes
them exactly.

The fixtures were made by the REAL producers in their own venvs (tests/packers/make_float_llmc.py: llm-compressor
0.14.0.1 / compressed-tensors 0.19.0; tests/packers/make_float_modelopt.py: ModelOpt 0.47.0), and beside each one
lies the producer's own decompression of every expert projection (`<name>.truth.safetensors`: compressed-tensors'
compressor `decompress`, ModelOpt's `NVFP4QTensor.dequantize`) with the float weight it quantized. Here the
committed files are read with numpy alone (a safetensors header is 8 bytes of length and a JSON table), the doc's
layouts are asserted tensor by tensor, and the doc's decoding formulas, written out below independently of moeconv
and of the producers, must reproduce the producer's truth bit for bit. The same decoding with a swapped nibble
order, a multiplied global scale or a wrong exponent bias must not.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parent / "data" / "float"
LAYERS, EXPERTS, HIDDEN, INTERMEDIATE = 2, 4, 64, 32
PROJECTIONS = {"gate_proj": (INTERMEDIATE, HIDDEN), "up_proj": (INTERMEDIATE, HIDDEN),
               "down_proj": (HIDDEN, INTERMEDIATE)}
CT_NVFP4 = ("ct-nvfp4", "ct-nvfp4a16")
MX = ("ct-mxfp4a16", "ct-mxfp4-fp8block")
CT = (*CT_NVFP4, *MX)
ALL = (*CT, "modelopt-nvfp4")

# E2M1 code -> value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; code 0 and 1 are 0 and the
# subnormal 0.5.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# ModelOpt's table (qtensor/nvfp4_tensor.py e2m1_values) reads code 8 as +0.0; compressed-tensors' as -0.0
E2M1_MODELOPT = np.where(np.arange(16) == 8, 0.0, E2M1)
NUMPY_DTYPES = {"U8": np.uint8, "F8_E4M3": np.uint8, "BF16": np.uint16, "F32": np.float32, "F64": np.float64}


def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (the file's dtype string, the raw values: bf16 as uint16 bits, float8 as uint8 bytes)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    found = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        values = np.frombuffer(raw[8 + length + start:8 + length + end], NUMPY_DTYPES[entry["dtype"]])
        found[name] = (entry["dtype"], values.reshape(entry["shape"]))
    return found


def read_checkpoint(folder: Path) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """Every tensor of a sharded checkpoint, and the index's tensor -> shard map (each entry checked)."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        held = read_safetensors(folder / shard)
        assert {name for name, where in weight_map.items() if where == shard} == set(held), shard
        tensors.update(held)
    return tensors, weight_map


@pytest.fixture(scope="module")
def fixtures() -> dict[str, tuple[dict, dict, dict]]:
    """name -> (tensors, index weight map, truth tensors as plain arrays)."""
    found = {}
    for name in ALL:
        tensors, weight_map = read_checkpoint(DATA / name)
        truth = {key: values for key, (_, values) in read_safetensors(DATA / f"{name}.truth.safetensors").items()}
        found[name] = (tensors, weight_map, truth)
    return found


def expert_prefixes():
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for projection, shape in PROJECTIONS.items():
                yield f"model.layers.{layer}.mlp.experts.{expert}.{projection}", shape


def nibbles_low_first(packed: np.ndarray) -> np.ndarray:
    """(N, K/2) bytes -> (N, K) codes: element 2j in the low nibble of byte j, 2j+1 in the high one."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def nibbles_high_first(packed: np.ndarray) -> np.ndarray:
    return np.stack([packed >> 4, packed & 0x0F], axis=-1).reshape(packed.shape[0], -1)


def e4m3fn(bytes_: np.ndarray) -> np.ndarray:
    """E4M3FN byte -> exact value (float64): bias 7, exponent field 0 is subnormal m/8 * 2^-6, no infinities,
    S.1111.111 (0x7F, 0xFF) is NaN."""
    b = bytes_.astype(np.int64)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude = np.where((b & 0x7F) == 0x7F, np.nan, magnitude)
    return np.where(b & 0x80, -magnitude, magnitude)


def ue8m0(bytes_: np.ndarray) -> np.ndarray:
    """UE8M0 byte b -> 2^(b - 127) (float64, exact); 0xFF is NaN."""
    return np.where(bytes_ == 0xFF, np.nan, np.ldexp(1.0, bytes_.astype(np.int64) - 127))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_rne(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest, ties to even), returned as float32 (finite inputs)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


def per_block(scales: np.ndarray, block: int) -> np.ndarray:
    return np.repeat(scales, block, axis=1)


def decode_ct_nvfp4(tensors: dict, prefix: str, nibbles=nibbles_low_first, divide=True) -> np.ndarray:
    """compressed-tensors nvfp4-pack-quantized: bf16(code * f32(f32(scale) / weight_global_scale)), the
    arithmetic of its `_dequantize` (float32, then cast to the bf16 it unpacks to)."""
    codes = E2M1[nibbles(tensors[f"{prefix}.weight_packed"][1])].astype(np.float32)
    scale = e4m3fn(tensors[f"{prefix}.weight_scale"][1]).astype(np.float32)
    (global_scale,) = tensors[f"{prefix}.weight_global_scale"][1].astype(np.float32)
    effective = (scale / global_scale) if divide else (scale * global_scale)
    return f32_to_bf16_rne(codes * per_block(effective.astype(np.float32), 16))


def decode_ct_mxfp4(tensors: dict, prefix: str, nibbles=nibbles_low_first, bias=127) -> np.ndarray:
    """compressed-tensors mxfp4-pack-quantized: code * 2^(b - 127), exact in bf16 for these fixtures."""
    codes = E2M1[nibbles(tensors[f"{prefix}.weight_packed"][1])]
    scale = np.ldexp(1.0, tensors[f"{prefix}.weight_scale"][1].astype(np.int64) - bias)
    return f32_to_bf16_rne((codes * per_block(scale, 32)).astype(np.float32))


def decode_modelopt_nvfp4(tensors: dict, prefix: str, nibbles=nibbles_low_first, multiply=True) -> np.ndarray:
    """ModelOpt NVFP4 (modelopt_fp4): f32(code * f32(f32(weight_scale) * weight_scale_2)), the arithmetic of
    NVFP4QTensor.dequantize with a float32 output; code 8 reads as +0.0."""
    codes = E2M1_MODELOPT[nibbles(tensors[f"{prefix}.weight"][1])].astype(np.float32)
    scale = e4m3fn(tensors[f"{prefix}.weight_scale"][1]).astype(np.float32)
    scale_2 = tensors[f"{prefix}.weight_scale_2"][1].astype(np.float32)
    effective = (scale * scale_2) if multiply else (scale / scale_2)
    return (codes * per_block(effective.astype(np.float32), 16)).astype(np.float32)


DECODERS = {"ct-nvfp4": decode_ct_nvfp4, "ct-nvfp4a16": decode_ct_nvfp4, "ct-mxfp4a16": decode_ct_mxfp4,
            "ct-mxfp4-fp8block": decode_ct_mxfp4,
            "modelopt-nvfp4": decode_modelopt_nvfp4}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", CT)
def test_compressed_tensors_configs_say_what_the_doc_says(name):
    config = json.loads((DATA / name / "config.json").read_text())["quantization_config"]
    groups = {group["format"]: group for group in config["config_groups"].values()}
    mx = name in MX
    group = groups.pop("mxfp4-pack-quantized" if mx else "nvfp4-pack-quantized")
    weights = group["weights"]
    assert config["quant_method"] == "compressed-tensors" and config["version"] == "0.19.0"
    if name == "ct-mxfp4-fp8block":
        assert config["format"] == "mixed-precision" and group["targets"] == [r"re:.*mlp\.experts\..*"]
        dense = groups.pop("float-quantized")
        assert dense["targets"] == [r"re:.*self_attn\..*_proj$"]
        assert {key: dense["weights"][key] for key in ("num_bits", "type", "strategy", "block_structure",
                                                       "symmetric", "dynamic", "scale_dtype")} == {
            "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True,
            "dynamic": False, "scale_dtype": None}
        assert {key: dense["input_activations"][key] for key in ("num_bits", "strategy", "group_size", "dynamic")} == {
            "num_bits": 8, "strategy": "group", "group_size": 128, "dynamic": True}
    else:
        assert config["format"] == group["format"] and group["targets"] == ["Linear"]
    assert not groups
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (4, "float", True)
    assert (weights["group_size"], weights["strategy"], weights["scale_dtype"]) == (
        (32, "group", "torch.uint8") if mx else (16, "tensor_group", "torch.float8_e4m3fn"))
    assert sorted(config["ignore"]) == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    activations = group["input_activations"]
    if name == "ct-nvfp4":
        assert (activations["dynamic"], activations["group_size"], activations["strategy"]) == (
            "local", 16, "tensor_group")
    else:
        assert activations is None


def test_modelopt_config_says_what_the_doc_says():
    quant = json.loads((DATA / "modelopt-nvfp4" / "hf_quant_config.json").read_text())
    assert quant["producer"] == {"name": "modelopt", "version": "0.47.0"}
    assert (quant["quantization"]["quant_algo"], quant["quantization"]["group_size"]) == ("NVFP4", 16)
    assert sorted(quant["quantization"]["exclude_modules"]) == [
        "lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    config = json.loads((DATA / "modelopt-nvfp4" / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["quant_algo"]) == ("modelopt", "NVFP4")


@pytest.mark.parametrize("name", ALL)
def test_every_expert_projection_has_the_documented_tensors(fixtures, name):
    tensors, weight_map, _ = fixtures[name]
    modelopt, mx = name == "modelopt-nvfp4", name in MX
    block = 32 if mx else 16
    for prefix, (n, k) in expert_prefixes():
        found = {key[len(prefix) + 1:]: (dtype, values.shape) for key, (dtype, values) in tensors.items()
                 if key.startswith(prefix + ".")}
        if modelopt:
            expected = {"weight": ("U8", (n, k // 2)), "weight_scale": ("F8_E4M3", (n, k // block)),
                        "weight_scale_2": ("F32", ()), "input_scale": ("F32", ())}
        else:
            expected = {"weight_packed": ("U8", (n, k // 2)),
                        "weight_scale": ("U8" if mx else "F8_E4M3", (n, k // block))}
            if not mx:
                expected["weight_global_scale"] = ("F32", (1,))
            if name == "ct-nvfp4":
                expected["input_global_scale"] = ("F32", (1,))
        assert found == expected, prefix
    for layer in range(LAYERS):
        router = f"model.layers.{layer}.mlp.gate.weight"
        assert (tensors[router][0], tensors[router][1].shape) == ("BF16", (EXPERTS, HIDDEN))
        assert not any(key.startswith(f"model.layers.{layer}.mlp.gate.") and key != router for key in tensors)
    shards = {weight_map[key] for key in weight_map if ".mlp.experts." in key}
    assert len(shards) >= 2, shards


@pytest.mark.parametrize("name", ALL)
def test_the_documented_decoding_reproduces_the_producers_own_decompression_bit_for_bit(fixtures, name):
    tensors, _, truth = fixtures[name]
    for prefix, shape in expert_prefixes():
        decoded = DECODERS[name](tensors, prefix)
        assert decoded.shape == shape and truth[f"{prefix}.weight"].dtype == np.float32
        assert same_bits(decoded, truth[f"{prefix}.weight"]), prefix


WRONG_READINGS = {
    "ct-nvfp4": [lambda t, p: decode_ct_nvfp4(t, p, nibbles=nibbles_high_first),
                 lambda t, p: decode_ct_nvfp4(t, p, divide=False)],
    "ct-mxfp4a16": [lambda t, p: decode_ct_mxfp4(t, p, nibbles=nibbles_high_first),
                    lambda t, p: decode_ct_mxfp4(t, p, bias=128)],
    "modelopt-nvfp4": [lambda t, p: decode_modelopt_nvfp4(t, p, nibbles=nibbles_high_first),
                       lambda t, p: decode_modelopt_nvfp4(t, p, multiply=False)],
}


@pytest.mark.parametrize("name", list(WRONG_READINGS))
def test_a_wrong_nibble_order_or_scale_convention_does_not_reproduce_the_truth(fixtures, name):
    tensors, _, truth = fixtures[name]
    for wrong in WRONG_READINGS[name]:
        assert not any(same_bits(wrong(tensors, prefix), truth[f"{prefix}.weight"]) for prefix, _ in expert_prefixes())


def block_scales(name: str, tensors: dict, prefix: str) -> np.ndarray:
    """Each block's effective scale (float64, exact from the bytes), repeated over its elements."""
    if name in MX:
        return per_block(ue8m0(tensors[f"{prefix}.weight_scale"][1]), 32)
    scale = e4m3fn(tensors[f"{prefix}.weight_scale"][1])
    if name == "modelopt-nvfp4":
        return per_block(scale * float(tensors[f"{prefix}.weight_scale_2"][1]), 16)
    return per_block(scale / float(tensors[f"{prefix}.weight_global_scale"][1][0]), 16)


@pytest.mark.parametrize("name", ALL)
def test_the_decoded_weights_are_the_float_weights_quantized(fixtures, name):
    """Against the weights before quantization (bf16), not the producer's reading: every element within one step
    of its block's scale (half the widest E2M1 gap, 4 to 6) or, where the block's max exceeds 6 steps (a power-of-two
    or E4M3-rounded scale), within that excess (the clamp at 6), plus the bf16 rounding of the output; and the codes
    correlate with the weights only in the documented nibble order."""
    tensors, _, truth = fixtures[name]
    block = 32 if name in MX else 16
    for prefix, _ in expert_prefixes():
        original = bf16_bits_to_f32(truth[f"{prefix}.float_weight"]).astype(np.float64)
        decoded = DECODERS[name](tensors, prefix).astype(np.float64)
        scale = block_scales(name, tensors, prefix)
        amax = per_block(np.abs(original).reshape(original.shape[0], -1, block).max(axis=-1), block)
        bound = np.maximum(scale, amax - 6 * scale) + 2 ** -8 * np.abs(decoded)
        assert (np.abs(decoded - original) <= bound).all(), prefix
        assert np.linalg.norm(decoded - original) / np.linalg.norm(original) < 0.2, prefix
        codes = tensors[f"{prefix}.weight" if name == "modelopt-nvfp4" else f"{prefix}.weight_packed"][1]
        swapped = E2M1[nibbles_high_first(codes)]
        assert np.corrcoef(swapped.ravel(), original.ravel())[0, 1] < 0.5 < np.corrcoef(
            E2M1[nibbles_low_first(codes)].ravel(), original.ravel())[0, 1], prefix


@pytest.mark.parametrize("name", ALL)
def test_the_fixtures_exercise_the_scale_encodings_edges(fixtures, name):
    """Small blocks give E4M3 subnormal scale bytes (exponent field 0) and low UE8M0 exponents; no NaN bytes;
    negative zero codes (0x8) occur, which ModelOpt reads as +0.0 and compressed-tensors as -0.0."""
    tensors, _, truth = fixtures[name]
    modelopt = name == "modelopt-nvfp4"
    scales = np.concatenate([tensors[f"{p}.weight_scale"][1].ravel() for p, _ in expert_prefixes()])
    if name in MX:
        assert scales.max() < 0xFF and scales.min() <= 110
        assert not np.isnan(ue8m0(scales)).any()
    else:
        assert ((scales & 0x78) == 0).any() and not ((scales & 0x7F) == 0x7F).any() and not (scales == 0).any()
        assert not np.isnan(e4m3fn(scales)).any()
    negative_zeros = 0
    for prefix, _ in expert_prefixes():
        codes = nibbles_low_first(tensors[f"{prefix}.weight" if modelopt else f"{prefix}.weight_packed"][1])
        zeros = truth[f"{prefix}.weight"][codes == 8]
        negative_zeros += zeros.size
        assert (zeros == 0).all() and bool(np.signbit(zeros).all()) is not modelopt, prefix
    assert negative_zeros > 0


@pytest.mark.parametrize("name", CT_NVFP4)
def test_compressed_tensors_global_scale_is_2688_over_the_amax_shared_by_gate_and_up(fixtures, name):
    """weight_global_scale = 448 * 6 / amax(W), computed in the weight's bf16 (so within a bf16 step of the
    float32 quotient), one per gate/up pair; the block scales are E4M3(global * block_amax / 6)."""
    tensors, _, truth = fixtures[name]
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            base = f"model.layers.{layer}.mlp.experts.{expert}"
            amax = {p: np.abs(bf16_bits_to_f32(truth[f"{base}.{p}.float_weight"])).max() for p in PROJECTIONS}
            scale = {p: float(tensors[f"{base}.{p}.weight_global_scale"][1][0]) for p in PROJECTIONS}
            assert scale["gate_proj"] == scale["up_proj"], base
            for projection, group_amax in (("gate_proj", max(amax["gate_proj"], amax["up_proj"])),
                                           ("down_proj", amax["down_proj"])):
                assert abs(scale[projection] * group_amax / 2688 - 1) < 2 ** -7, (base, projection)
            if name == "ct-nvfp4":
                inputs = {p: float(tensors[f"{base}.{p}.input_global_scale"][1][0]) for p in PROJECTIONS}
                assert inputs["gate_proj"] == inputs["up_proj"] > 0, base


def test_modelopt_weight_scale_2_is_the_amax_over_2688_shared_by_gate_and_up(fixtures):
    """weight_scale_2 = float32(amax(W) / (6 * 448)), the reciprocal convention of compressed-tensors' global
    scale; the exporter gives gate and up one amax (their maximum), and one input_scale."""
    tensors, _, truth = fixtures["modelopt-nvfp4"]
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            base = f"model.layers.{layer}.mlp.experts.{expert}"
            amax = {p: np.abs(bf16_bits_to_f32(truth[f"{base}.{p}.float_weight"])).max() for p in PROJECTIONS}
            scale_2 = {p: tensors[f"{base}.{p}.weight_scale_2"][1] for p in PROJECTIONS}
            for projection, group_amax in (("gate_proj", max(amax["gate_proj"], amax["up_proj"])),
                                           ("up_proj", max(amax["gate_proj"], amax["up_proj"])),
                                           ("down_proj", amax["down_proj"])):
                assert scale_2[projection] == np.float32(group_amax) / np.float32(2688), (base, projection)
            inputs = {p: float(tensors[f"{base}.{p}.input_scale"][1]) for p in PROJECTIONS}
            assert inputs["gate_proj"] == inputs["up_proj"] > 0, base


@pytest.mark.parametrize("name", MX)
def test_compressed_tensors_mx_scale_byte_is_the_rounded_block_amax_exponent_less_two(fixtures, name):
    """MXFP4 scale byte = the biased exponent of the block amax (bf16) rounded up to the next power of two when its
    mantissa is 0.75 or more (mxfp_utils.round_to_power_2 adds 2^-2 of the mantissa, then masks it), less 2 (E2M1's
    largest exponent): so the block's max lands between 3.5 and 7 steps, clamped at 6."""
    tensors, _, truth = fixtures[name]
    for prefix, _ in expert_prefixes():
        bits = truth[f"{prefix}.float_weight"].astype(np.int64) & 0x7FFF
        amax_bits = bits.reshape(bits.shape[0], -1, 32).max(axis=-1)
        expected = (((amax_bits + (1 << 5)) >> 7) & 0xFF) - 2
        assert np.array_equal(tensors[f"{prefix}.weight_scale"][1].astype(np.int64), expected), prefix


ATTENTION = {"q_proj": (64, HIDDEN), "k_proj": (32, HIDDEN), "v_proj": (32, HIDDEN), "o_proj": (HIDDEN, 64)}


def decode_ct_fp8_block(tensors: dict, prefix: str, block: int = 128) -> np.ndarray:
    """compressed-tensors float-quantized, block strategy: bf16(E4M3(weight) * weight_scale), one bf16 scale per
    block x block tile (a partial tile at the edges), the product exact in float32 and rounded once to bf16."""
    values = e4m3fn(tensors[f"{prefix}.weight"][1]).astype(np.float32)
    scale = bf16_bits_to_f32(tensors[f"{prefix}.weight_scale"][1])
    tiles = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:values.shape[0], :values.shape[1]]
    return f32_to_bf16_rne(values * tiles)


def test_the_mixed_checkpoints_fp8_block_linears_are_what_the_doc_says(fixtures):
    """MXFP4 experts beside FP8-block attention in one compressed-tensors checkpoint: each attention projection is
    `weight` F8_E4M3 (N, K) and `weight_scale` BF16 (ceil(N/128), ceil(K/128)), the scale amax/448 of its tile; the
    documented decoding reproduces the float-quantized compressor's decompression bit for bit."""
    tensors, _, truth = fixtures["ct-mxfp4-fp8block"]
    for layer in range(LAYERS):
        for projection, (n, k) in ATTENTION.items():
            prefix = f"model.layers.{layer}.self_attn.{projection}"
            found = {key[len(prefix) + 1:]: (dtype, values.shape) for key, (dtype, values) in tensors.items()
                     if key.startswith(prefix + ".")}
            assert found == {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("BF16", (-(-n // 128), -(-k // 128)))}
            assert same_bits(decode_ct_fp8_block(tensors, prefix), truth[f"{prefix}.weight"]), prefix
            original = bf16_bits_to_f32(truth[f"{prefix}.float_weight"]).astype(np.float64)
            (scale,) = bf16_bits_to_f32(tensors[f"{prefix}.weight_scale"][1]).ravel()
            assert abs(scale * 448 / np.abs(original).max() - 1) < 2 ** -7, prefix
            decoded = truth[f"{prefix}.weight"].astype(np.float64)
            bound = 2 ** -4 * np.abs(original) + 2 ** -8 * np.abs(decoded) + scale * 2 ** -10
            assert (np.abs(decoded - original) <= bound).all(), prefix


def test_transformers_cpu_save_claims_mxfp4_over_bf16_tensors():
    """gptoss-cpu-dequantized: what transformers 5.24.0 saves on CPU for `Mxfp4Config()` without use_kernels (it
    dequantizes on load, with a warning): a `quant_method: mxfp4` config over bf16 stacked experts, with no
    `*_blocks` / `*_scales` at all. A real producer's output that a reader taking the config's word would misread."""
    folder = DATA / "gptoss-cpu-dequantized"
    hidden, intermediate = 96, 32
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": None}
    tensors, weight_map = read_checkpoint(folder)
    assert not any(name.endswith(("_blocks", "_scales")) for name in tensors)
    assert {dtype for dtype, _ in tensors.values()} == {"BF16"}
    for layer in range(LAYERS):
        base = f"model.layers.{layer}.mlp."
        found = {name[len(base):]: values.shape for name, (_, values) in tensors.items() if name.startswith(base)}
        assert found == {"experts.gate_up_proj": (EXPERTS, hidden, 2 * intermediate),
                         "experts.gate_up_proj_bias": (EXPERTS, 2 * intermediate),
                         "experts.down_proj": (EXPERTS, intermediate, hidden),
                         "experts.down_proj_bias": (EXPERTS, hidden),
                         "router.weight": (EXPERTS, hidden), "router.bias": (EXPERTS,)}, layer
    assert len({weight_map[name] for name in weight_map if ".mlp.experts." in name}) >= 2
