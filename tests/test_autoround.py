"""Checkpoints written by the REAL AutoRound 0.16.1 (tests/data/autoround/, made by
tests/packers/make_autoround.py in .venv-packers: RTN mode on tiny Qwen3-MoE models, every integer format
it writes on CPU), converted to every backend and compared bit for bit with what AutoRound's own
quantizer (`quant_tensor_sym` / `quant_tensor_asym`, run in .venv-packers on the same float weights)
makes of each linear: codes, true zero points, scales. Nothing here decodes a source with moeconv's
reading to make the expectation.

Without .venv-packers these tests FAIL (run scripts/install-packers.sh); MOECONV_SKIP_PACKERS=1
skips them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import moeconv
from moeconv.backends import REGISTRY as BACKENDS
from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, format_from_config
from moeconv import transform
from moeconv.plan import make_plan
from moeconv.worklist import ExpertJob

from helpers import PACKERS_VENV, converted_weights, packers_python, run_main

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "autoround"

pytestmark = pytest.mark.packers

# fixture -> the reading its config names (the data must confirm it)
CONVERTIBLE = {
    "ar-gptq-sym-g32": GPTQ(4, 32, sym=True, checkpoint_format="gptq"),  # packing auto_round:auto_gptq
    "ar-plain-asym-g32": GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"),  # packing auto_round
    "ar-awq-asym-g32": AWQ(4, 32, zero_point=True),  # packing auto_round:auto_awq
    "awq-sym-g32": AWQ(4, 32, zero_point=False),  # quant_method awq, qzeros all 8
    "ar-gptq-sym-g128": GPTQ(4, 128, sym=True, checkpoint_format="gptq"),
    "ar-awq-asym-g128": AWQ(4, 128, zero_point=True),
    "ar-gptq-sym-g32-keep16": GPTQ(4, 32, sym=True, checkpoint_format="gptq"),  # extra_config: o_proj at 16 bits
}
# Every backend on the group-32 fixtures; the two group-128 ones split the backends between them (each
# conversion costs a second or two, and the test suite has a budget).
ALL = list(BACKENDS)
PAIRS = [(name, backend) for name in list(CONVERTIBLE)[:4] for backend in ALL] + [
    ("ar-gptq-sym-g128", backend) for backend in ALL[::2]] + [("ar-awq-asym-g128", backend) for backend in ALL[1::2]]


@pytest.fixture(scope="module")
def truths(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    python = packers_python()
    out = tmp_path_factory.mktemp("autoround-truth")
    proc = subprocess.run([str(python), str(ROOT / "tests" / "packers" / "make_autoround.py"), "--truth", str(DATA),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"make_autoround.py --truth failed (exit {proc.returncode})\n{proc.stderr[-4000:]}", pytrace=False)
    return {path.name.removesuffix(".truth.safetensors"): load_file(str(path)) for path in out.glob("*.truth.safetensors")}


def _assert_truth(weights: dict, truth: dict[str, torch.Tensor]) -> None:
    for prefix, weight in weights.items():
        assert np.array_equal(weight.codes, truth[f"{prefix}.codes"].numpy()), prefix
        assert np.array_equal(weight.effective_zeros(), truth[f"{prefix}.zeros"].numpy()), prefix
        assert np.array_equal(weight.scales.view(np.int16), truth[f"{prefix}.scales"].view(torch.int16).numpy()), prefix


def _config(name: str) -> dict:
    return json.loads((DATA / name / "config.json").read_text())["quantization_config"]


def _relabel(src: Path, dst: Path, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "quantization_config.json").unlink(missing_ok=True)
    return dst


@pytest.mark.parametrize("name", list(CONVERTIBLE))
def test_autoround_checkpoints_are_read_as_their_packing_says_and_the_data_confirms(name):
    report = moeconv.inspect(DATA / name)
    detection = report["detection"]
    assert detection["disagreements"] == [] and detection["undecided"] == [], detection
    assert detection["detected"] == CONVERTIBLE[name].describe() == report["config_format"], detection


@pytest.mark.parametrize("name, backend", PAIRS)
def test_every_backend_holds_autoround_s_own_codes_zeros_and_scales(truths, name, backend, tmp_path):
    """Experts (and, where the backend converts them, dense linears): bit-exact against the quantizer;
    16-bit layers (routers, head, embeddings) byte for byte."""
    moeconv.convert(DATA / name, tmp_path / "out", backend=backend, workers=1)
    weights = converted_weights(tmp_path / "out", DATA / name, backend)
    experts = [prefix for prefix in weights if ".mlp.experts." in prefix]
    assert len(experts) == 2 * 3, sorted(weights)
    _assert_truth(weights, truths[name])
    output = open_checkpoint(tmp_path / "out")
    with TensorReader() as reader:
        for kept in ("lm_head.weight", "model.layers.0.mlp.gate.weight", "model.embed_tokens.weight"):
            source = open_checkpoint(DATA / name).tensors[kept]
            assert output.tensors[kept].dtype == source.dtype == "BF16"
            assert reader.read_raw(output.tensors[kept]).tobytes() == reader.read_raw(source).tobytes(), kept
    if backend == "compressed-tensors":  # a whole-checkpoint scheme: the 16-bit layers listed as such
        config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
        assert {"lm_head", "model.layers.0.mlp.gate"} <= set(config["ignore"]), config["ignore"]


def test_compressed_tensors_output_reads_back_in_the_library(truths, tmp_path):
    """The real compressed-tensors library reads every converted linear (signed symmetric scales
    included) back as AutoRound's quantizer made it."""
    name = "ar-gptq-sym-g32"
    moeconv.convert(DATA / name, tmp_path / "out", backend="compressed-tensors", workers=1)
    truth = tmp_path / "truth.safetensors"
    save_file(truths[name], str(truth))
    proc = subprocess.run([str(PACKERS_VENV / "bin" / "python"), str(ROOT / "tests" / "packers" / "ct_readback.py"),
                           str(tmp_path / "out"), str(truth)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["problems"] == [] and result["checked"] == len(truths[name]) // 3


@pytest.mark.parametrize("name, packing, message", [
    ("ar-plain-asym-g32", "auto_round:auto_gptq", "checkpoint_format"),  # v2 zeros labelled v1
    ("ar-gptq-sym-g32", "auto_round", "checkpoint_format"),  # v1 filler 0x77777777 labelled v2
    ("ar-awq-asym-g32", "auto_round:auto_gptq", "packed like awq"),  # AWQ words labelled GPTQ
])
def test_the_packing_name_is_a_claim_the_data_must_confirm(truths, name, packing, message, tmp_path, capsys):
    lying = _relabel(DATA / name, tmp_path / "lying", {**_config(name), "packing_format": packing})
    code, _, err = run_main(capsys, "convert", lying, "-o", tmp_path / "refused")
    assert code == 2 and message in err and "--trust-data" in err, err
    plan = make_plan(lying, backend="triton", trust="data")
    assert plan.source_format == CONVERTIBLE[name]
    experts = [job for job in plan.jobs if isinstance(job, ExpertJob)]
    assert len(experts) == 2
    with TensorReader() as reader:
        for job in experts:  # --trust-data: the quantizer's codes, zeros and scales
            decoded, _ = transform.source_weights(job, plan.codec, reader)
            _assert_truth({next(iter(job.sources[p].values())).key.rsplit(".", 1)[0]: weight
                           for p, weight in decoded.items()}, truths[name])


def test_symmetric_scales_are_signed(truths):
    """AutoRound maps each group's largest magnitude to -8: about half the symmetric scales are negative,
    and they arrive as they are."""
    scales = torch.cat([value.flatten() for key, value in truths["ar-gptq-sym-g32"].items() if key.endswith(".scales")])
    assert 0.3 < float((scales < 0).float().mean()) < 0.7


def test_awq_export_of_a_symmetric_model_converts_as_symmetric_and_inspect_says_why(capsys):
    """AutoRound's `auto_awq` export of a symmetric model: zero_point false, and qzeros all 0x88888888."""
    assert _config("awq-sym-g32")["zero_point"] is False
    report = moeconv.inspect(DATA / "awq-sym-g32")
    assert any("0x88888888" in line and "symmetric" in line for line in report["detection"]["evidence"])
    code, out, _ = run_main(capsys, "inspect", DATA / "awq-sym-g32")
    assert code == 0 and "0x88888888" in out


def test_varying_zeros_under_zero_point_false_are_refused_and_trust_config_says_why(tmp_path, capsys):
    """Real AWQ zero points (AutoRound's asymmetric AWQ packing) under a config saying zero_point false."""
    lying = _relabel(DATA / "ar-awq-asym-g32", tmp_path / "lying",
                     {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": False})
    code, _, err = run_main(capsys, "convert", lying, "-o", tmp_path / "refused")
    assert code == 2 and "zero_point=False" in err and "--trust-data" in err, err
    code, out, err = run_main(capsys, "convert", lying, "-o", tmp_path / "config", "--trust-config", "-q")
    assert code == 2, out + err
    assert "Traceback" not in out + err, err
    (error,) = [line for line in err.splitlines() if line.startswith("error:")]  # one line, after the trust note
    assert "qzeros hold zero points other than 8" in error and "model.safetensors: model.layers.0.mlp.experts.0" in error
    assert not (tmp_path / "config").exists()
    assert run_main(capsys, "convert", lying, "-o", tmp_path / "data", "--trust-data", "-q")[0] == 0


@pytest.mark.parametrize("name", ["ar-gptq-sym-g32-partial"])
def test_a_partial_last_group_is_refused_naming_the_linear(name, tmp_path, capsys):
    """K = 48 with group 32: AutoRound pads the last group with zeros (qweight holds 64 rows of codes).
    No layout moeconv writes holds a partial group: refused naming the linear, nothing written."""
    code, _, err = run_main(capsys, "convert", DATA / name, "-o", tmp_path / "out")
    assert code == 2, err
    assert "down_proj" in err and "K = 48" in err and "group size 32" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["ar-gptq-sym-g32-mixed"])
def test_per_layer_quantized_overrides_are_refused_naming_the_layer(name, capsys, tmp_path):
    config = _config(name)
    assert config["extra_config"]["model.layers.0.self_attn.q_proj"]["bits"] == 8
    code, _, err = run_main(capsys, "convert", DATA / name, "-o", tmp_path / "out")
    assert code == 2 and "model.layers.0.self_attn.q_proj" in err and "per-layer" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("backend", ALL)
def test_a_dense_linear_extra_config_keeps_16_bit_passes_through_on_every_backend(truths, backend, tmp_path):
    """AutoRound 0.16.1 asked to keep o_proj at 16 bits writes extra_config {"bits": 16} and its bf16 weight:
    every backend copies it byte for byte (humming and compressed-tensors convert the other attention
    linears, which match the quantizer), and compressed-tensors lists it in `ignore`."""
    name, kept = "ar-gptq-sym-g32-keep16", "model.layers.0.self_attn.o_proj"
    assert _config(name)["extra_config"][kept] == {"bits": 16}
    moeconv.convert(DATA / name, tmp_path / "out", backend=backend, workers=1)
    weights = converted_weights(tmp_path / "out", DATA / name, backend)
    _assert_truth(weights, truths[name])
    dense = {prefix for prefix in weights if ".self_attn." in prefix}
    assert dense == ({f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}
                     if backend in ("humming", "compressed-tensors") else set()), sorted(weights)
    source, output = open_checkpoint(DATA / name), open_checkpoint(tmp_path / "out")
    assert source.tensors[f"{kept}.weight"].dtype == output.tensors[f"{kept}.weight"].dtype == "BF16"
    assert not [tensor for tensor in output.tensors if tensor.startswith(kept + ".") and tensor != f"{kept}.weight"]
    with TensorReader() as reader:
        assert reader.read_raw(output.tensors[f"{kept}.weight"]).tobytes() == \
            reader.read_raw(source.tensors[f"{kept}.weight"]).tobytes()
    if backend == "compressed-tensors":
        config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
        assert {kept, "model.layers.0.mlp.gate", "lm_head"} <= set(config["ignore"]), config["ignore"]


def test_sixteen_bit_overrides_pass_through(tmp_path):
    """An extra_config entry at 16 bits (AutoRound's routers and head) needs no scheme of its own."""
    config = {**_config("ar-gptq-sym-g32"), "extra_config": {"model.layers.0.self_attn.o_proj": {"bits": 16}}}
    assert format_from_config(config, "config.json") == GPTQ(4, 32, sym=True, checkpoint_format="gptq")


@pytest.mark.parametrize("change, message", [
    ({"data_type": "nv_fp"}, "data_type 'nv_fp'"),
    ({"data_type": "mx_fp"}, "data_type 'mx_fp'"),
    ({"act_bits": 8}, "act_bits 8"),
    ({"packing_format": "auto_round:fp8"}, "packing_format 'auto_round:fp8'"),
    ({"extra_config": {"model.layers.0.mlp.experts.0.down_proj": {"bits": 4, "data_type": "fp"}}},
     "data_type 'fp' for layer model.layers.0.mlp.experts.0.down_proj"),
    ({"extra_config": {"model.layers.0.mlp.experts.0.down_proj": {"bits": 8}}},
     "layer model.layers.0.mlp.experts.0.down_proj is quantized with bits 8"),
    ({"packing_format": "auto_round:auto_awq", "bits": 8}, "AWQ with 8 bits"),
    ({"extra_config": ["lm_head"]}, "extra_config must be an object"),
    ({"extra_config": {"lm_head": 16}}, "extra_config\\['lm_head'\\] must be an object"),
    ({"bits": "4"}, "bits must be an integer"),
])
def test_what_is_not_an_integer_scheme_moeconv_reads_is_refused_by_name(change, message):
    with pytest.raises(MoeconvError, match="config.json: .*" + message.replace("(", r"\(")):
        format_from_config({**_config("ar-gptq-sym-g32"), **change}, "config.json")


def test_the_intel_alias_and_old_packing_names_read_the_same_words():
    config = _config("ar-gptq-sym-g32")
    want = format_from_config(config, "config.json")
    for change in ({"quant_method": "intel/auto-round"}, {"packing_format": "auto_round:gptq"},
                   {"packing_format": None}):
        assert format_from_config({**config, **change}, "config.json") == want
    awq = format_from_config(_config("ar-awq-asym-g32"), "config.json")
    assert format_from_config({**_config("ar-awq-asym-g32"), "packing_format": "auto_round:awq"}, "c") == awq


@pytest.mark.parametrize("name", ["ar-gptq-sym-g32", "ar-awq-asym-g32", "ar-plain-asym-g32"])
def test_outputs_that_keep_autoround_dense_layers_are_served_where_vllm_reads_their_config(name, tmp_path):
    """triton copies symmetric GPTQ and AWQ dense linears in the source's own config, which vLLM 0.33 serves
    with its INC method for quant_method 'auto-round' with the auto_gptq / auto_awq packings only (`make
    test-engines`: 'Unsupported packing_format: auto_round'; 'Invalid quantization method' for the
    intel/auto-round alias); the plain packing's asymmetric dense linears are written in compressed-tensors.
    So every triton output here is served, and the same checkpoint under the alias is not."""
    assert make_plan(DATA / name, backend="triton").serving.engine is not None
    assert make_plan(DATA / name, backend="compressed-tensors").serving.engine == "stock vLLM 0.33"
    alias = _relabel(DATA / name, tmp_path / "alias", {**_config(name), "quant_method": "intel/auto-round"})
    plan = make_plan(alias, backend="triton")
    if plan.dense_layout is None:  # copied: under a name vLLM does not read
        assert plan.serving.engine is None and "'intel/auto-round'" in plan.serving.how, plan.serving
        assert "--backend compressed-tensors" in plan.serving.how
    else:
        assert name == "ar-plain-asym-g32" and plan.serving.engine is not None
