"""`verify` passes on a good conversion and fails, saying why, on every kind of damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeconv.checkpoint.reader import open_checkpoint
from moeconv.convert import convert
from moeconv.errors import MoeconvError
from moeconv.plan import make_plan
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.kernels.runners import NUMERICS_TOLERANCE
from moeconv.verify import verify

from helpers import cli, reseal

LAYER = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify")
    source = make_checkpoint(root / "src", SynthSpec(layers=2, experts=4, hidden=128, intermediate=64),
                             max_shard_size=200_000)
    convert(make_plan(source, max_shard_size=200_000), root / "out")
    return source, root / "out"


@pytest.fixture
def damaged(converted, tmp_path) -> tuple[Path, Path]:
    """A private copy of the converted folder, to break."""
    source, out = converted
    copy = tmp_path / "out"
    copy.mkdir()
    for path in out.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    return source, copy


def _flip_byte(folder: Path, tensor: str, expert: int, offset: int = 0, mask: int = 0x01,
               update_manifest: bool = True) -> None:
    """XOR one byte of one expert's slice; optionally re-sign the manifest so that only the
    lossless or numerics level can notice (a converter that is consistent but wrong)."""
    entry = open_checkpoint(folder).tensors[tensor]
    position = entry.begin + expert * (entry.nbytes // entry.shape[0]) + offset
    with open(entry.file, "r+b") as handle:
        handle.seek(position)
        value = handle.read(1)[0]
        handle.seek(position)
        handle.write(bytes([value ^ mask]))
    if update_manifest:
        reseal(folder, entry.file)


def test_good_conversion_passes(converted):
    source, out = converted
    report = verify(out)
    assert report.ok, report.failures()
    assert report.source == str(source.absolute())
    assert [layer.experts_exact for layer in report.layers] == [4, 4]
    assert report.passthrough_checked > 0
    for layer in report.layers:
        assert layer.relative_error is not None and layer.relative_error < NUMERICS_TOLERANCE


def test_good_conversion_cli_json_and_exit_0(converted):
    _, out = converted
    result = cli("verify", out, "--json", "--sample", "2")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and all(layer["experts_checked"] == 2 for layer in report["layers"])


@pytest.mark.parametrize("tensor, expert, offset, mask, expected", [
    (f"{LAYER}.w13_qweight", 2, 5, 0x10, "expert 2 gate: codes: 1 byte(s) differ"),
    (f"{LAYER}.w2_qweight", 3, 0, 0x01, "expert 3 down: codes: 1 byte(s) differ"),
    (f"{LAYER}.w13_scales", 1, 1, 0x04, "expert 1 gate: scales: 1 byte(s) differ"),
    (f"{LAYER}.w2_qzeros", 0, 0, 0x01, "expert 0 down: zeros: 1 byte(s) differ"),
])
def test_one_changed_byte_fails_lossless(damaged, tensor, expert, offset, mask, expected):
    _, out = damaged
    _flip_byte(out, tensor, expert, offset, mask)
    report = verify(out, level="lossless")
    assert not report.ok
    assert any(expected in failure for failure in report.failures()), report.failures()


def test_changed_weight_byte_also_fails_numerics(damaged):
    """The kernel reads the converted bytes, the reference reads the source: a large corruption of a
    routed expert's weights shows up as a relative error far above the tolerance."""
    _, out = damaged
    for expert in range(4):
        for offset in range(0, 64 * 64, 7):
            _flip_byte(out, f"{LAYER}.w13_qweight", expert, offset, 0x88, update_manifest=False)
    entry = open_checkpoint(out).tensors[f"{LAYER}.w13_qweight"]
    reseal(out, entry.file)
    report = verify(out)
    layer = next(layer for layer in report.layers if layer.module == LAYER)
    assert layer.relative_error > NUMERICS_TOLERANCE
    assert not report.ok


def test_file_bytes_differ_from_manifest(damaged):
    _, out = damaged
    _flip_byte(out, f"{LAYER}.w2_scales", 0, update_manifest=False)
    result = cli("verify", out)
    assert isinstance(result.exception, MoeconvError) and result.exception.exit_code == 1
    assert "digest or size differs from moeconv.json" in str(result.exception)


def test_missing_tensor_fails_structure(damaged):
    _, out = damaged
    index = json.loads((out / "model.safetensors.index.json").read_text())
    file_name = index["weight_map"].pop(f"{LAYER}.w13_qzeros")
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / file_name)
    del tensors[f"{LAYER}.w13_qzeros"]
    save_file(tensors, out / file_name)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    report = verify(out)
    assert f"tensor {LAYER}.w13_qzeros is missing" in report.failures()
    assert not report.ok


def test_changed_passthrough_tensor_fails(damaged):
    _, out = damaged
    entry = open_checkpoint(out).tensors["model.layers.0.self_attn.q_proj.qweight"]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(b"\x00\x00\x00\x00")
    reseal(out, entry.file)
    report = verify(out, level="lossless")
    assert any("model.layers.0.self_attn.q_proj.qweight differs from the source" in f for f in report.failures())


def test_config_disagreeing_with_conversion_fails(damaged):
    _, out = damaged
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["has_zp"] = False
    (out / "config.json").write_text(json.dumps(config))
    report = verify(out, level="lossless")
    assert "config.json: quantization_config does not describe this conversion" in report.failures()


def test_verify_against_a_different_source_fails(damaged, tmp_path):
    _, out = damaged
    other = make_checkpoint(tmp_path / "other", SynthSpec(layers=2, experts=4, hidden=128, intermediate=64, seed=7))
    with pytest.raises(MoeconvError, match="other: not the source .*out was made from") as refusal:
        verify(out, source=other, level="lossless")
    assert "\n" not in str(refusal.value)


def test_not_a_moeconv_output(tmp_path):
    result = cli("verify", tmp_path)
    assert isinstance(result.exception, MoeconvError) and result.exception.exit_code == 2
    assert str(result.exception) == f"{tmp_path}: no moeconv.json: not a folder written by `moeconv convert`"
    result = cli("verify", tmp_path / "missing")
    assert str(result.exception) == f"{tmp_path / 'missing'}: not a folder (give the folder `moeconv convert -o` wrote)"


def test_levels_stop_where_asked(damaged):
    """--level structure checks files and checksums only (a consistent but wrong byte passes it, the
    lossless level catches it); lossless runs no kernel; an unknown level is a one-line error."""
    source, out = damaged
    _flip_byte(out, f"{LAYER}.w13_qweight", expert=2)
    structure = verify(out, level="structure")
    assert structure.ok and not structure.layers and structure.passthrough_checked == 0
    lossless = verify(out, level="lossless")
    assert not lossless.ok and all(layer.relative_error is None for layer in lossless.layers)
    result = cli("verify", out, "--level", "everything")
    assert result.exit_code != 0
    with pytest.raises(MoeconvError, match="verify level 'everything' is not one of structure, lossless, numerics"):
        verify(out, level="everything")
