"""compressed-tensors sources (pack-quantized W4A16 / W8A16, int-quantized W8A8) and the Triton
W8A8 layout and kernel: round trips, hand-checked bytes, config refusals, the real packer, and
convert + verify end to end."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from moeconv.backends.triton import TritonBackend
from moeconv.backends.base import ExpertWeights
from moeconv.canonical import MoELayerShape, QuantizedWeight
from moeconv.errors import MoeconvError
from moeconv.formats import CompressedTensors, format_from_config
from moeconv.formats.base import config_pattern
from moeconv.formats.compressed_tensors import _EXPERT_LINEAR_NAMES
from moeconv.kernels.fused_moe import GemmConfig, align_tokens_to_experts
from moeconv.kernels.int8_moe import int8_fused_moe, int8_moe_gemm, quantize_per_token
from moeconv.kernels.reference import random_routing, reference_fused_moe, relative_error
from moeconv.kernels.runners import W8A8_NUMERICS_TOLERANCE
from moeconv.synth import stored_array

from helpers import cli, packers_python, synth
from strategies import quantized_weights

ROOT = Path(__file__).resolve().parents[1]
WHERE = "config.json"
W4A16 = CompressedTensors(bits=4, group_size=128)
W8A8 = CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8)

SOURCES = (
    [CompressedTensors(bits=b, group_size=g, symmetric=sym) for b in (4, 8) for g in (32, 128, -1) for sym in (True, False)]
    + [W8A8, CompressedTensors(format="int-quantized", bits=8, group_size=-1)]
)


# ------------------------------------------------------------------------------ codec


@pytest.mark.parametrize("source", SOURCES, ids=str)
@given(data=st.data())
def test_decode_encode_round_trip(source, data):
    weight = data.draw(quantized_weights(source.bits, source.symmetric, source.group_size,
                                         n_multiple=32 // source.bits,
                                         scale_dtype=data.draw(st.sampled_from([torch.float16, torch.bfloat16]))))
    tensors = source.encode(weight)
    assert set(tensors) == set(source.suffixes())
    assert source.decode(tensors).mismatch(weight) is None
    expected = source.expected(weight.out_features, weight.in_features)
    for suffix, tensor in tensors.items():
        assert tuple(tensor.shape) == expected[suffix].shape, suffix


def test_pack_quantized_hand_checked():
    # Signed values q = -8..7 along K are codes 0..15 (offset 8): value j of a word at bits 4j.
    q = np.tile(np.arange(-8, 8), (8, 2))  # (N=8, K=32)
    zp = np.arange(-8, 0)  # one zero point per row, signed; stored offset-binary along N
    weight_packed = np.array([[0x76543210, 0xFEDCBA98 - (1 << 32)] * 2] * 8, dtype=np.int32)
    weight_zero_point = np.array([[0x76543210]], dtype=np.int32)
    decoded = CompressedTensors(bits=4, group_size=-1, symmetric=False).decode({
        "weight_packed": weight_packed, "weight_scale": np.ones((8, 1), dtype=np.float16),
        "weight_shape": np.array([8, 32]), "weight_zero_point": weight_zero_point})
    assert np.array_equal(decoded.codes.astype(np.int64), q + 8)
    assert decoded.zeros[:, 0].tolist() == (zp + 8).tolist()  # the TRUE zero: no ±1 anywhere
    assert np.array_equal(decoded.dequantize(np.float64), (q - zp[:, None]).astype(np.float64))


def test_int8_codes_are_the_signed_bytes_plus_128():
    weight = np.array([[-128, -1, 0, 127]], dtype=np.int8)
    decoded = W8A8.decode({"weight": weight, "weight_scale": stored_array(torch.ones(1, 1, dtype=torch.bfloat16))})
    assert decoded.codes.tolist() == [[0, 127, 128, 255]]
    assert decoded.zeros is None and decoded.group_size == 4
    assert decoded.dequantize(np.float64).tolist() == [[-128.0, -1.0, 0.0, 127.0]]


def test_weight_shape_must_match_the_packed_tensor():
    tensors = W4A16.encode(QuantizedWeight(np.zeros((8, 128), dtype=np.uint8), None,
                                           np.ones((8, 1), dtype=np.float16), 4, 128))
    tensors["weight_shape"] = np.array([8, 120])
    with pytest.raises(MoeconvError, match=r"weight_shape says \[8, 120\]"):
        W4A16.decode(tensors)


# ------------------------------------------------------------------------------ configs


def _config(weights: dict | None = None, activations: dict | None = None, fmt: str = "pack-quantized",
            **top) -> dict:
    config = copy.deepcopy(W4A16.quantization_config())
    group = config["config_groups"]["group_0"]
    group["weights"].update(weights or {})
    group["input_activations"] = activations
    group["format"] = None  # as ModelCompressor writes it: the top-level format applies
    config["format"] = fmt
    config.update(top)
    return config


TOKEN_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


@pytest.mark.parametrize("config, expected", [
    (_config(), W4A16),
    (_config({"strategy": "channel", "group_size": None, "symmetric": False, "actorder": "static"}),
     CompressedTensors(bits=4, group_size=-1, symmetric=False)),
    (_config({"num_bits": 8, "strategy": "channel", "group_size": None}, TOKEN_INT8, fmt="int-quantized"), W8A8),
    (_config({"num_bits": 8, "strategy": "channel", "group_size": None}, fmt="naive-quantized"),
     CompressedTensors(format="naive-quantized", bits=8, group_size=-1)),
], ids=["w4a16-g128", "w4a16-channel-asym-static-actorder", "w8a8", "w8a16-naive"])
def test_config_parsing(config, expected):
    assert format_from_config(config, WHERE) == expected


def test_only_the_groups_that_cover_experts_count():
    config = _config()
    config["config_groups"]["group_0"]["targets"] = ["re:.*experts.*"]
    attention = copy.deepcopy(config["config_groups"]["group_0"])
    attention["targets"] = ["re:.*self_attn.*"]
    attention["weights"]["num_bits"] = 8
    config["config_groups"]["group_1"] = attention
    assert format_from_config(config, WHERE).bits == 4
    attention["targets"] = ["Linear"]
    with pytest.raises(MoeconvError, match=r"different schemes \(group_0, group_1\).*one scheme for all experts"):
        format_from_config(config, WHERE)


@pytest.mark.parametrize("config, message", [
    (_config({"actorder": "random"}), r"group_0.weights.actorder 'random' is not one of weight, static, group, dynamic"),
    (_config({"type": "float"}), r"weights.type 'float' is not supported"),
    (_config({"num_bits": 3}), r"weights.num_bits 3 is not supported by pack-quantized \(supported: 4, 8\)"),
    (_config({"num_bits": 4, "strategy": "channel"}, TOKEN_INT8, fmt="int-quantized"), r"num_bits 4 .* int-quantized"),
    (_config({"strategy": "block", "block_structure": [128, 128]}), r"weights.strategy 'block' is not supported"),
    (_config({"strategy": "tensor"}), r"weights.strategy 'tensor'"),
    (_config({"group_size": 96}), r"group_size 96 is not -1 or a power of two"),
    (_config({"dynamic": True}), r"weights.dynamic is true"),
    (_config(activations=TOKEN_INT8), r"input_activations is not supported"),
    (_config({"num_bits": 8, "strategy": "channel"}, {**TOKEN_INT8, "dynamic": False}, fmt="int-quantized"),
     r"input_activations is not supported"),
    (_config({"num_bits": 8, "strategy": "channel", "symmetric": False}, TOKEN_INT8, fmt="int-quantized"),
     r"symmetric is false: int-quantized INT8 experts must be symmetric"),
    (_config(fmt="float-quantized"), r"format 'float-quantized' is not supported"),
    (_config(quantization_status="frozen"), r"quantization_status is 'frozen'"),
    (_config(sparsity_config={"format": "sparse-24-bitmask"}), r"sparsity_config.format"),
    (_config(config_groups={}), r"config_groups is missing or empty"),
], ids=lambda value: value if isinstance(value, str) and len(value) < 30 else None)
def test_config_refusals_name_the_file_and_field(config, message):
    with pytest.raises(MoeconvError, match=message) as refused:
        format_from_config(config, WHERE)
    assert str(refused.value).startswith(f"{WHERE}: quantization_config") and "\n" not in str(refused.value)


def test_a_group_that_misses_the_experts_is_refused():
    config = _config()
    config["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    with pytest.raises(MoeconvError, match="no group's targets cover the routed experts"):
        format_from_config(config, WHERE)



# Patterns as configs write them (llm-compressor recipes, moonshotai/Kimi-K2-Thinking's `ignore`), and some
# that take in none or part of the experts.
ORDINARY_PATTERNS = [r".*mlp.experts.*", r"model.layers.\d+.mlp.*", r".*experts\.\d+\.(gate|up|down)_proj$",
                     r".*self_attn.*", r"re:.*", r".*mlp\.(gate|up|gate_up|down)_proj.*", r".*shared_experts.*",
                     r".*mlp.gate$", r"(?i).*EXPERTS\.0\.W1$", r"model\.layers\.[1-9]\d*\..*", r"^model\.layers\.0\.",
                     r".*block_sparse_moe.experts.*", r".*(w1|w3)$", r"lm_head", r"[a-z._]+\d+\.[a-z_]+\.experts"]
OTHER_NAMES = ["model.layers.3.self_attn.q_proj", "lm_head", "model.layers.1.mlp.gate", "model.embed_tokens",
               "model.layers.0.mlp.shared_experts.gate_proj", "model.layers.12.mlp.gate_up_proj"]


@pytest.mark.parametrize("pattern", ORDINARY_PATTERNS)
def test_target_patterns_match_as_pythons_re_matches_them(pattern):
    """RE2 (linear time) answers what compressed-tensors' `re.match` answers, on every module name moeconv
    matches targets against; and a group whose only target is the pattern covers the experts exactly when
    Python's `re.match` takes in one of them."""
    compiled = config_pattern(pattern, WHERE)
    for name in (*_EXPERT_LINEAR_NAMES, *OTHER_NAMES):
        assert (compiled.match(name) is not None) == (re.match(pattern, name) is not None), name
    config = _config()
    config["config_groups"]["group_0"]["targets"] = [f"re:{pattern}"]
    if any(re.match(pattern, name) for name in _EXPERT_LINEAR_NAMES):
        assert format_from_config(config, WHERE) == W4A16
    else:
        with pytest.raises(MoeconvError, match="no group's targets cover the routed experts"):
            format_from_config(config, WHERE)


