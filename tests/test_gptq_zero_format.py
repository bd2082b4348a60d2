"""GPTQ v1 vs v2 on checkpoints the REAL GPTQ algorithm quantized (error feedback, calibration).

tests/data/gptq_asym/ was made by tests/packers/make_gptq_asym_set.py in .venv-packers: tiny Qwen3-MoE
models quantized asymmetrically by GPTQModel 7.7 (saved once as v1 and once as v2, the same quantization)
and, for b4_g32, by auto-gptq 0.7.1's own GPTQ (v1). `truth.safetensors` holds the quantizers' true zero
points (GPTQModel's from its v2 save, auto-gptq's from its quantizer). Each checkpoint is read as
labelled and relabelled with the other checkpoint_format: the zero points moeconv converts with must be
the quantizer's, or the conversion must stop. b4_g32_offset's weights are shifted off zero (by 0.12 of
their spread, about half a code): there the data cannot decide, and convert must say so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.plan import make_plan

from helpers import run_main

DATA = Path(__file__).parent / "data" / "gptq_asym"
DECIDED = [("b4_g32", "v1", "gptq"), ("b4_g32", "v2", "gptq_v2"), ("b4_g32", "autogptq", "gptq"),
           ("b8_g32", "v1", "gptq"), ("b8_g32", "v2", "gptq_v2")]


def relabelled(folder: Path, to: Path, checkpoint_format: str) -> Path:
    shutil.copytree(folder, to)
    for name in ("config.json", "quantize_config.json"):
        path = to / name
        config = json.loads(path.read_text())
        section = config.get("quantization_config", config)
        section["checkpoint_format"] = section["format"] = checkpoint_format
        path.write_text(json.dumps(config))
    return to


def truth(case: str, variant: str) -> dict[str, torch.Tensor]:
    key = "autogptq_zeros" if variant == "autogptq" else "zeros"
    with safe_open(str(DATA / case / "truth.safetensors"), "pt") as handle:
        return {name.removesuffix(f".{key}"): handle.get_tensor(name) for name in handle.keys()
                if name.endswith(f".{key}")}


def zeros_converted_with(plan) -> dict[str, torch.Tensor]:
    """The true zero points the plan's reading decodes from every routed-expert linear."""
    found = {}
    with TensorReader() as reader:
        for layer in plan.layers:
            for expert in layer.experts:
                for tensors in expert.values():
                    values = {suffix: reader.read_raw(entry) for suffix, entry in tensors.items()}
                    prefix = tensors["qweight"].name.removesuffix(".qweight")
                    found[prefix] = torch.from_numpy(plan.source_format.decode(values).zeros)
    return found


@pytest.mark.parametrize("case, variant, true_format", DECIDED, ids=lambda v: str(v))
@pytest.mark.parametrize("label", ["gptq", "gptq_v2"])
def test_real_gptq_output_converts_with_the_quantizers_zero_points_whatever_the_label(tmp_path, case, variant,
                                                                                      true_format, label):
    source = relabelled(DATA / case / variant, tmp_path / "src", label)
    kwargs = {"trust": "data"} if label != true_format else {}
    plan = make_plan(open_checkpoint(source), backend="triton", **kwargs)
    assert plan.source_format.checkpoint_format == true_format
    assert plan.detection.undecided == [] and plan.detection.decided_by_user == []
    if label != true_format:  # without --trust-data the mislabel is refused, naming it
        with pytest.raises(MoeconvError, match="config says checkpoint_format"):
            make_plan(open_checkpoint(source), backend="triton")
    expected = truth(case, variant)
    found = zeros_converted_with(plan)
    assert set(found) == set(expected) and len(found) > 0
    for prefix, zeros in found.items():
        assert torch.equal(zeros, expected[prefix]), prefix


def test_real_gptq_output_the_data_cannot_decide_stops_and_converts_exactly_once_decided(tmp_path, capsys):
    source = DATA / "b4_g32_offset" / "v2"
    for label in ("gptq", "gptq_v2"):
        folder = relabelled(source, tmp_path / f"src-{label}", label)
        code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / f"out-{label}", "-q")
        assert code == 2 and "cannot tell GPTQ v1 zero points" in err, err
        assert not (tmp_path / f"out-{label}").exists()
    folder = tmp_path / "src-gptq"  # labelled v1, but it is v2: the user knows and says so
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "out", "-q", "--gptq-zero-format", "v2")
    assert code == 0, err
    plan = make_plan(open_checkpoint(folder), backend="triton", zero_format="gptq_v2")
    expected = truth("b4_g32_offset", "v2")
    for prefix, zeros in zeros_converted_with(plan).items():
        assert torch.equal(zeros, expected[prefix]), prefix
    code, out, err = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "--json")
    assert code == 0, err
    assert json.loads(out)["decided_by_user"], out


# The statistic's numbers as `inspect` printed them when it computed them with torch (main at aa014db,
# recorded on 2026-12-02 before the detection moved to numpy): the numpy statistic must print the same.
TORCH_EVIDENCE = {
    ("b4_g32", "v1"): "trimmed mean over 256 interior groups of 2 linears of (mean code − zero): v1 reading +0.06, "
                      "v2 reading +1.06 (± 0.04)",
    ("b4_g32", "v2"): "trimmed mean over 256 interior groups of 2 linears of (mean code − zero): v1 reading -0.94, "
                      "v2 reading +0.06 (± 0.04)",
    ("b4_g32", "autogptq"): "trimmed mean over 128 interior groups of 1 linears of (mean code − zero): v1 reading "
                            "-0.01, v2 reading +0.99 (± 0.05)",
    ("b4_g32_offset", "v2"): "trimmed mean over 128 interior groups of 1 linears of (mean code − zero): v1 reading "
                             "-0.57, v2 reading +0.43 (± 0.05)",
    ("b8_g32", "v1"): "trimmed mean over 6144 interior groups of 24 linears of (mean code − zero): v1 reading +0.04, "
                      "v2 reading +1.04 (± 0.11)",
    ("b8_g32", "v2"): "trimmed mean over 6144 interior groups of 24 linears of (mean code − zero): v1 reading -0.96, "
                      "v2 reading +0.04 (± 0.11)",
}


@pytest.mark.parametrize("case, variant", list(TORCH_EVIDENCE))
def test_the_numpy_statistic_prints_what_the_torch_one_printed(capsys, case, variant):
    """Same numbers, same decision (DECIDED, or undecided for the offset case), on the real GPTQ output."""
    code, out, err = run_main(capsys, "inspect", DATA / case / variant, "--json")
    assert code == 0, err
    detection = json.loads(out)["detection"]
    assert TORCH_EVIDENCE[case, variant] in detection["evidence"]
    decided = {(c, v): fmt for c, v, fmt in DECIDED}
    if (case, variant) in decided:
        assert detection["detected"]["checkpoint_format"] == decided[case, variant] and not detection["undecided"]
    else:
        assert detection["undecided"] and TORCH_EVIDENCE[case, variant] in detection["undecided"][0]
