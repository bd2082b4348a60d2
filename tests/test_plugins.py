"""A new backend and a new source format are one module and one registry entry each: the toy ones in
tests/plugins/ run convert -> verify end to end, through each other and through the built-in ones,
with no other file changed."""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import pytest

from moeconv import backends, formats, transform
from moeconv.backends import BackendEntry
from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint

PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture
def registered(monkeypatch):
    """The toy backend and format, each added to its registry as a user's plugin would be."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setitem(backends.REGISTRY, "toy", BackendEntry("toy_backend:ToyBackend", "bytes, for a test"))
    toy_format = importlib.import_module("toy_format").ToyFormat
    monkeypatch.setitem(formats.REGISTRY, "toyq", toy_format)
    return toy_format


@pytest.mark.parametrize("source_format, backend", [("toyq", "toy"), ("toyq", "triton"), ("gptq", "toy"),
                                                    ("toyq", "compressed-tensors")])
def test_convert_and_verify_through_the_toy_plugins(registered, tmp_path, source_format, backend):
    import moeconv

    fmt = registered(bits=4, group_size=32) if source_format == "toyq" else GPTQ(bits=4, group_size=32, sym=False)
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=fmt, hidden=64, intermediate=64))
    report = moeconv.convert(source, tmp_path / "out", backend=backend)
    manifest = json.loads((tmp_path / "out" / "moeconv.json").read_text())
    assert manifest["backend"] == backend and manifest["format"]["method"] == source_format
    verdict = moeconv.verify(tmp_path / "out", numerics_layers=1)
    assert verdict.ok, verdict.failures()
    assert all(layer.experts_exact == layer.experts_checked == 4 for layer in verdict.layers)
    assert verdict.layers[0].relative_error is not None and verdict.layers[0].relative_error < verdict.tolerance
    assert report.plan["backend"] == backend


@pytest.mark.parametrize("source_format, backend", [("toyq", "toy"), ("toyq", "triton"), ("gptq", "toy"),
                                                    ("toyq", "compressed-tensors")])
def test_the_toy_plugins_take_the_packed_route(registered, tmp_path, monkeypatch, source_format, backend):
    """Their `to_packed` and `from_packed` give the toy plugins the fast path into (and from) every layout and
    format that takes the packed form, byte for byte what the canonical route writes."""
    import moeconv

    fmt = registered(bits=4, group_size=32) if source_format == "toyq" else GPTQ(bits=4, group_size=32, sym=False)
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=fmt, hidden=64, intermediate=64))
    assert moeconv.convert(source, tmp_path / "fast", backend=backend, workers=1).plan["route"] == "packed"
    monkeypatch.setattr(transform, "takes_packed", lambda job, codec: False)
    assert moeconv.convert(source, tmp_path / "slow", backend=backend, workers=1).plan["route"] == "canonical"
    digests = [{path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in (tmp_path / folder).iterdir()
                if path.suffix == ".safetensors"} for folder in ("fast", "slow")]
    assert digests[0] == digests[1] and digests[0]


def test_the_toy_format_is_detected_from_data_and_audited(registered, tmp_path):
    """Its `from_data` runs (a config claiming 2 bits over 4-bit codes is called out) and its own audit
    kind reaches inspect's report (a zero point of 255 in a 4-bit checkpoint)."""
    import moeconv
    from moeconv.checkpoint.reader import open_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=registered(bits=4, group_size=32),
                                                         hidden=64, intermediate=64))
    entry = open_checkpoint(source).tensors["model.layers.0.mlp.experts.2.up_proj.zeros"]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(b"\xff")
    report = moeconv.inspect(source)
    assert report["toy_zeros_out_of_range"] == {"count": 1, "first_tensor": "model.layers.0.mlp.experts.2.up_proj"}
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["bits"] = 2
    (source / "config.json").write_text(json.dumps(config))
    report = moeconv.inspect(source)
    assert any("config says bits=2 but the tensors look like bits=4" in d for d in report["detection"]["disagreements"])


def test_a_verify_of_a_damaged_toy_output_fails(registered, tmp_path):
    """The generic lossless check reads the toy backend's slots: one flipped code byte is caught."""
    import moeconv
    from moeconv.checkpoint.reader import open_checkpoint
    from helpers import reseal

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=registered(), hidden=64, intermediate=64))
    moeconv.convert(source, tmp_path / "out", backend="toy")
    entry = open_checkpoint(tmp_path / "out").tensors["model.layers.1.mlp.experts.w2.codes"]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin + entry.nbytes * 3 // 4)  # expert 3
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 1]))
    reseal(tmp_path / "out", entry.file)  # as if the writer itself had put the wrong byte
    verdict = moeconv.verify(tmp_path / "out", level="lossless")
    assert not verdict.ok
    assert any("expert 3 down" in failure for failure in verdict.failures()), verdict.failures()