def test_the_ordinary_patterns_take_in_the_experts_and_not():
    """The list above holds patterns of both outcomes, so the test above tests both."""
    covering = {any(re.match(pattern, name) for name in _EXPERT_LINEAR_NAMES) for pattern in ORDINARY_PATTERNS}
    assert covering == {True, False}


@pytest.mark.timeout(30, method="thread")  # a backtracking match holds the GIL: only the thread method ends it
@pytest.mark.parametrize("pattern", [r"(.*.*)*X", r"(.|..)*Q", r"(a|a)*b", r"((.*)*)*\d{50}"])
def test_backtracking_targets_are_matched_in_linear_time(pattern):
    import time

    config = _config()
    config["config_groups"]["group_0"]["targets"] = [f"re:{pattern}"]
    started = time.perf_counter()
    with pytest.raises(MoeconvError, match="no group's targets cover the routed experts"):
        format_from_config(config, WHERE)
    config["config_groups"]["group_0"]["targets"] = [f"re:{pattern}", "Linear"]
    assert format_from_config(config, WHERE) == W4A16
    assert time.perf_counter() - started < 0.5


# ------------------------------------------------------------------------------ Triton W8A8 layout


def _w8a8_layer(experts=1, hidden=4, intermediate=2, **changes) -> MoELayerShape:
    fields = dict(experts=experts, hidden=hidden, intermediate=intermediate, bits=8, group_size=-1, symmetric=True,
                  scale_dtype="BF16", activation_bits=8)
    return MoELayerShape(**{**fields, **changes})


