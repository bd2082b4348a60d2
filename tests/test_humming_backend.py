"""The Humming standard schema: bytes as docs/FORMAT.md describes them, round trips from
every source, true zero points for GPTQ v1, and a whole checkpoint converted, reloaded and verified."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moeconv.backends import humming
from moeconv.backends.humming import HummingBackend
from moeconv.canonical import LinearShape, QuantizedWeight
from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.formats import GPTQ, CompressedTensors
from moeconv.formats.compressed_tensors import INT_QUANTIZED
from moeconv.plan import make_plan
from moeconv.spec import FLOAT_DTYPES
from moeconv.worklist import LinearJob
from moeconv.synth import SynthSpec, make_checkpoint, quantize, random_weight
from moeconv.verification import verify


from helpers import cli
from test_verify import _flip_byte

backend = HummingBackend()


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _linear(codes, zeros, group_size, bits=4) -> tuple[QuantizedWeight, LinearShape]:
    codes = np.array(codes, dtype=np.uint8)
    n, k = codes.shape
    zeros = None if zeros is None else np.array(zeros, dtype=np.uint8)
    weight = QuantizedWeight(codes, zeros, np.ones((n, k // group_size), dtype=np.float16), bits, group_size)
    return weight, LinearShape(n, k, bits, group_size, zeros is None, "F16")


def test_hand_checked_words():
    """4-bit, N = 8, K = 8, one group. §4.2: value i of a row at bits [4i, 4i + 4) of the row's word, so
    codes 1..8 read as the hex digits from the right; zero points are packed the same way along N."""
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [15] * 8, [0] * 8, [0, 15, 0, 15, 0, 15, 0, 15]] + [[9] * 8] * 4
    weight, shape = _linear(rows, [[z] for z in (3, 12, 0, 15, 1, 2, 4, 8)], 8)
    tensors = backend.encode_linear(weight, shape)
    assert tensors["weight"].dtype == np.int32 and tensors["weight"].shape == (8, 1)
    assert tensors["weight"][:4, 0].tolist() == [_signed(0x87654321), _signed(0xFFFFFFFF), 0, _signed(0xF0F0F0F0)]
    assert tensors["zero_point"].tolist() == [[_signed(0x8421F0C3)]]
    assert tensors["weight_scale"].shape == (8, 1)
    # The same words from independent integer arithmetic over the whole row.
    for row, word in zip(rows, tensors["weight"][:, 0].tolist()):
        assert word == _signed(sum(code << (4 * i) for i, code in enumerate(row)))


def test_eight_bit_words_are_the_int8_bytes_xor_0x80():
    """8-bit: little-endian bytes of the codes; for an int8 (W8A8) source the codes are w ^ 0x80 (§4.3)."""
    int8 = np.tile(np.array([[1, -128, -1, 127]], dtype=np.int8), (4, 1))
    source = CompressedTensors(format=INT_QUANTIZED, bits=8, group_size=-1, activation_bits=8)
    weight = source.decode({"weight": int8, "weight_scale": np.ones((4, 1), dtype=np.float32)})
    tensors = backend.encode_linear(weight, LinearShape(4, 4, 8, -1, True, "F32", 8))
    assert tensors["weight"][0].tolist() == [_signed(0xFF7F0081)]  # bytes 0x81, 0x00, 0x7F, 0xFF


def test_packing_uses_explicit_shifts():
    """No byte-order dependence: nothing in the backend views bytes as words."""
    source = inspect.getsource(humming)
    assert "explicit shifts" in source and ".view(" not in source


def _humming_0119_gptq_zero_point(qzeros: np.ndarray) -> np.ndarray:
    """What Humming 0.1.19's GPTQWeightSchema writes (§4.3): qzeros.T, raw, without GPTQ v1's +1.
    Unpacked here with independent integer arithmetic: nibble j of word [r, g] is row 8r + j."""
    words = qzeros.T.tolist()  # (N/8, G)
    return np.array([[(words[n // 8][g] >> (4 * (n % 8))) & 0xF for g in range(len(words[0]))]
                     for n in range(8 * len(words))], dtype=np.uint8)


def test_gptq_v1_zero_point_0_converts_to_true_zero_and_copying_v1_zeros_does_not():
    """GPTQ v1 asymmetric, zero point 0 in some groups: moeconv writes the true zero 0; Humming 0.1.19's
    own conversion (raw v1 qzeros) is off by one everywhere (and by 15 where the zero is 0), which puts its
    dequantized weight far from the source's float reference."""
    generator = torch.Generator().manual_seed(0)
    source = GPTQ(4, 32, sym=False, checkpoint_format="gptq")
    floats = random_weight(64, 256, 32, generator)
    canonical = quantize(floats, 4, 32, symmetric=False, scale_dtype=torch.float16)
    assert bool((canonical.zeros == 0).any()) and bool((canonical.zeros == 15).any())
    stored = source.encode(canonical)
    decoded = source.decode(stored)
    assert decoded.mismatch(canonical) is None

    shape = LinearShape(64, 256, 4, 32, False, "F16")
    tensors = backend.encode_linear(decoded, shape)
    zero_point = [[(word >> (4 * (n % 8))) & 0xF for word in row] for n, row in
                  enumerate(np.repeat(tensors["zero_point"], 8, axis=0).tolist())]
    assert zero_point == canonical.zeros.tolist()  # TRUE zeros, 0 included

    ours = torch.from_numpy(backend.decode_linear(tensors, shape).dequantize(np.float64))
    raw = QuantizedWeight(decoded.codes, _humming_0119_gptq_zero_point(stored["qzeros"]), decoded.scales, 4, 32)
    theirs = torch.from_numpy(raw.dequantize(np.float64))
    reference = floats.double()
    relative = {name: float((w - reference).norm() / reference.norm()) for name, w in (("moeconv", ours),
                                                                                      ("humming_raw_v1", theirs))}
    dequantized = torch.from_numpy(canonical.dequantize(np.float64))
    assert torch.equal(ours, dequantized)  # exactly the source's dequantization
    assert relative["moeconv"] < 0.1 < 0.3 < relative["humming_raw_v1"], relative
    print(f"relative error vs float reference: {relative}; raw-v1 vs the source's own dequantization: "
          f"{float((theirs - dequantized).norm() / dequantized.norm()):.3f}")


