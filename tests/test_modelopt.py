"""Checkpoints written by the REAL NVIDIA ModelOpt 0.47.0 (tests/data/modelopt/, made by
tests/packers/make_modelopt.py in its own venv: a tiny Qwen3-MoE quantized on CPU with ModelOpt's INT4
presets and exported by `export_hf_checkpoint`), converted to every backend and compared bit for bit with
what ModelOpt's own quantizer makes of each linear (`int4-g32.truth.safetensors`: the codes and scales the
packer computed from the float weights and ModelOpt's `get_scaling_factor`, before any packing). Nothing
here decodes a source with moeconv's reading to make the expectation.

The truth is committed (ModelOpt's venv is not part of `make test`); `made.json` records the versions and
the float model's digest.
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
from moeconv.formats import ModelOpt, format_from_config
from moeconv.plan import make_plan

from helpers import ROOT, converted_weights, packers_python, run_main

DATA = Path(__file__).resolve().parent / "data" / "modelopt"
PLAIN, AWQ = DATA / "int4-g32", DATA / "int4-awq-g32"
# block 32 on a 128/64 model; ModelOpt's default block 128 on a 256/128 model (down_proj: one group)
CONVERTIBLE = {"int4-g32": 32, "int4-g128": 128}
EXPERTS = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
DENSE = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
KEPT = ("lm_head.weight", "model.layers.0.mlp.gate.weight", "model.embed_tokens.weight")


@pytest.fixture(scope="module")
def truths() -> dict[str, dict[str, torch.Tensor]]:
    return {name: load_file(str(DATA / f"{name}.truth.safetensors")) for name in CONVERTIBLE}


@pytest.fixture(scope="module")
def truth(truths) -> dict[str, torch.Tensor]:
    return truths["int4-g32"]


def _assert_truth(weights: dict, truth: dict[str, torch.Tensor]) -> None:
    for prefix, weight in weights.items():
        assert np.array_equal(weight.codes, truth[f"{prefix}.codes"].numpy()), prefix
        assert np.array_equal(weight.effective_zeros(), truth[f"{prefix}.zeros"].numpy()), prefix
        assert weight.scales.dtype == np.float32, prefix
        assert np.array_equal(weight.scales.view(np.int32), truth[f"{prefix}.scales"].view(torch.int32).numpy()), prefix


@pytest.mark.parametrize("name", list(CONVERTIBLE))
def test_the_export_is_read_as_modelopt_int4_and_the_data_confirms_it(name):
    report = moeconv.inspect(DATA / name)
    detection = report["detection"]
    assert detection["disagreements"] == [] and detection["undecided"] == [], detection
    assert detection["detected"] == ModelOpt(group_size=CONVERTIBLE[name]).describe() == report["config_format"]
    assert "no expert linear stores a pre_quant_scale" in detection["evidence"]
    assert report["scale_dtype"] == "F32"
    # config.json names only the method and algorithm; the group size is in hf_quant_config.json
    assert "group_size" not in json.loads((DATA / name / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("name", list(CONVERTIBLE))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backend_holds_modelopt_s_own_codes_and_scales(truths, name, backend, tmp_path):
    """Experts (and, where the backend converts them, the attention linears): bit-exact against
    ModelOpt's quantizer; 16-bit layers byte for byte; ModelOpt's hf_quant_config.json not copied."""
    source_dir = DATA / name
    moeconv.convert(source_dir, tmp_path / "out", backend=backend, workers=1)
    weights = converted_weights(tmp_path / "out", source_dir, backend)
    converts_dense = backend in ("compressed-tensors", "humming")
    assert sorted(weights) == sorted(EXPERTS + (DENSE if converts_dense else [])), sorted(weights)
    _assert_truth(weights, truths[name])
    output, source = open_checkpoint(tmp_path / "out"), open_checkpoint(source_dir)
    with TensorReader() as reader:
        kept = KEPT if converts_dense else KEPT + tuple(f"{p}.{s}" for p in DENSE for s in ("weight", "weight_scale"))
        for name in kept:  # copied: the bytes as ModelOpt wrote them
            assert output.tensors[name].dtype == source.tensors[name].dtype
            assert reader.read_raw(output.tensors[name]).tobytes() == reader.read_raw(source.tensors[name]).tobytes(), name
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    if backend == "compressed-tensors":
        config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
        assert {"lm_head", "model.layers.0.mlp.gate"} <= set(config["ignore"]), config["ignore"]
        assert config["config_groups"]["group_0"]["weights"]["symmetric"] is True


@pytest.mark.packers
def test_compressed_tensors_output_reads_back_in_the_library(tmp_path):
    """The real compressed-tensors library (0.20.1, .venv-packers) validates the config and reads every
    converted linear back as ModelOpt's quantizer made it (float32 scales included)."""
    python = packers_python()
    moeconv.convert(PLAIN, tmp_path / "out", backend="compressed-tensors", workers=1)
    proc = subprocess.run([str(python), str(ROOT / "tests" / "packers" / "ct_readback.py"), str(tmp_path / "out"),
                           str(DATA / "int4-g32.truth.safetensors")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["problems"] == [] and result["checked"] == len(EXPERTS + DENSE)


def test_copied_modelopt_dense_layers_are_not_said_to_be_served(tmp_path):
    """vLLM 0.33's ModelOpt methods read FP8, NVFP4 and MXFP8 only: the triton output keeps ModelOpt's
    int4 attention, so no engine serves it as it is; --backend auto takes compressed-tensors."""
    plan = make_plan(PLAIN, backend="triton")
    assert plan.serving.engine is None and "ModelOpt W4A16_AWQ" in plan.serving.how
    assert make_plan(PLAIN, backend="auto").backend.name == "compressed-tensors"


def test_awq_pre_quant_scales_are_refused_naming_the_reason_and_the_linears(tmp_path, capsys):
    """INT4_AWQ_CFG: every expert projection has a pre_quant_scale that is not 1 (averaged over the
    experts by the exporter): refused before anything is written, by inspect and by every backend."""
    scale = load_file(str(AWQ / "model.safetensors"))["model.layers.0.mlp.experts.0.gate_proj.pre_quant_scale"]
    assert not bool((scale == 1).all())
    for backend in BACKENDS:
        code, _, err = run_main(capsys, "convert", AWQ, "-o", tmp_path / backend, "--backend", backend)
        assert code == 2, err
        (line,) = err.strip().splitlines()
        assert line == (
            f"error: {AWQ / 'model.safetensors'}: pre_quant_scale is not 1 on 6 of 6 linears "
            "(model.layers.0.mlp.experts.0.down_proj, model.layers.0.mlp.experts.0.gate_proj, "
            "model.layers.0.mlp.experts.0.up_proj and 3 more): ModelOpt's AWQ scales these linears' input "
            "channels at run time, which no layout moeconv writes can hold, and dropping it would change every "
            "output; refusing rather than converting without it (a ModelOpt export calibrated without AWQ, e.g. "
            "INT4_BLOCKWISE_WEIGHT_ONLY_CFG, stores none)"), line
        assert not (tmp_path / backend).exists()
    code, _, err = run_main(capsys, "inspect", AWQ)
    assert code == 2 and "pre_quant_scale is not 1 on 6 of 6 linears" in err


def _with_pre_quant_scales(tmp_path: Path, scales: dict[str, torch.Tensor]) -> Path:
    """The plain export with pre_quant_scale tensors added (as ModelOpt's AWQ stores them: (K,) bf16)."""
    folder = tmp_path / "with-scales"
    shutil.copytree(PLAIN, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({f"{prefix}.pre_quant_scale": value for prefix, value in scales.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_pre_quant_scales_of_one_are_dropped_and_the_rest_converts_exactly(truth, tmp_path):
    ones = {prefix: torch.ones(128 if "down" not in prefix else 64, dtype=torch.bfloat16) for prefix in EXPERTS}
    source = _with_pre_quant_scales(tmp_path, ones)
    detection = moeconv.inspect(source)["detection"]
    assert "6 of 6 expert linears store a pre_quant_scale, all ones" in detection["evidence"]
    moeconv.convert(source, tmp_path / "out", backend="triton", workers=1)
    _assert_truth(converted_weights(tmp_path / "out", source, "triton"), truth)
    assert not any(name.endswith("pre_quant_scale") for name in open_checkpoint(tmp_path / "out").tensors)


def test_a_dense_pre_quant_scale_is_copied_by_triton_and_refused_by_a_backend_that_converts_it(tmp_path, capsys):
    """o_proj's pre_quant_scale (the experts have none): triton copies the linear with it, byte for byte;
    compressed-tensors, which re-encodes dense linears, refuses naming the linear."""
    scale = torch.full((64,), 1.5, dtype=torch.bfloat16)
    source = _with_pre_quant_scales(tmp_path, {"model.layers.0.self_attn.o_proj": scale})
    moeconv.convert(source, tmp_path / "triton", backend="triton", workers=1)
    with TensorReader() as reader:
        copied = open_checkpoint(tmp_path / "triton").tensors["model.layers.0.self_attn.o_proj.pre_quant_scale"]
        assert reader.read_raw(copied).tobytes() == scale.view(torch.int16).numpy().tobytes()
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "ct", "--backend", "compressed-tensors", "-q")
    assert code == 2, err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "model.layers.0.self_attn.o_proj: pre_quant_scale is not 1" in line, line
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("change, message", [
    ({"quant_algo": "FP8"}, "ModelOpt quant_algo 'FP8' is not read"),
    ({"quant_algo": "NVFP4"}, "ModelOpt NVFP4 group_size 32: NVFP4 blocks are 16 wide"),  # its own format's refusal
    ({"quant_algo": "MIXED_PRECISION"}, "ModelOpt quant_algo 'MIXED_PRECISION' is not read"),
    ({"has_zero_point": True}, "has_zero_point true"),
    ({"group_size": 48}, "group_size 48 is not -1 or a power of two"),
])
def test_what_is_not_modelopt_int4_is_refused_by_name(change, message):
    config = {"quant_method": "modelopt", "quant_algo": "W4A16_AWQ", "group_size": 32, "has_zero_point": False}
    assert format_from_config(config, "config.json") == ModelOpt(group_size=32)
    with pytest.raises(MoeconvError, match="config.json: .*" + message):
        format_from_config({**config, **change}, "config.json")