def test_triton_w8a8_hand_checked_bytes():
    def weight(rows):
        codes = np.array(rows, dtype=np.uint8)
        scales = torch.arange(1, codes.shape[0] + 1, dtype=torch.bfloat16)[:, None] / 64
        return QuantizedWeight(codes, None, stored_array(scales), 8, codes.shape[1])

    gate, up = weight([[0, 127, 128, 255], [1, 2, 3, 4]]), weight([[255, 255, 0, 0], [128, 128, 128, 128]])
    down = weight([[0, 255], [128, 129], [7, 8], [200, 100]])
    layer = _w8a8_layer()
    slices = TritonBackend().encode_expert(ExpertWeights(gate, up, down), layer)
    assert slices["w13_weight"].dtype == np.int8
    assert slices["w13_weight"].tolist() == [[-128, -1, 0, 127], [-127, -126, -125, -124], [127, 127, -128, -128],
                                             [0, 0, 0, 0]]
    assert slices["w2_weight"].tolist() == [[-128, 127], [0, 1], [-121, -120], [72, -28]]
    assert slices["w13_weight_scale"].dtype == np.float32
    assert slices["w13_weight_scale"].flatten().tolist() == [1 / 64, 2 / 64, 1 / 64, 2 / 64]
    specs = {spec.name: (spec.shape, spec.dtype) for spec in TritonBackend().layer_tensors(layer)}
    assert specs == {"w13_weight": ((1, 4, 4), "I8"), "w13_weight_scale": ((1, 4, 1), "F32"),
                     "w2_weight": ((1, 4, 2), "I8"), "w2_weight_scale": ((1, 4, 1), "F32")}
    decoded = TritonBackend().decode_expert(slices, layer)
    for mine, original in zip(decoded, (gate, up, down)):
        assert mine.mismatch(original) is None  # scales back in bf16, bit for bit


