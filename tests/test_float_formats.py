"""The float-coded source formats (compressed-tensors nvfp4/mxfp4-pack-quantized, ModelOpt NVFP4) read the real
fixtures in tests/data/float exactly: moeconv's reading of every linear (codes, scale bytes, global scales and their
convention) put through each producer's own arithmetic, written out in tests/test_float_fixtures.py independently of
moeconv, equals the producer's decompression (`<fixture>.truth.safetensors`) bit for bit; round trips with the edge
bytes; and every input that cannot be read is refused naming the file and the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.float_codes import DIVIDE, MULTIPLY, MXFP4, FloatWeight, nvfp4
from moeconv.formats import CompressedTensorsFloat, ModelOptNvfp4
from moeconv.formats.compressed_tensors_float import MXFP4_FORMAT
from moeconv.survey import survey
from test_float_codes import float_weights
from test_float_fixtures import (ALL, DATA, E2M1, E2M1_MODELOPT, MX, e4m3fn, expert_prefixes, f32_to_bf16_rne,
                                 read_safetensors, same_bits)

SCHEMES = {"ct-nvfp4": ("NVFP4", nvfp4(DIVIDE, True)), "ct-nvfp4a16": ("NVFP4A16", nvfp4(DIVIDE, False)),
           "ct-mxfp4a16": ("MXFP4A16", MXFP4), "ct-mxfp4-fp8block": ("MXFP4A16", MXFP4),
           "modelopt-nvfp4": (None, nvfp4(MULTIPLY, True))}


def producer_reading(name: str, weight: FloatWeight) -> np.ndarray:
    """The producer's own arithmetic on moeconv's reading (docs/FLOAT_SOURCES.md): compressed-tensors
    bf16(c * f32(s / g)) for NVFP4 and bf16(c * 2^(b - 127)) for MXFP4, ModelOpt f32(c * f32(s * s2)) with code
    0x8 as +0.0. The codes and scale bytes are moeconv's; the tables and the rounding are the test's."""
    block = weight.scheme.block
    if name in MX:
        scale = np.ldexp(1.0, weight.scales.astype(np.int64) - 127)
        return f32_to_bf16_rne((E2M1[weight.codes] * np.repeat(scale, block, axis=1)).astype(np.float32))
    scale = e4m3fn(weight.scales).astype(np.float32)
    if name == "modelopt-nvfp4":
        assert weight.scheme.global_convention == MULTIPLY
        effective = (scale * weight.global_scale).astype(np.float32)
        return (E2M1_MODELOPT[weight.codes].astype(np.float32) * np.repeat(effective, block, axis=1)).astype(np.float32)
    assert weight.scheme.global_convention == DIVIDE
    effective = (scale / weight.global_scale).astype(np.float32)
    return f32_to_bf16_rne(E2M1[weight.codes].astype(np.float32) * np.repeat(effective, block, axis=1))


def read_linears(folder: Path, prefixes: list[str], source_format) -> dict[str, FloatWeight]:
    checkpoint = open_checkpoint(folder)
    suffixes = source_format.suffixes()
    with TensorReader() as reader:
        return {prefix: source_format.decode({suffix: reader.read_raw(checkpoint.tensors[f"{prefix}.{suffix}"])
                                              for suffix in suffixes}) for prefix in prefixes}


@pytest.mark.parametrize("name", ALL)
def test_moeconv_reads_every_fixture_as_its_producer_does_bit_for_bit(name):
    found = survey(open_checkpoint(DATA / name))
    scheme_name, scheme = SCHEMES[name]
    assert found.source_format.float_scheme == scheme and not found.detection.disagreements
    assert isinstance(found.source_format, ModelOptNvfp4 if name == "modelopt-nvfp4" else CompressedTensorsFloat)
    if scheme_name:
        assert found.source_format.describe()["scheme"] == scheme_name
    assert all(layer.shape.float_scheme == scheme and layer.shape.scale_dtype == scheme.scale_dtype
               for layer in found.layers)
    truth = {key: values for key, (_, values) in read_safetensors(DATA / f"{name}.truth.safetensors").items()}
    prefixes = [prefix for prefix, _ in expert_prefixes()]
    weights = read_linears(DATA / name, prefixes, found.source_format)
    for prefix in prefixes:
        exact, produced = weights[prefix].dequantize(), truth[f"{prefix}.weight"]
        assert same_bits(producer_reading(name, weights[prefix]), produced), prefix
        rounding = 2.0 ** -8 if name.startswith("ct-") else 2.0 ** -22  # bf16 once; float32 twice
        assert np.all(np.abs(exact - produced) <= rounding * np.abs(exact)), prefix
        assert np.array_equal(exact == 0, produced == 0), prefix


@pytest.mark.parametrize("name", ["ct-nvfp4", "modelopt-nvfp4"])
def test_the_quantized_attention_linears_read_as_the_format_s_dense_linears(name):
    """The NVFP4 fixtures quantize attention too (targets Linear): those are dense linears of the same format."""
    found = survey(open_checkpoint(DATA / name))
    prefixes = [f"model.layers.{layer}.self_attn.{p}" for layer in range(2) for p in ("q_proj", "k_proj", "v_proj",
                                                                                       "o_proj")]
    weights = read_linears(DATA / name, prefixes, found.source_format)
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64)}
    for prefix, weight in weights.items():
        assert weight.scheme == found.source_format.float_scheme, prefix
        assert weight.codes.shape == shapes[prefix.rsplit(".", 1)[1]] and np.isfinite(weight.dequantize()).all()


@pytest.mark.parametrize("cls, scheme", [(CompressedTensorsFloat(format=MXFP4_FORMAT), MXFP4),
                                         (CompressedTensorsFloat(), nvfp4(DIVIDE, False)),
                                         (CompressedTensorsFloat(input_scale=True), nvfp4(DIVIDE, True)),
                                         (ModelOptNvfp4(), nvfp4(MULTIPLY, True))], ids=str)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_each_format_writes_and_reads_back_every_byte(cls, scheme, data):
    """encode then decode: the same codes and scale bytes (the edges forced in) and the same global
    scales; a weight in the other convention is written exactly where its reciprocal is a float32, else refused."""
    assert cls.float_scheme == scheme
    weight = data.draw(float_weights(scheme))
    try:
        stored = cls.encode(weight)
    except ValueError as error:
        assert "no exact float32 reciprocal" in str(error)
        return
    decoded = cls.decode(stored)
    assert decoded.mismatch(weight) is None and decoded.scheme == scheme
    other = weight.in_convention(MULTIPLY if scheme.global_convention == DIVIDE else DIVIDE) \
        if scheme.global_convention and np.frexp(float(weight.global_scale))[0] == 0.5 and (
            weight.input_scale is None or np.frexp(float(weight.input_scale))[0] == 0.5) else weight
    assert cls.decode(cls.encode(other)).mismatch(weight) is None


def stored_linear(name: str, prefix: str) -> dict[str, np.ndarray]:
    checkpoint = open_checkpoint(DATA / name)
    with TensorReader() as reader:
        return {entry.name.rsplit(".", 1)[1]: reader.read_raw(entry).copy() for key, entry in checkpoint.tensors.items()
                if key.rsplit(".", 1)[0] == prefix}


BAD_BYTES = [("ct-mxfp4a16", CompressedTensorsFloat(format=MXFP4_FORMAT), "weight_scale", 0xFF, "UE8M0 reserves"),
             ("ct-nvfp4a16", CompressedTensorsFloat(), "weight_scale", 0x7F, "E4M3 reserves"),
             ("ct-nvfp4a16", CompressedTensorsFloat(), "weight_scale", 0xFF, "E4M3 reserves"),
             ("modelopt-nvfp4", ModelOptNvfp4(), "weight_scale", 0xFF, "E4M3 reserves")]


@pytest.mark.parametrize("name, fmt, suffix, byte, said", BAD_BYTES)
def test_a_reserved_scale_byte_is_refused_naming_the_tensor(name, fmt, suffix, byte, said):
    stored = stored_linear(name, "model.layers.1.mlp.experts.2.down_proj")
    stored[suffix][3, 0] = byte
    with pytest.raises(MoeconvError, match=f"^{suffix} holds 1 scale byte.*{said} for NaN .0x{byte:02X} at .3, 0.."):
        fmt.decode(stored)


@pytest.mark.parametrize("name, fmt, suffix", [("ct-nvfp4", CompressedTensorsFloat(input_scale=True),
                                                "weight_global_scale"),
                                               ("ct-nvfp4", CompressedTensorsFloat(input_scale=True),
                                                "input_global_scale"),
                                               ("modelopt-nvfp4", ModelOptNvfp4(), "weight_scale_2"),
                                               ("modelopt-nvfp4", ModelOptNvfp4(), "input_scale")])
@pytest.mark.parametrize("value", [0.0, -0.0, np.inf, -np.inf, np.nan])
def test_a_zero_or_non_finite_global_scale_is_refused_naming_the_tensor(name, fmt, suffix, value):
    stored = stored_linear(name, "model.layers.0.mlp.experts.1.gate_proj")
    stored[suffix] = np.full_like(stored[suffix], value)
    with pytest.raises(MoeconvError, match=f"^{suffix} is (0|-?inf|nan)"):
        fmt.decode(stored)


CT_CONFIG_REFUSALS = [
    (lambda group: group["weights"].update(group_size=32), "weights.group_size is 32; nvfp4-pack-quantized stores 16"),
    (lambda group: group["weights"].update(dynamic=True), "weights.dynamic is true"),
    (lambda group: group["weights"].update(symmetric=False), "weights.symmetric is False"),
    (lambda group: group["weights"].update(scale_dtype="torch.float16"), "weights.scale_dtype is 'torch.float16'"),
    (lambda group: group.update(input_activations={"num_bits": 8, "type": "float", "dynamic": True}),
     "input_activations is not read"),
]


@pytest.mark.parametrize("edit, said", CT_CONFIG_REFUSALS, ids=[said for _, said in CT_CONFIG_REFUSALS])
def test_a_compressed_tensors_float_config_that_says_other_bytes_is_refused(edit, said):
    config = json.loads((DATA / "ct-nvfp4a16" / "config.json").read_text())["quantization_config"]
    edit(config["config_groups"]["group_0"])
    with pytest.raises(MoeconvError, match=f"config.json: quantization_config.config_groups.group_0.{said}"):
        CompressedTensorsFloat.from_config(config, "config.json")


def test_the_mixed_checkpoint_reads_its_experts_group_and_leaves_the_fp8_group():
    config = json.loads((DATA / "ct-mxfp4-fp8block" / "config.json").read_text())["quantization_config"]
    from moeconv.formats import format_from_config

    fmt = format_from_config(config, "config.json")
    assert (type(fmt), fmt.format, fmt.input_scale) == (CompressedTensorsFloat, MXFP4_FORMAT, False)
    fp8_only = {**config, "config_groups": {"group_0": config["config_groups"]["group_0"]}}
    with pytest.raises(MoeconvError, match="no group's targets cover the routed experts"):
        CompressedTensorsFloat.from_config(fp8_only, "config.json")


def test_modelopt_nvfp4_configs_that_say_other_bytes_are_refused():
    config = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None}
    assert ModelOptNvfp4.from_config(config, "x") == ModelOptNvfp4()
    with pytest.raises(MoeconvError, match="group_size 32: NVFP4 blocks are 16 wide"):
        ModelOptNvfp4.from_config({**config, "group_size": 32}, "x")
    with pytest.raises(MoeconvError, match="kv_cache_quant_algo 'FP8'"):
        ModelOptNvfp4.from_config({**config, "kv_cache_quant_algo": "FP8"}, "x")


def edited_copy(tmp_path: Path, name: str, config_edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(DATA / name, folder)
    config = json.loads((folder / "config.json").read_text())
    config_edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", ["ct-nvfp4a16", "ct-mxfp4a16", "modelopt-nvfp4"])
def test_packed_shapes_that_disagree_with_the_config_are_refused_naming_the_tensor(tmp_path, name):
    folder = edited_copy(tmp_path, name, lambda config: config.update(moe_intermediate_size=48))
    with pytest.raises(MoeconvError, match=r"safetensors: tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\."
                                           r"(weight|weight_packed|weight_scale) is (U8|F8_E4M3)\[32, \d+\], which makes "
                                           r"a 32x64 .out x in. linear, but config.json makes the gate projection 48x64"):
        survey(open_checkpoint(folder))


def test_k_not_a_multiple_of_the_block_is_refused(tmp_path):
    """MXFP4 with K = 48 (the producer writes ceil(48 / 32) = 2 scale columns): no partial block is read."""
    from safetensors.numpy import save_file

    folder = tmp_path / "mx48"
    shutil.copytree(DATA / "ct-mxfp4a16", folder)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    (folder / "model.safetensors.index.json").unlink()
    tensors = {}
    for path in sorted((DATA / "ct-mxfp4a16").glob("*.safetensors")):
        tensors.update({name: values for name, (_, values) in read_safetensors(path).items()})
    for prefix, (n, _) in expert_prefixes():
        rows, cols = (48, n) if prefix.endswith("down_proj") else (n, 48)
        tensors[f"{prefix}.weight_packed"] = np.zeros((rows, cols // 2), np.uint8)
        tensors[f"{prefix}.weight_scale"] = np.full((rows, -(-cols // 32)), 127, np.uint8)
    save_file({name: np.ascontiguousarray(values) for name, values in tensors.items()
               if ".mlp.experts." in name}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoeconvError, match="gate_proj: K = 48 is not a multiple of group size 32"):
        survey(open_checkpoint(folder))