CONVERSIONS = {
    "qwen2_moe-gptq-v1-asym": SynthSpec(architecture="qwen2_moe", source_format=GPTQ(4, 32, sym=False),
                                        layers=3, dense_layers=1, experts=4, hidden=128, intermediate=64),
    "mixtral-ct-w8a8": SynthSpec(architecture="mixtral", layers=2, experts=4, hidden=128, intermediate=64,
                                 source_format=CompressedTensors(format=INT_QUANTIZED, bits=8, group_size=-1,
                                                                 activation_bits=8)),
}


@pytest.fixture(scope="module", params=list(CONVERSIONS))
def converted(request, tmp_path_factory):
    """synth -> `moeconv convert --backend humming`, once per case."""
    root = tmp_path_factory.mktemp(request.param)
    source = make_checkpoint(root / "src", CONVERSIONS[request.param], max_shard_size=100_000)
    result = cli("convert", source, "-o", root / "out", "--backend", "humming", "--max-shard-size", "150KB", "--quiet")
    assert result.exit_code == 0, result.output
    return source, root / "out"


def _load_all(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of an output folder as its stored array (BF16 as its uint16 bit patterns)."""
    with TensorReader() as reader:
        return {name: reader.read_raw(entry) for name, entry in open_checkpoint(folder).tensors.items()}


def test_every_linear_decodes_to_the_source_and_the_rest_is_byte_identical(converted):
    source, out = converted
    plan = make_plan(source, backend="humming")
    tensors = _load_all(out)
    written = set()
    with TensorReader() as reader:
        for layer in plan.layers:
            shape = layer.shape
            for e, expert in enumerate(layer.experts):
                slices = {spec.name: tensors[f"{layer.module}.{e}.{spec.name}"]
                          for spec in backend.layer_tensors(shape)}
                written |= {f"{layer.module}.{e}.{suffix}" for suffix in slices}
                decoded = backend.decode_expert(slices, shape)
                for projection, linear in expert.items():
                    expected = plan.source_format.decode({s: reader.read_raw(entry) for s, entry in linear.items()})
                    assert getattr(decoded, projection).mismatch(expected) is None
        linears = [job for job in plan.jobs if isinstance(job, LinearJob)]
        assert linears
        for linear in linears:
            own = {spec.name: tensors[f"{linear.prefix}.{spec.name}"] for spec in backend.linear_tensors(linear.shape)}
            written |= {f"{linear.prefix}.{suffix}" for suffix in own}
            expected = plan.source_format.decode({s: reader.read_raw(piece.entry) for s, piece in linear.sources.items()})
            assert backend.decode_linear(own, linear.shape).mismatch(expected) is None
        passthrough = set(tensors) - written
        for name in passthrough:
            original = reader.read_raw(plan.checkpoint.tensors[name])
            assert original.dtype == tensors[name].dtype and plan.checkpoint.tensors[name].dtype in FLOAT_DTYPES
            assert original.tobytes() == tensors[name].tobytes()
    names = set(tensors)
    if plan.architecture.model_type == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
        assert "model.layers.0.self_attn.q_proj.weight_scale" in names
    else:
        assert {"model.layers.1.mlp.experts.3.up_proj.zero_point", "model.layers.0.mlp.down_proj.weight",
                "model.layers.2.mlp.shared_expert.gate_proj.zero_point"} <= names
    assert not any(name.endswith(("qweight", "qzeros", "scales", "g_idx", "weight_packed")) for name in names)


def test_config_is_humming(converted):
    source, out = converted
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    fmt = make_plan(source, backend="humming").source_format
    assert config["quant_method"] == "humming"
    assert config["b_dtype"] == f"uint{fmt.bits}"
    assert config["weight_scale_group_size"] == (0 if fmt.group_size == -1 else fmt.group_size)
    assert "group_size" not in config  # Humming's input schema would read it as an activation group size
    assert config["has_zero_point"] == (not fmt.symmetric)
    assert config["moeconv"]["backend"] == "humming"
    assert config["moeconv"]["source_quantization_config"]["quant_method"] == fmt.method
    assert "lm_head" in config["ignored_layers"]
    if fmt.symmetric:  # W8A8: fp16 model, fp16 per-channel scales from synth: no bs_dtype needed
        assert config["activations"] == "dynamic per-token symmetric int8"
    else:
        assert {"model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate"} <= set(config["ignored_layers"])
    assert "bs_dtype" not in config
    assert not any(".self_attn." in module for module in config["ignored_layers"])


def test_verify_passes_and_a_flipped_expert_byte_fails(converted, tmp_path):
    source, out = converted
    report = verify(out)
    assert report.ok, report.failures()
    assert report.dense_linears_checked > 0 and not report.dense_linear_problems
    assert all(layer.experts_exact == 4 and layer.relative_error is not None for layer in report.layers)
    copy = tmp_path / "out"
    copy.mkdir()
    for path in out.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    module = make_plan(source, backend="humming").layers[-1].module
    name = module + (".2.w1.weight" if ".block_sparse_moe." in module else ".2.gate_proj.weight")
    _flip_byte(copy, name, expert=0, offset=5, mask=0x10)
    failures = verify(copy).failures()
    assert any("expert 2 gate: codes: 1 byte(s) differ" in failure for failure in failures), failures


def test_asymmetric_sources_say_which_backend_stock_vllm_serves(tmp_path):
    from helpers import synth as make

    from moeconv.formats import GPTQ as Format

    source = make(tmp_path / "src", source_format=Format(4, 32, sym=False))
    result = cli("convert", source, "-o", tmp_path / "out", "--backend", "humming", "-q")
    assert result.exit_code == 0
    assert "use --backend compressed-tensors" in result.output
    symmetric = make(tmp_path / "sym", source_format=Format(4, 32, sym=True))
    result = cli("convert", symmetric, "-o", tmp_path / "out2", "--backend", "humming", "-q")
    assert result.exit_code == 0 and "compressed-tensors" not in result.output