@pytest.mark.parametrize("changes", [{"group_size": 32}, {"symmetric": False}, {"bits": 4}])
def test_triton_w8a8_refuses_what_the_int8_kernels_cannot_take(changes):
    assert "symmetric 8-bit weights with one scale per channel" in TritonBackend().refusal(_w8a8_layer(**changes))


# ------------------------------------------------------------------------------ the W8A8 kernel


def _emulated_w8a8(x, w13, s13, w2, s2, topk_weights, topk_ids):
    """The W8A8 arithmetic in float64 (activations quantized like the kernel): checks the kernel
    computes what it claims, much tighter than the float reference can."""
    def quantized(a):
        q, scale = quantize_per_token(a)
        return q.double() * scale.double()[:, None]

    out = torch.zeros(x.shape, dtype=torch.float64)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = (quantized(x[tokens]) @ (w13[expert].double() * s13[expert].double()).T).to(x.dtype)
        half = gate_up.shape[1] // 2
        activated = torch.nn.functional.silu(gate_up[:, :half]) * gate_up[:, half:]
        down = quantized(activated) @ (w2[expert].double() * s2[expert].double()).T
        out.index_add_(0, tokens, down * topk_weights[tokens, slots].double()[:, None])
    return out


@pytest.mark.parametrize("experts, hidden, intermediate, tokens, topk", [(4, 128, 64, 8, 2), (8, 256, 96, 5, 3)])
def test_int8_kernel_against_references(experts, hidden, intermediate, tokens, topk):
    generator = torch.Generator().manual_seed(experts * hidden + tokens)
    w13 = torch.randint(-128, 128, (experts, 2 * intermediate, hidden), dtype=torch.int8, generator=generator)
    w2 = torch.randint(-128, 128, (experts, hidden, intermediate), dtype=torch.int8, generator=generator)
    s13 = (torch.rand(experts, 2 * intermediate, 1, generator=generator) + 0.5) * 1e-3
    s2 = (torch.rand(experts, hidden, 1, generator=generator) + 0.5) * 1e-3
    x = torch.randn(tokens, hidden, generator=generator).to(torch.float16)
    x[0] = 0  # an all-zero token: scale 1, not 0/0
    topk_weights, topk_ids = random_routing(tokens, experts, topk, generator)
    out = int8_fused_moe(x, w13, s13, w2, s2, topk_weights, topk_ids)
    assert out.dtype == torch.float16 and bool((out[0] == 0).all())
    emulated = _emulated_w8a8(x, w13, s13, w2, s2, topk_weights, topk_ids)
    assert relative_error(out, emulated) < 2e-3  # fp16 output rounding
    reference = reference_fused_moe(x.double(), w13.double() * s13.double(), w2.double() * s2.double(),
                                    topk_weights.double(), topk_ids)
    error = relative_error(out, reference)
    assert 1e-3 < error < W8A8_NUMERICS_TOLERANCE  # the activation rounding shows, within the bound


