"""Data-driven format detection: configs that lie, both ways, are caught before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.models import architecture_from_config
from moeconv.plan import make_plan
from moeconv.survey import detect_format
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import cli


def _lie(source: Path, **fields) -> None:
    """Make config.json (and quantize_config.json, where present) claim something else."""
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"].update(fields)
    (source / "config.json").write_text(json.dumps(config))
    quantize_config = source / "quantize_config.json"
    if quantize_config.is_file():
        data = json.loads(quantize_config.read_text())
        data.update(fields)
        quantize_config.write_text(json.dumps(data))


def _make(tmp_path: Path, source_format) -> Path:
    return make_checkpoint(tmp_path / "src", SynthSpec(source_format=source_format, layers=2, experts=8, hidden=256,
                                                       intermediate=128))


@pytest.mark.parametrize("truth, claim, message", [
    (GPTQ(4, 32, sym=False, checkpoint_format="gptq"), {"checkpoint_format": "gptq_v2"},
     "config says checkpoint_format=gptq_v2 but the tensors look like checkpoint_format=gptq (v1)"),
    (GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"), {"checkpoint_format": "gptq"},
     "config says checkpoint_format=gptq (v1) but the tensors look like checkpoint_format=gptq_v2"),
    (GPTQ(4, 32, sym=True, checkpoint_format="gptq_v2"), {"checkpoint_format": "gptq"},
     "config says checkpoint_format=gptq (v1) but the tensors look like checkpoint_format=gptq_v2"),
    (GPTQ(8, 64, sym=False), {"bits": 4}, "config says bits=4 but the tensors look like bits=8"),
    (GPTQ(4, 64, sym=True), {"sym": False}, "config says sym=False but the tensors look like sym=True"),
    (GPTQ(4, 64, sym=False), {"group_size": 128}, "config says group_size=128 but the tensors look like group_size=64"),
])
def test_lying_gptq_config_is_refused_with_the_reason(tmp_path, truth, claim, message):
    source = _make(tmp_path, truth)
    _lie(source, **claim)
    with pytest.raises(MoeconvError, match="--trust-config or --trust-data") as refusal:
        make_plan(source)
    assert message in str(refusal.value)
    assert make_plan(source, trust="data").source_format == truth


def test_awq_tensors_under_a_gptq_config(tmp_path):
    source = _make(tmp_path, AWQ(4, 32, zero_point=True))
    _lie(source, quant_method="gptq", sym=False)
    with pytest.raises(MoeconvError, match="config says gptq but the tensors are packed like awq"):
        make_plan(source)


def test_trust_data_converts_and_verifies(tmp_path):
    source = _make(tmp_path, GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"))
    _lie(source, checkpoint_format="gptq")
    result = cli("convert", source, "-o", tmp_path / "out", "--trust-data", "--quiet")
    assert result.exit_code == 0, result.output
    report = cli("verify", tmp_path / "out", "--level", "lossless", "--json")
    assert report.exit_code == 0, report.output
    assert json.loads((tmp_path / "out" / "moeconv.json").read_text())["arguments"]["trust"] == "data"


def test_trust_config_follows_the_config(tmp_path):
    source = _make(tmp_path, GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"))
    _lie(source, checkpoint_format="gptq")
    plan = make_plan(source, trust="config")
    assert plan.source_format.checkpoint_format == "gptq"
    assert plan.detection.disagreements


def test_inspect_reports_the_disagreement_without_failing(tmp_path):
    source = _make(tmp_path, GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"))
    _lie(source, checkpoint_format="gptq")
    result = cli("inspect", source, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config_format"]["checkpoint_format"] == "gptq"
    assert report["format"]["checkpoint_format"] == "gptq_v2"
    assert report["detection"]["disagreements"]


@pytest.mark.parametrize("truth", [GPTQ(4, 32, sym=False), GPTQ(8, -1, sym=True, checkpoint_format="gptq_v2"),
                                   AWQ(4, 64, zero_point=False), AWQ(4, 32, zero_point=True), GPTQ(2, 32, sym=False)],
                         ids=str)
def test_honest_configs_pass_detection(tmp_path, truth):
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=truth, experts=4, hidden=256, intermediate=128))
    checkpoint = open_checkpoint(source)
    configured, detection = detect_format(checkpoint, architecture_from_config(checkpoint.config, "config.json"))
    assert configured == truth
    assert detection.disagreements == [] and detection.detected == truth


def test_data_that_cannot_decide_v1_from_v2_stops_the_conversion_until_the_user_decides(tmp_path, monkeypatch, capsys):
    """Weights that do not average to zero (every group shifted by about half a code) put the codes off
    both readings' zero points: neither v1 nor v2 is near 0, so the detection says undecided, with the
    numbers, and convert refuses (exit 2, one line) rather than follow the label. --gptq-zero-format
    (or --trust-config) decides; the manifest and verify say the user decided, not the data."""
    from moeconv import synth as synth_module

    plain = synth_module.random_weight
    monkeypatch.setattr(synth_module, "random_weight", lambda *args: plain(*args) + 0.01)
    source = _make(tmp_path, GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"))
    configured, detection = detect_format(open_checkpoint(source), architecture_from_config(
        json.loads((source / "config.json").read_text()), "config.json"))
    assert detection.disagreements == []
    assert len(detection.undecided) == 1 and "cannot tell GPTQ v1 zero points" in detection.undecided[0]
    from helpers import run_main

    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 2 and not (tmp_path / "out").exists()
    assert len(err.strip().splitlines()) == 1 and "--gptq-zero-format v1 or v2" in err, err
    assert "the config's gptq_v2" in err
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", "--gptq-zero-format", "v2")
    assert code == 0, err
    assert "decided by you, not by the data: --gptq-zero-format gptq_v2" in err
    manifest = json.loads((tmp_path / "out" / "moeconv.json").read_text())
    assert manifest["arguments"]["zero_format"] == "gptq_v2"
    assert manifest["format_decision"]["decided_by_user"][0].startswith("--gptq-zero-format gptq_v2: ")
    code, out, err = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "--json")
    assert code == 0, err
    assert json.loads(out)["decided_by_user"][0].startswith("--gptq-zero-format gptq_v2: ")
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out2", "-q", "--trust-config")
    assert code == 0 and "decided by you, not by the data: --trust-config" in err
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out3", "-q", "--gptq-zero-format", "v3")
    assert code == 2 and "choose v1 or v2" in err


def test_gptq_zero_format_the_data_contradicts_is_refused(tmp_path, capsys):
    """The flag answers what the data cannot decide; where the data does decide, a contrary flag is a
    contradiction like a contrary label."""
    from helpers import run_main

    source = _make(tmp_path, GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"))
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", "--gptq-zero-format", "v1")
    assert code == 2 and "(as --gptq-zero-format says)" in err and "checkpoint_format=gptq_v2" in err, err
    awq = make_checkpoint(tmp_path / "awq", SynthSpec(source_format=AWQ(), experts=4, hidden=256, intermediate=128))
    code, _, err = run_main(capsys, "convert", awq, "-o", tmp_path / "out", "-q", "--gptq-zero-format", "v1")
    assert code == 2 and "--gptq-zero-format is for GPTQ checkpoints; this one is awq" in err, err