def test_int8_split_k_partial_sums_meet():
    """Split K (the GPU's decode path) adds scaled partial sums with fp32 atomics: same result."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-128, 128, (4, 64, 256), dtype=torch.int8, generator=generator)
    scale = torch.rand(4, 64, 1, generator=generator)
    x = torch.randn(8, 256, generator=generator).to(torch.float16)
    blocks = align_tokens_to_experts(torch.randint(0, 4, (8, 2), generator=generator), 4, 16)
    whole = int8_moe_gemm(x, weight, scale, blocks)
    split = int8_moe_gemm(x, weight, scale, blocks, config=GemmConfig(16, 64, 32, split_k=4))
    assert relative_error(split, whole) < 1e-6


# ------------------------------------------------------------------------------ end to end


E2E = [
    ("qwen3_moe", CompressedTensors(bits=4, group_size=32, symmetric=True)),
    ("mixtral", CompressedTensors(bits=4, group_size=64, symmetric=False)),
    ("deepseek_v3", CompressedTensors(bits=4, group_size=-1, symmetric=False)),
    ("qwen2_moe", CompressedTensors(bits=8, group_size=-1, symmetric=True)),
    ("qwen3_moe", W8A8),
    ("mixtral", W8A8),
]


@pytest.mark.parametrize("architecture, source_format", E2E, ids=[
    f"{arch}-W{fmt.bits}A{fmt.activation_bits}-g{fmt.group_size}-{'sym' if fmt.symmetric else 'asym'}"
    for arch, fmt in E2E])
def test_convert_and_verify(tmp_path, architecture, source_format):
    source = synth(tmp_path / "src", architecture=architecture, source_format=source_format, layers=2,
                   dense_layers=0 if architecture == "mixtral" else 1, hidden=128, intermediate=64)
    config = json.loads((source / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    inspected = cli("inspect", source, "--json")
    assert inspected.exit_code == 0, inspected.output
    assert json.loads(inspected.stdout)["format"]["scheme"] == f"W{source_format.bits}A{source_format.activation_bits}"
    converted = cli("convert", source, "-o", tmp_path / "out", "--quiet")
    assert converted.exit_code == 0, converted.output
    verified = cli("verify", tmp_path / "out", "--json")
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.stdout)
    assert report["ok"] and all(layer["experts_exact"] == 4 for layer in report["layers"])
    w8a8 = source_format.activation_bits == 8
    assert report["tolerance"] == (W8A8_NUMERICS_TOLERANCE if w8a8 else 1e-2)
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert written["layout"] == ("int8_w8a8" if w8a8 else "moe_wna16")
    if w8a8:
        with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), "pt") as handle:
            names = [name for name in handle.keys() if name.endswith("experts.w13_weight_scale")]
            assert not names or handle.get_tensor(names[0]).dtype == torch.float32


# ------------------------------------------------------------------------------ the real packer


def _load_cases_module():
    spec = importlib.util.spec_from_file_location("moeconv_packer_cases", ROOT / "tests" / "packers" / "cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


C = _load_cases_module()


@pytest.fixture(scope="module")
def ct_packed(tmp_path_factory) -> dict[str, torch.Tensor]:
    python = packers_python()
    out = tmp_path_factory.mktemp("ct") / "ct.safetensors"
    done = subprocess.run([str(python), "tests/packers/pack_real.py", "--compressed-tensors", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    with safe_open(str(out), "pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["versions"])["compressed-tensors"] == "0.20.1"
    assert [case["name"] for case in json.loads(metadata["cases"])] == [case.name for case in C.CT_CASES]
    return load_file(str(out))


def _ct_format(case) -> CompressedTensors:
    if case.packer == C.CT_INT:
        return W8A8
    return CompressedTensors(bits=case.bits, group_size=case.group_size, symmetric=case.sym)


@pytest.mark.packers
@pytest.mark.parametrize("case", C.CT_CASES, ids=lambda case: case.name)
def test_real_compressed_tensors_packer(ct_packed, case):
    """compressed-tensors quantized W with our scales and signed zero points, and packed it with
    pack_to_int32: we decode exactly the codes and TRUE zeros meant, and encode the same int32s."""
    t = {key.removeprefix(case.name + "."): value for key, value in ct_packed.items()
         if key.startswith(case.name + ".")}
    fmt = _ct_format(case)
    stored = {suffix: stored_array(t[suffix]) for suffix in fmt.suffixes()}
    assert set(fmt.suffixes()) == {key for key in t if key.startswith("weight")}
    intended = QuantizedWeight(t["codes"].numpy(), None if case.sym else t["zeros"].numpy(), stored_array(t["scales"]),
                               case.bits, case.k // case.groups)
    assert fmt.decode(stored).mismatch(intended) is None
    for suffix, array in fmt.encode(intended).items():
        assert array.dtype == stored[suffix].dtype and np.array_equal(array, stored[suffix]), suffix
    if "unpacked" in t:  # compressed-tensors' own unpacking gives q = code - 2^(b-1)
        assert torch.equal(t["unpacked"].to(torch.int16) + (1 << (case.bits - 1)), t["codes"].to(torch.int16))


def test_the_engine_scale_cast_is_counted_and_an_overflow_fails():
    """What vLLM's load-time cast to the model dtype does (its own loader measured the same counts:
    docs/BENCHMARKS.md), computed from values whose roundings are known by hand."""
    from moeconv.audit import Audits

    audits = Audits()
    audits.record_cast(np.array([1.0, 1.0 + 2**-10, 0.5, 3.0 + 2**-9], dtype=np.float16), "float16", "bfloat16")
    assert audits.casts["checked"] == 4 and audits.casts["changed"] == 2 and audits.casts["overflow"] == 0
    assert audits.casts["max_relative_change"] == pytest.approx(2**-10 / (1.0 + 2**-10))  # beats 2^-9 / 3
    audits.record_cast(stored_array(torch.tensor([131072.0, 2.0], dtype=torch.bfloat16)), "bfloat16", "float16")  # inf
    assert audits.casts["overflow"] == 1 and audits.casts["checked"] == 6


_CAST_EDGES = [0.0, -0.0, 1.0, 1.0 + 2**-10, 65504.0, 65520.0, 131072.0, 3.4e38, 2**-24, 2**-25, 2**-14, 1e-40,
               2**-126, float("inf"), float("-inf"), float("nan")]


@given(values=st.lists(st.one_of(st.sampled_from(_CAST_EDGES), st.floats(width=32)), min_size=1, max_size=64),
       pair=st.sampled_from([("float16", "bfloat16"), ("bfloat16", "float16"), ("float32", "float16"),
                             ("float32", "bfloat16"), ("float16", "float32"), ("bfloat16", "float32")]))
def test_the_cast_audit_counts_what_torchs_own_cast_does(values, pair):
    """The audit casts in numpy (verify's workers have no torch); torch's own `.to()` is the reference, here on
    edge values (overflow, subnormals, ties, signed zeros, NaN) and any float32, stored in the pair's first dtype."""
    from moeconv.audit import Audits

    stored, engine = (getattr(torch, name) for name in pair)
    scales = torch.tensor(values, dtype=torch.float32).to(stored)
    finite = torch.isfinite(scales)
    cast = scales.to(engine)
    changed = finite & (cast.to(stored).float().view(torch.int32) != scales.float().view(torch.int32))
    overflow = finite & ~torch.isfinite(cast)
    kept = finite & ~overflow & (scales != 0)
    audits = Audits()
    audits.record_cast(stored_array(scales), *pair)
    assert audits.casts["checked"] == int(finite.sum())
    assert audits.casts["changed"] == int(changed.sum())
    assert audits.casts["overflow"] == int(overflow.sum())
    expected = float(((cast.double() - scales.double()).abs() / scales.double().abs())[kept].max()) if kept.any() else 0.0
    assert audits.casts["max_relative_change"] == expected


def test_fp16_scales_served_bf16_are_reported(tmp_path, capsys):
    import moeconv
    from moeconv.formats import GPTQ
    from moeconv.synth import SynthSpec, make_checkpoint

    from helpers import run_main

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=True), hidden=64,
                                                         intermediate=64, dtype=torch.float16))
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"  # the model runs bf16, its checkpoint's scales are fp16
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--backend", "compressed-tensors", "-q")
    assert code == 0 and "casts them at load" in err and "--dtype float16" in err
    report = moeconv.verify(tmp_path / "out", level="lossless")
    cast = report.engine_scale_cast
    assert report.ok and (cast["stored"], cast["model"]) == ("float16", "bfloat16")
    assert 0 < cast["changed"] < cast["checked"] and 0 < cast["max_relative_change"] <= 2**-8


def test_output_ignores_the_float_linears_and_not_the_embedding(tmp_path):
    """`ignore` names the float linears (lm_head, routers) and not the token embedding, which is no
    `Linear` target: SGLang 0.5.23's w8a8_int8 method gives an ignored embedding a linear method and
    refuses to start ("UnquantizedLinearMethod must implement the 'embedding' method"; shown in
    `make test-engines-sglang`)."""
    source = synth(tmp_path / "src", architecture="qwen3_moe", source_format=W8A8, layers=2, hidden=128,
                   intermediate=64)
    converted = cli("convert", source, "-o", tmp_path / "out", "--backend", "compressed-tensors", "--quiet")
    assert converted.exit_code == 0, converted.output
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), "pt") as handle:
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.float16  # passed through in float
    assert ignore == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
