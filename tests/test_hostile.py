"""Hostile and unlucky inputs: every case ends as a clean error (one line, exit 2, nothing written,
the source untouched) or as a success whose reading equals the unmutated source's.

Two parts: a property-based mutation suite over safetensors headers, index files and configs
(hypothesis draws where to cut and what to put there), and a catalogue of named classes (special
files, links, locks, full disks, damaged journals). `test_outcome_totals` reruns a fixed-seed sample
of the mutation suite and prints the totals per class for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import importlib
import json
import os
import re
import struct
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeconv.checkpoint.reader import open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, CompressedTensors, ModelOpt
from moeconv.plan import make_plan
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import run_main, tree

FORMATS = {
    "gptq": GPTQ(4, 32, sym=False),
    "awq": AWQ(4, 64, zero_point=True),
    "ct-pack": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w8a8": CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
}

MORE_FORMATS = {"modelopt": ModelOpt(group_size=32)}  # for the named catalogues only, not the mutation suite


def _pristine(base: Path, source_format) -> Path:
    root = make_checkpoint(base / "src", SynthSpec(source_format=source_format, layers=2, experts=4, hidden=128,
                                                   intermediate=64), max_shard_size=60_000)
    assert len(list(root.glob("*.safetensors"))) > 1
    return root


def _shard(root: Path) -> Path:
    """The shard that holds the most tensors (every pristine checkpoint has several shards)."""
    listed = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"].values()
    return root / Counter(listed).most_common(1)[0][0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _pristine(tmp_path_factory.mktemp("pristine"), FORMATS["gptq"])


@pytest.fixture(scope="module", params=list(FORMATS))
def pristine_any(request, tmp_path_factory) -> Path:
    """One pristine checkpoint per source format, for the mutation suite."""
    return _pristine(tmp_path_factory.mktemp(f"pristine-{request.param}"), FORMATS[request.param])


def _copy(source: Path, destination: Path) -> Path:
    destination.mkdir(parents=True)
    for path in source.iterdir():
        (destination / path.name).write_bytes(path.read_bytes())
    return destination


def _reading(root: Path) -> dict:
    """What moeconv makes of a checkpoint: every tensor's dtype, shape and bytes (hashed), and the plan's format."""
    checkpoint = open_checkpoint(root)
    tensors = {}
    for name, entry in checkpoint.tensors.items():
        with open(entry.file, "rb") as handle:
            handle.seek(entry.begin)
            tensors[name] = (entry.dtype, entry.shape, hashlib.sha256(handle.read(entry.nbytes)).hexdigest())
    described = make_plan(checkpoint).source_format.describe()
    # What activations the scheme quantizes is not in the weights: a config that changes only that
    # describes the same weights (W8A8 and W8A16 int-quantized experts are the same bytes).
    weights = {key: value for key, value in described.items() if key not in ("scheme", "activations")}
    return {"tensors": tensors, "format": weights}


def _outcome(root: Path, reference: dict) -> str:
    """'error' (a one-line MoeconvError), 'same' (success, the same reading as the unmutated source),
    or anything else as a failure description."""
    try:
        got = _reading(root)
    except MoeconvError as error:
        message = str(error)
        return "error" if message and "\n" not in message else f"multi-line error: {message!r}"
    except Exception as error:  # noqa: BLE001 (the point: nothing else may escape)
        return f"{type(error).__name__}: {error}"
    return "same" if got == reference else "success on nonsense"


# ------------------------------------------------------------------------------ the mutation suite

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6)


def _paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices), the root included."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, prefix + (index,))


def _mutate(document, path, action, new_value):
    """A copy of `document` with the value at `path` replaced, deleted, or given a sibling."""
    document = copy.deepcopy(document)
    if not path:
        return new_value
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "add" and isinstance(parent, dict):
        parent[f"{last}_extra"] = new_value
    else:
        parent[last] = new_value
    return document


def _split_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write_shard(path: Path, header, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


TARGETS = ("header", "index", "config")


def _apply(root: Path, target: str, pick: int, action: str, new_value) -> None:
    if target == "header":
        header, data = _split_shard(_shard(root))
        paths = list(_paths(header))
        _write_shard(_shard(root), _mutate(header, paths[pick % len(paths)], action, new_value), data)
        return
    name = "model.safetensors.index.json" if target == "index" else "config.json"
    document = json.loads((root / name).read_text())
    paths = list(_paths(document))
    (root / name).write_text(json.dumps(_mutate(document, paths[pick % len(paths)], action, new_value)))


MUTATION = st.tuples(st.sampled_from(TARGETS), st.integers(0, 10**6), st.sampled_from(("replace", "delete", "add")),
                     JSON_VALUES)


@settings(max_examples=int(os.environ.get("MOECONV_MUTATIONS", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=MUTATION)
def test_mutated_json_is_a_clean_error_or_the_same_reading(pristine_any, tmp_path_factory, mutation):
    reference = _reading(pristine_any)
    root = _copy(pristine_any, tmp_path_factory.mktemp("mutant") / "src")
    try:
        _apply(root, *mutation)
    except (KeyError, IndexError, TypeError):  # the path vanished under an earlier step of the same mutation
        return
    outcome = _outcome(root, reference)
    assert outcome in ("error", "same"), (mutation, outcome)


def test_outcome_totals(pristine_any, tmp_path, capsys):
    """A fixed sample of the mutation suite, counted per outcome class (for docs/BENCHMARKS.md: printed when
    MOECONV_MUTATION_TOTALS sets the number of cases)."""
    import random

    pristine = pristine_any
    generator = random.Random(20261201)
    reference = _reading(pristine)
    totals: Counter = Counter()
    values = [None, True, False, 0, -1, 4.7, 2**64, "four", "false", [], {}, [1, 2], {"a": 1}, "F16", [-1, 2]]
    for case in range(int(os.environ.get("MOECONV_MUTATION_TOTALS", "250"))):
        root = _copy(pristine, tmp_path / f"m{case}")
        mutation = (generator.choice(TARGETS), generator.randrange(10**6),
                    generator.choice(("replace", "delete", "add")), generator.choice(values))
        try:
            _apply(root, *mutation)
        except (KeyError, IndexError, TypeError):
            continue
        outcome = _outcome(root, reference)
        totals[(mutation[0], outcome if outcome in ("error", "same") else "FAILURE")] += 1
        assert outcome in ("error", "same"), (mutation, outcome)
        if case % 5 == 0:  # and through the CLI: inspect, then convert and verify what converted
            for command in (["inspect", root], ["convert", root, "-o", tmp_path / f"o{case}", "-q"]):
                code, _, err = run_main(capsys, *command)
                assert code == 0 or (code == 2 and len(err.strip().splitlines()) == 1), (mutation, command, err)
                totals[(mutation[0], f"cli {command[0]} exit {code}")] += 1
            if (tmp_path / f"o{case}").exists():
                code, out, err = run_main(capsys, "verify", tmp_path / f"o{case}", "--numerics-layers", "1")
                assert code == 0, (mutation, out, err)
    if "MOECONV_MUTATION_TOTALS" in os.environ:  # asked for, to measure: printed; `make test` stays quiet
        with capsys.disabled():
            print(f"\nmutation outcomes ({pristine.parent.name}):", dict(sorted(totals.items())), file=sys.stderr)
    assert sum(count for (_, outcome), count in totals.items() if not outcome.startswith("cli")) > 100


# ------------------------------------------------------------------------------ the catalogue


def _raw_header(root: Path, header_bytes: bytes) -> None:
    _, data = _split_shard(_shard(root))
    (_shard(root)).write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def _edit_header(root: Path, edit) -> None:
    header, data = _split_shard(_shard(root))
    edit(header)
    _write_shard(_shard(root), header, data)


def _replace_shard(root: Path, make, keep: Path | None = None) -> None:
    """Remove the first shard (keeping its bytes at `keep`, if given) and `make` something in its place."""
    path = _shard(root)
    if keep is not None:
        keep.write_bytes(path.read_bytes())
    path.unlink()
    make(path)


def _first_tensor(header: dict) -> dict:
    return header[next(name for name in header if name != "__metadata__")]


def _edit_json(root: Path, name: str, edit) -> None:
    document = json.loads((root / name).read_text())
    edit(document)
    (root / name).write_text(json.dumps(document))


def _quant(edit):
    return lambda c: edit(c["quantization_config"])


CATALOGUE = {
    "header not JSON": (lambda r: _raw_header(r, b"{not json"), "not valid JSON"),
    "header invalid UTF-8": (lambda r: _raw_header(r, b'{"\xff\xfe": 1}'), "not valid UTF-8"),
    "header deep nesting": (lambda r: _raw_header(r, b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    "header huge float": (lambda r: _raw_header(r, b'{"a": {"dtype": "F16", "shape": [1e400], "data_offsets": [0, 2]}}'),
                          "must be a non-negative integer, not inf"),
    "header huge integer": (lambda r: _raw_header(r, b'{"a": {"dtype": "F16", "shape": [' + b"9" * 5000 + b'], '
                                                     b'"data_offsets": [0, 2]}}'), "not valid JSON"),
    "header NaN": (lambda r: _raw_header(r, b'{"a": {"dtype": "F16", "shape": [NaN], "data_offsets": [0, 2]}}'),
                   "NaN is not JSON"),
    "header is a list": (lambda r: _raw_header(r, b"[1, 2]"), "header is not a JSON object"),
    "header length past the file": (lambda r: (_shard(r)).write_bytes(struct.pack("<Q", 10**9) + b"{}"),
                                    "header length"),
    "dtype not in the spec": (lambda r: _edit_header(r, lambda h: _first_tensor(h).update(dtype="Q7")),
                              "is not a safetensors dtype"),
    "shape with a bool": (lambda r: _edit_header(r, lambda h: _first_tensor(h).update(shape=[True])),
                          "must be a non-negative integer, not True"),
    "shape with a float": (lambda r: _edit_header(r, lambda h: _first_tensor(h).update(shape=[2.0])),
                           "must be a non-negative integer, not 2.0"),
    "negative offsets": (lambda r: _edit_header(r, lambda h: _first_tensor(h).update(data_offsets=[-2, 0])),
                         "must be a non-negative integer, not -2"),
    "header entry with another key": (lambda r: _edit_header(r, lambda h: _first_tensor(h).update(offsets=[0, 2])),
                                      "header entry must have exactly dtype, shape and data_offsets"),
    "offsets not the shape's bytes": (lambda r: _edit_header(r, lambda h: _first_tensor(h).update(
        shape=[*_first_tensor(h)["shape"], 2])), "data_offsets hold"),
    "offsets past the buffer": (lambda r: _edit_header(r, lambda h: _first_tensor(h).update(data_offsets=[0, 10**12])),
                                "lie outside"),
    "overlapping tensors": (lambda r: _edit_header(r, lambda h: [info.update(data_offsets=[0, info["data_offsets"][1]
                                                                                           - info["data_offsets"][0]])
                                                                 for name, info in h.items() if name != "__metadata__"]),
                            "overlap"),
    "metadata not strings": (lambda r: _edit_header(r, lambda h: h.update(__metadata__={"format": 1})),
                             "__metadata__ must be an object of strings"),
    "index weight_map a list": (lambda r: _edit_json(r, "model.safetensors.index.json",
                                                     lambda i: i.update(weight_map=[1])), "weight_map must be"),
    "index path with ..": (lambda r: _edit_json(r, "model.safetensors.index.json", lambda i: i["weight_map"].update(
        {next(iter(i["weight_map"])): "../x.safetensors"})), "not a plain file name"),
    "index absolute path": (lambda r: _edit_json(r, "model.safetensors.index.json", lambda i: i["weight_map"].update(
        {next(iter(i["weight_map"])): "/etc/passwd"})), "not a plain file name"),
    "config a list": (lambda r: (r / "config.json").write_text("[]"), "expected a JSON object at the top level"),
    "quantization_config a string": (lambda r: _edit_json(r, "config.json", lambda c: c.update(
        quantization_config="gptq")), "quantization_config must be an object"),
    "bits 4.7": (lambda r: [_edit_json(r, n, lambda c: (c.get("quantization_config", c)).update(bits=4.7))
                            for n in ("config.json", "quantize_config.json")], "bits must be an integer, not 4.7"),
    "bits four": (lambda r: [_edit_json(r, n, lambda c: (c.get("quantization_config", c)).update(bits="four"))
                             for n in ("config.json", "quantize_config.json")], "bits must be an integer, not 'four'"),
    "group_size true": (lambda r: [_edit_json(r, n, lambda c: (c.get("quantization_config", c)).update(group_size=True))
                                   for n in ("config.json", "quantize_config.json")], "group_size must be an integer"),
    "experts 1e9": (lambda r: _edit_json(r, "config.json", lambda c: c.update(num_experts=10**9)),
                    "but config.json says 1000000000"),
    "layers 1e9": (lambda r: _edit_json(r, "config.json", lambda c: c.update(num_hidden_layers=10**9)),
                   "num_hidden_layers is 1000000000, but the tensors hold 2 numbered layers"),
    "layers a float": (lambda r: _edit_json(r, "config.json", lambda c: c.update(num_hidden_layers=1e9)),
                       "num_hidden_layers is 1000000000.0, not a positive integer"),
    "experts per token past the experts": (lambda r: _edit_json(r, "config.json", lambda c: c.update(
        num_experts_per_tok=10**9)), "num_experts_per_tok is 1000000000, more than the 4 experts of a layer"),
    "hidden_size a string": (lambda r: _edit_json(r, "config.json", lambda c: c.update(hidden_size="128")),
                             "hidden_size is '128', not a positive integer"),
    "model_type a number": (lambda r: _edit_json(r, "config.json", lambda c: c.update(model_type=5)),
                            "model_type must be a string"),
    "truncated shard": (lambda r: (_shard(r)).write_bytes((_shard(r)).read_bytes()[:-100]), "lie outside"),
    "vanished shard": (lambda r: _replace_shard(r, lambda path: None), "shard is missing"),
    "shard is a folder": (lambda r: _replace_shard(r, Path.mkdir), "not a regular file"),
    "config is a FIFO": (lambda r: ((r / "config.json").unlink(), os.mkfifo(r / "config.json")), "not a regular file"),
    "shard is a FIFO": (lambda r: _replace_shard(r, os.mkfifo), "not a regular file"),
    "shard links outside": (lambda r: _replace_shard(r, lambda path: path.symlink_to(
        r.parent / "elsewhere.safetensors"), keep=r.parent / "elsewhere.safetensors"),
                            "a link that leaves the checkpoint folder"),
}


@pytest.mark.timeout(60)  # a FIFO that blocked would hang here
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_is_one_line_exit_2_nothing_written(pristine, tmp_path, capsys, name):
    break_it, expected = CATALOGUE[name]
    root = _copy(pristine, tmp_path / "src")
    break_it(root)
    before = {path.name: path.stat().st_mtime_ns for path in root.iterdir()}
    code, out, err = run_main(capsys, "convert", root, "-o", tmp_path / "out", "-q")
    assert code == 2, (out, err)
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging left behind
    assert {path.name: path.stat().st_mtime_ns for path in root.iterdir()} == before  # the source untouched



# ------------------------------------------------------------------------------ tensors against their format


def _edit_tensor(root: Path, name: str, edit) -> None:
    """`edit(entry)` on tensor `name`'s header entry, in whichever shard holds it."""
    shard = root / json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][name]
    header, data = _split_shard(shard)
    edit(header[name])
    _write_shard(shard, header, data)


def _zero_sized_first_in_its_linear(root: Path, name: str) -> None:
    """`name` emptied (shape [0, N], no bytes), and the linear's g_idx moved to the head of the header, as
    a checkpoint whose header lists names in order has it (the linear's first tensor was named)."""
    shard = root / json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][name]
    header, data = _split_shard(shard)
    header[name].update(shape=[0, header[name]["shape"][1]],
                        data_offsets=[header[name]["data_offsets"][0]] * 2)
    g_idx = name.rsplit(".", 1)[0] + ".g_idx"
    _write_shard(shard, {g_idx: header.pop(g_idx), **header}, data)


FIRST = "model.layers.0.mlp.experts.0.gate_proj"  # the first linear detection samples
OTHER = "model.layers.1.mlp.experts.2.up_proj"


def _same_bytes_as(dtype: str, columns: float = 1):
    """The entry's dtype replaced, its last dimension scaled so that its bytes stay the same."""
    return lambda entry: entry.update(dtype=dtype, shape=[*entry["shape"][:-1], int(entry["shape"][-1] * columns)])


# name -> (source format, the edit, the text the one-line refusal holds: the tensor, what it is, what it should be)
TENSOR_CATALOGUE = {
    "qweight F32 (the same bytes)": ("gptq", lambda r: _edit_tensor(r, f"{FIRST}.qweight", _same_bytes_as("F32")),
                                     f"tensor {FIRST}.qweight is F32[16, 64], expected I32[16, 64]"),
    "qweight F16 twice as wide": ("gptq", lambda r: _edit_tensor(r, f"{FIRST}.qweight", _same_bytes_as("F16", 2)),
                                  f"tensor {FIRST}.qweight is F16[16, 128]"),
    "qzeros F32": ("gptq", lambda r: _edit_tensor(r, f"{FIRST}.qzeros", _same_bytes_as("F32")),
                   f"tensor {FIRST}.qzeros is F32[4, 8], expected I32[4, 8]"),
    "qzeros F16 twice as wide": ("gptq", lambda r: _edit_tensor(r, f"{FIRST}.qzeros", _same_bytes_as("F16", 2)),
                                 f"tensor {FIRST}.qzeros is F16[4, 16], expected I32[4, 8]"),
    "qzeros of half the groups": ("gptq", lambda r: _edit_tensor(r, f"{FIRST}.qzeros", lambda e: e.update(
        shape=[2, 8], data_offsets=[e["data_offsets"][0], e["data_offsets"][0] + 64])),
                                  f"tensor {FIRST}.qzeros is I32[2, 8], expected I32[4, 8]"),
    "scales I16": ("gptq", lambda r: _edit_tensor(r, f"{OTHER}.scales", _same_bytes_as("I16")),
                   f"tensor {OTHER}.scales is I16[4, 64], expected a float dtype[4, 64]"),
    "scales BF16 in one expert": ("gptq", lambda r: _edit_tensor(r, f"{OTHER}.scales", _same_bytes_as("BF16")),
                                  f"tensor {OTHER}.scales is BF16[4, 64], but"),
    "g_idx F16": ("gptq", lambda r: _edit_tensor(r, f"{FIRST}.g_idx", _same_bytes_as("F16", 2)),
                  f"tensor {FIRST}.g_idx is F16[256], expected I32[128]"),
    "g_idx F32": ("gptq", lambda r: _edit_tensor(r, f"{OTHER}.g_idx", _same_bytes_as("F32")),
                  f"tensor {OTHER}.g_idx is F32[128], expected I32[128]"),
    "zero-sized qweight of one expert": ("gptq", lambda r: _zero_sized_first_in_its_linear(r, f"{OTHER}.qweight"),
                                         f"tensor {OTHER}.qweight is I32[0, 64], which makes a 64x0"),
    "weight_packed F16": ("ct-pack", lambda r: _edit_tensor(r, f"{FIRST}.weight_packed", _same_bytes_as("F16", 2)),
                          f"tensor {FIRST}.weight_packed is F16[64, 32]"),
    "weight_packed F32": ("ct-pack", lambda r: _edit_tensor(r, f"{FIRST}.weight_packed", _same_bytes_as("F32")),
                          f"tensor {FIRST}.weight_packed is F32[64, 16], expected I32[64, 16]"),
    "weight_zero_point F32": ("ct-pack", lambda r: _edit_tensor(r, f"{OTHER}.weight_zero_point", _same_bytes_as("F32")),
                              f"tensor {OTHER}.weight_zero_point is F32[8, 4], expected I32[8, 4]"),
    "weight_shape F64": ("ct-pack", lambda r: _edit_tensor(r, f"{OTHER}.weight_shape", _same_bytes_as("F64")),
                         f"tensor {OTHER}.weight_shape is F64[2], expected I64[2]"),
    "weight_scale I16": ("ct-pack", lambda r: _edit_tensor(r, f"{OTHER}.weight_scale", _same_bytes_as("I16")),
                         f"tensor {OTHER}.weight_scale is I16[64, 4], expected a float dtype[64, 4]"),
    "awq qzeros F32": ("awq", lambda r: _edit_tensor(r, f"{FIRST}.qzeros", _same_bytes_as("F32")),
                       f"tensor {FIRST}.qzeros is F32[2, 8], expected I32[2, 8]"),
    "W8A8 weight U8 (the same bytes)": ("ct-w8a8", lambda r: _edit_tensor(r, f"{FIRST}.weight", _same_bytes_as("U8")),
                                        f"tensor {FIRST}.weight is U8[64, 128], expected I8[64, 128]"),
    "W8A8 weight_scale I16": ("ct-w8a8", lambda r: _edit_tensor(r, f"{OTHER}.weight_scale", _same_bytes_as("I16")),
                              f"tensor {OTHER}.weight_scale is I16[64, 1], expected a float dtype[64, 1]"),
    "modelopt weight I8": ("modelopt", lambda r: _edit_tensor(r, f"{FIRST}.weight", _same_bytes_as("I8")),
                           f"tensor {FIRST}.weight is I8[32, 128], expected U8[32, 128]"),
    "modelopt weight_scale I16": ("modelopt", lambda r: _edit_tensor(r, f"{OTHER}.weight_scale", _same_bytes_as("I16")),
                                  f"tensor {OTHER}.weight_scale is I16[64, 4], expected a float dtype[64, 4]"),
    "awq qzeros of one group": ("awq", lambda r: _edit_tensor(r, f"{FIRST}.qzeros", lambda e: e.update(
        shape=[1, 8], data_offsets=[e["data_offsets"][0], e["data_offsets"][0] + 32])),
                                f"tensor {FIRST}.qzeros is I32[1, 8], expected I32[2, 8]"),
}


@pytest.fixture(scope="module")
def pristine_of(tmp_path_factory):
    """The pristine checkpoint of a format in FORMATS, made once per module."""
    made: dict[str, Path] = {}

    def pristine(key: str) -> Path:
        if key not in made:
            made[key] = _pristine(tmp_path_factory.mktemp(f"pristine-{key}"), {**FORMATS, **MORE_FORMATS}[key])
        return made[key]
    return pristine


@pytest.mark.filterwarnings("error")  # a warning on the way (numpy's cast of NaN words) fails the refusal
@pytest.mark.parametrize("name", list(TENSOR_CATALOGUE))
def test_a_tensor_unlike_its_format_is_refused_naming_it(pristine_of, tmp_path, capsys, name):
    """Every tensor's dtype and shape against what its format declares, from the header, before any value
    is read: one line naming the tensor, for inspect and convert alike, nothing written, no warning."""
    key, break_it, expected = TENSOR_CATALOGUE[name]
    root = _copy(pristine_of(key), tmp_path / "src")
    break_it(root)
    before = tree(tmp_path)  # the source, and nothing else: no output, lock or staging folder
    for command in (("inspect", root), ("convert", root, "-o", tmp_path / "out", "-q")):
        code, out, err = run_main(capsys, *command)
        assert code == 2, (command[0], out, err)
        assert expected in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "Warning" not in err, err
        assert tree(tmp_path) == before, command[0]


# ------------------------------------------------------------------------------ config patterns


def _targets(*targets: str):
    return lambda r: _edit_json(r, "config.json", _quant(lambda q: q["config_groups"]["group_0"].update(
        targets=list(targets))))


@pytest.mark.timeout(30, method="thread")  # a backtracking match holds the GIL: only the thread method ends it
@pytest.mark.parametrize("pattern", [r"(.*.*)*X", r"(.|..)*Q", r"(\w+\.?)*!"])
def test_a_backtracking_target_pattern_is_answered_at_once(pristine_of, tmp_path, capsys, pattern):
    """Alone, a pattern that takes in no expert is the refusal it always was; beside one that does, the
    checkpoint reads as before. Python's `re` takes hours on either against an expert's module name."""
    import time

    root = _copy(pristine_of("ct-pack"), tmp_path / "src")
    _targets(f"re:{pattern}")(root)
    before = tree(tmp_path)
    for command in (("inspect", root), ("convert", root, "-o", tmp_path / "out", "-q")):
        started = time.perf_counter()
        code, out, err = run_main(capsys, *command)
        assert time.perf_counter() - started < 5, command  # a hang would take hours
        assert code == 2 and "no group's targets cover the routed experts" in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert tree(tmp_path) == before, command[0]  # the source untouched, nothing written beside it
    _targets(f"re:{pattern}", r"re:.*mlp\.experts.*")(root)
    code, out, err = run_main(capsys, "inspect", root, "--json")
    assert code == 0 and json.loads(out)["config_format"]["method"] == "compressed-tensors", err


@pytest.mark.parametrize("pattern, message", [
    (r"(a)\1", "uses syntax moeconv does not match in linear time (RE2: invalid escape sequence: \\1)"),
    (r".*(?=experts)", "uses syntax moeconv does not match in linear time"),
    (r".*\Z", "\\Z (write $)"),
    (r".*mlp{,3}", "has a repeat {,n}"),
    (r"[[:alpha:]].*", "is not a valid Python pattern (Possible nested set"),
    ("(" * 3000 + ")" * 3000, "is longer than the 4096 characters"),
    ("(" * 1500 + ")" * 1500, "nests its groups deeper than Python's parser goes"),
])
def test_a_target_pattern_moeconv_cannot_match_faithfully_is_one_line(pristine_of, tmp_path, capsys, pattern, message):
    root = _copy(pristine_of("ct-pack"), tmp_path / "src")
    _targets(f"re:{pattern}")(root)
    before = tree(tmp_path)
    code, out, err = run_main(capsys, "inspect", root)
    assert code == 2 and message in err, err
    assert tree(tmp_path) == before
    assert "quantization_config.config_groups.group_0.targets: pattern" in err and str(root / "config.json") in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_duplicate_header_keys_with_different_entries(pristine, tmp_path):
    root = _copy(pristine, tmp_path / "src")
    header, data = _split_shard(_shard(root))
    name = next(n for n in header if n != "__metadata__")
    text = json.dumps(header)
    twin = json.dumps({name: {**header[name], "shape": [1]}})[1:-1]
    _raw_header(root, (text[:-1] + ", " + twin + "}").encode())
    with pytest.raises(MoeconvError, match="appears twice with different values"):
        open_checkpoint(root)


@pytest.mark.parametrize("text, refused", [
    ('{"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}', None),
    ('{"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}, '
     '"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}', "appears twice"),  # a duplicate tensor
    ('{"a": {"dtype": "F16", "shape": [1], "shape": [2], "data_offsets": [0, 2]}, '
     '"b": {"shape": [1], "data_offsets": [2, 4]}}', "appears twice"),  # a key twice in one entry
    ('{"__metadata__": {"format": "pt", "format": "np"}, '
     '"a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}', "appears twice"),  # metadata
    ('{"__metadata__": {"dtype": "x"}, "a": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}', None),
    ('{"a\\"dtype\\": ": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}}', None),  # a key in a name
])
def test_the_fast_header_parse_reads_what_the_strict_one_reads(text, refused):
    """schema.parse_header takes the C parser's result only when it provably equals the strict
    reading; every duplicate key is still refused, and every other header reads the same."""
    from moeconv.checkpoint.schema import parse_header, parse_json

    raw = text.encode()
    if refused:
        with pytest.raises(MoeconvError, match=refused):
            parse_header(raw, "h")
        return
    assert parse_header(raw, "h") == parse_json(raw, "h")


# ------------------------------------------------------------------------------ outputs and faults


def test_output_that_is_a_link_or_a_file_is_refused_before_any_work(pristine, tmp_path, capsys):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "link", "-q")
    assert code == 2 and "is a symbolic link" in err
    (tmp_path / "file").write_text("x")
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "file", "-q")
    assert code == 2 and "exists and is a file, not a folder" in err


def test_output_inside_the_source_through_a_link_is_refused(pristine, tmp_path, capsys):
    source = _copy(pristine, tmp_path / "src")
    (tmp_path / "alias").symlink_to(source)
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "alias" / ".." / "src" / "out", "-q")
    assert code == 2 and "must not be inside the source checkpoint" in err, err
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "alias" / "out", "-q")
    assert code == 2 and "must not be inside the source checkpoint" in err, err
    assert sorted(p.name for p in source.iterdir()) == sorted(p.name for p in pristine.iterdir())


def test_a_second_writer_is_refused_naming_the_first(pristine, tmp_path, capsys):
    import fcntl

    lock = tmp_path / ".out.moeconv-lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    os.write(fd, b"424242")
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process's lock (flock locks belong to the open file)
    try:
        code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    finally:
        os.close(fd)
    assert code == 2 and "another moeconv (pid 424242) is converting into this folder" in err, err
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")  # the lock is gone: it works
    assert code == 0, err
    assert not lock.exists()


def test_a_full_disk_is_one_line_naming_the_output_and_the_space_needed(pristine, tmp_path, capsys, monkeypatch):
    from moeconv.checkpoint import writer

    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    # one worker: this process writes, so the patch holds however workers would start (a forkserver once an
    # object store client exists in this process: storage.clients_started)
    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q", "--workers", "1")
    assert code == 2, err
    assert "out: no space left on the device; the conversion needs" in err
    assert re.search(r"needs [1-9]\d*\.\d\d (KB|MB) there", err), err  # a small output in its own unit, not 0.00 GB
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(writer.os, "pwrite", real)
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q", "--workers", "1")  # space freed: resumes
    assert code == 0, err


def test_a_shard_that_fails_its_flush_leaves_nothing_open_and_resumes(pristine, tmp_path, capsys, monkeypatch):
    """The first shard's fsync (on the finishing thread, while the next shard is being filled) fails as
    a full disk: one line, no descriptor left open, and the rerun writes the same bytes."""
    convert_module = importlib.import_module("moeconv.conversion")  # the module, not the package's function
    real = convert_module._finish_shard
    calls = {"n": 0}

    def full_disk_once(writer, hasher, path):
        calls["n"] += 1
        if calls["n"] == 1:
            hasher.cancel()
            writer.abort()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(writer, hasher, path)

    monkeypatch.setattr(convert_module, "_finish_shard", full_disk_once)
    descriptors = len(os.listdir("/proc/self/fd"))
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q", "--max-shard-size", "100KB")
    assert code == 2 and "out: no space left on the device" in err and len(err.strip().splitlines()) == 1, err
    assert len(os.listdir("/proc/self/fd")) == descriptors
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q", "--max-shard-size", "100KB")
    assert code == 0, err
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "again", "-q", "--max-shard-size", "100KB")
    assert code == 0, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "again").iterdir()}


def test_not_enough_free_space_is_refused_up_front(pristine, tmp_path, capsys, monkeypatch):
    import shutil as shutil_module

    convert_module = importlib.import_module("moeconv.conversion")  # the module, not the package's function

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(convert_module.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    assert code == 2 and re.search(r": 1\.00 KB free, but the conversion needs [1-9]\d*\.\d\d (KB|MB) more there", err), err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.moeconv-partial")]


@pytest.mark.parametrize("damage", ["{not json", "[]", '{"job": 1, "done": {"../x": {"bytes": 1, "sha256": "a"}}}'])
def test_a_damaged_journal_starts_over_and_the_result_is_exact(pristine, tmp_path, capsys, damage):
    assert run_main(capsys, "convert", pristine, "-o", tmp_path / "clean", "-q")[0] == 0
    staging = tmp_path / ".out.moeconv-partial"
    staging.mkdir()
    (staging / "moeconv-progress.json").write_text(damage)
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    assert code == 0, err
    for path in (tmp_path / "clean").glob("*.safetensors"):
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.experts.2.up_proj.qweight", "model.layers.1.input_layernorm.weight"])
def test_a_source_changed_after_an_interruption_refuses_to_resume(pristine, tmp_path, capsys, monkeypatch, tensor):
    """A converted tensor (hashed as it was read) or a pass-through one (compared with the output's
    bytes) changed in place, same size and modification time: the resume refuses in one line."""
    source = _copy(pristine, tmp_path / "src")
    convert_module = importlib.import_module("moeconv.conversion")  # the module, not the package's function
    real = convert_module._write_metadata

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "_write_metadata", interrupted)
    code, _, _ = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 3
    monkeypatch.setattr(convert_module, "_write_metadata", real)
    entry = open_checkpoint(source).tensors[tensor]
    times = entry.file.stat()
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        first = handle.read(1)
        handle.seek(entry.begin)
        handle.write(bytes([first[0] ^ 0x01]))
    os.utime(entry.file, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 2 and "the source changed since the interrupted conversion" in err, err
    assert "output shard" in err and "model-00001-of-00001.safetensors" in err, err  # the output shard named
    assert len(err.strip().splitlines()) == 1


def test_hub_ids_the_hub_library_rejects(capsys, tmp_path):
    code, _, err = run_main(capsys, "inspect", "org/na..me")
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_nonfinite_scales_are_converted_faithfully_and_reported(pristine, tmp_path, capsys):
    """A NaN and an infinite scale: inspect, convert and verify name them; the bytes still round-trip."""
    import torch

    source = _copy(pristine, tmp_path / "src")
    checkpoint = open_checkpoint(source)
    name = next(n for n in sorted(checkpoint.tensors) if ".experts.1.up_proj.scales" in n)
    entry = checkpoint.tensors[name]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(torch.tensor([float("nan"), float("inf")], dtype=torch.float16).numpy().tobytes())
    prefix = name.rsplit(".", 1)[0]
    code, out, err = run_main(capsys, "inspect", source, "--json")
    assert code == 0 and json.loads(out)["nonfinite_scales"] == {"count": 2, "first_tensor": prefix}
    code, out, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", "--json")
    assert code == 0 and json.loads(out)["nonfinite_scales"] == {"count": 2, "first_tensor": prefix}
    code, out, err = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "--json")
    report = json.loads(out)
    assert code == 0, err  # lossless: NaN bytes round-trip
    assert report["nonfinite_scales"] == {"count": 2, "first_tensor": prefix}


def test_interrupting_verify_or_inspect_is_one_line_exit_3(pristine, tmp_path):
    """Ctrl-C outside a conversion's write loop (here: while verify runs) is exit 3 and one line too."""
    import signal
    import subprocess

    exe = Path(sys.executable).with_name("moeconv")
    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=6, experts=16, hidden=256, intermediate=128))
    assert subprocess.run([str(exe), "convert", str(source), "-o", str(tmp_path / "out"), "-q"]).returncode == 0
    process = subprocess.Popen([str(exe), "verify", str(tmp_path / "out")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    seen = []  # its progress lines, until the first one: the verification is running (a fixed wait was
    while not seen or not seen[-1].startswith("verify: "):  # sometimes longer than the whole verify)
        line = process.stderr.readline()
        if not line:
            break
        seen.append(line)
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=120)
    stderr = "".join(seen) + rest
    if process.returncode == 0:
        pytest.skip("verify finished before the interrupt arrived")
    assert process.returncode == 3, stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted (SIGINT)") and "Traceback" not in stderr


def test_verify_progress_is_printed_as_lines_on_a_pipe(pristine, tmp_path, monkeypatch):
    """On a pipe the progress is lines with bytes, rate and ETA (a terminal gets a bar)."""
    import subprocess

    exe = Path(sys.executable).with_name("moeconv")
    assert subprocess.run([str(exe), "convert", str(pristine), "-o", str(tmp_path / "out"), "-q"]).returncode == 0
    done = subprocess.run([str(exe), "verify", str(tmp_path / "out"), "--numerics-layers", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("verify: digests of both sides and the bit-exact check, bytes read ")]
    assert lines and "(100%)" in lines[-1] and "/s, ETA" in lines[-1], done.stderr


def test_a_read_only_parent_is_one_line_exit_2(pristine, tmp_path, capsys, monkeypatch):
    """Root ignores permission bits, so the read-only filesystem is simulated: creating anything
    beside the output fails with EROFS, as on a read-only mount."""
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    assert code == 2 and "cannot create files there (Read-only file system)" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ the trust boundary: side files


@pytest.mark.parametrize("name, target", [
    ("notes.txt", "/proc/self/environ"),  # moeconv's environment: tokens, cloud keys
    ("tokenizer_config.json", "outside"),  # a secret file elsewhere on the machine
    ("chat_template.jinja", "/dev/zero"),  # a device: would stream forever
])
def test_a_side_file_linking_outside_the_source_is_refused(pristine, tmp_path, capsys, name, target):
    """Nothing outside the source folder reaches an output: a link out is refused in one line naming
    the file, before any work (no output, no staging, no lock left); --skip-unsafe-files leaves it out
    and lists it, and the output verifies."""
    source = _copy(pristine, tmp_path / "src")
    if target == "outside":
        (tmp_path / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY----- secret")
        target = tmp_path / "id_rsa"
    (source / name).unlink(missing_ok=True)
    (source / name).symlink_to(target)
    code, out, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 2, out + err
    assert err.strip().splitlines() == [err.strip()] and f"{source / name}: a link that leaves the checkpoint folder" in err
    assert "--skip-unsafe-files" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src"] + (["id_rsa"] if "id_rsa" in str(target) else []))
    code, out, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", "--skip-unsafe-files", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert name in report["skipped_files"] and "a link that leaves the checkpoint folder" in report["skipped_files"][name]
    assert not (tmp_path / "out" / name).exists()
    manifest = json.loads((tmp_path / "out" / "moeconv.json").read_text())
    assert name not in manifest["copied_files"] and name in manifest["skipped_files"]
    assert b"secret" not in b"".join(p.read_bytes() for p in (tmp_path / "out").iterdir())
    assert f"note: {name} not copied" in err
    code, out, err = run_main(capsys, "verify", tmp_path / "out", "--level", "structure")
    assert code == 0, out + err


def test_side_files_are_copied_only_when_regular_and_of_a_model_folders_kinds(pristine, tmp_path, capsys):
    """Regular files of a model folder's kinds (a link to one inside the folder too) are copied with
    their digests; a folder, a FIFO, other kinds and stray safetensors are listed as skipped, with why."""
    source = _copy(pristine, tmp_path / "src")
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "LICENSE").write_text("Apache-2.0")
    (source / "extra").mkdir()
    (source / "extra" / "vocab.txt").write_text("a\nb\n")
    (source / "vocab.txt").symlink_to(Path("extra") / "vocab.txt")  # a link inside the folder: fine
    os.mkfifo(source / "merges.txt")
    (source / "pytorch_model.bin").write_bytes(b"\0" * 16)
    (source / "consolidated.safetensors").write_bytes((source / next(iter(sorted(
        p.name for p in source.glob("*.safetensors"))))).read_bytes())
    code, out, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", "--json")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "moeconv.json").read_text())
    from helpers import blocks_digest

    copied = manifest["copied_files"]
    assert set(copied) == {"generation_config.json", "tokenizer_config.json", "tokenizer.json", "LICENSE", "vocab.txt"}
    for name, recorded in copied.items():
        data = (source / name).read_bytes()
        assert (tmp_path / "out" / name).read_bytes() == data
        assert recorded == {"bytes": len(data), "blake3_64mib_blocks": blocks_digest(data, 64 << 20)}
    skipped = manifest["skipped_files"]
    assert skipped == json.loads(out)["skipped_files"]
    assert "a folder" in skipped["extra"] and "not a regular file" in skipped["merges.txt"]
    assert "not a kind of file" in skipped["pytorch_model.bin"]
    assert "not one of the checkpoint's shards" in skipped["consolidated.safetensors"]


def test_side_file_bytes_count_in_the_free_space_check(pristine, tmp_path, capsys, monkeypatch):
    import shutil as shutil_module

    from moeconv.plan import make_plan

    source = _copy(pristine, tmp_path / "src")
    (source / "tokenizer.json").write_bytes(b" " * 5_000_000)
    needed = make_plan(source).output_bytes
    convert_module = importlib.import_module("moeconv.conversion")
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(convert_module.shutil, "disk_usage", lambda path: usage._replace(free=needed + 1_000_000))
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 2 and re.search(r"\d\.\d\d [KMG]B free, but the conversion needs \d", err), err


def test_a_failed_side_file_copy_never_survives(pristine, tmp_path, capsys, monkeypatch):
    """A full disk while copying a side file: no partial copy under any name; the staging folder keeps
    only finished shards; the rerun (after that file left the source) writes an output without it,
    which verifies."""
    from moeconv.checkpoint import side_files

    source = _copy(pristine, tmp_path / "src")
    (source / "tokenizer.json").write_bytes(b"{}" * 1000)
    real = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("tokenizer.json.partial"):
            real(fd, bytes(data)[:100])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(side_files.os, "write", full)
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 2 and "no space left on the device" in err, err
    staging = tmp_path / ".out.moeconv-partial"
    assert not [p.name for p in staging.iterdir() if "tokenizer" in p.name]
    assert not (tmp_path / ".out.moeconv-lock").exists()
    monkeypatch.setattr(side_files.os, "write", real)
    (staging / "config.json").write_text("{}")  # a leftover of some earlier run: never reaches the output
    (source / "tokenizer.json").unlink()
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 0, err
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"]
    code, out, err = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless")
    assert code == 0, out + err


@pytest.mark.parametrize("stop", ["refusal", "interrupt"])
def test_the_lock_file_goes_away_on_every_exit(pristine, tmp_path, capsys, monkeypatch, stop):
    convert_module = importlib.import_module("moeconv.conversion")

    def fail(*args):
        if stop == "interrupt":
            raise KeyboardInterrupt
        raise MoeconvError("refused")

    monkeypatch.setattr(convert_module, "_write_metadata", fail)
    code, _, _ = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    assert code == (3 if stop == "interrupt" else 2)
    assert not (tmp_path / ".out.moeconv-lock").exists()


def test_error_text_is_printed_literally(pristine, tmp_path, capsys):
    """Rich would print `:thumbsup:` as an emoji and eat `[bold]`: a path is shown as it is."""
    folder = tmp_path / ":thumbsup: [bold]x[/bold] :-1"
    code, _, err = run_main(capsys, "inspect", folder)
    assert code == 2
    assert str(folder) in err, err


def test_an_index_listing_too_many_tensors_is_refused_with_the_count(pristine, tmp_path, capsys, monkeypatch):
    """Planning costs memory per tensor (1e6 zero-length tensors took 400 s and 4.5 GB): an index that
    lists more than MAX_TENSORS is refused with the count before any shard header is read (the limit
    lowered here to keep the test fast; 1e6 at the real limit: docs/BENCHMARKS.md)."""
    from moeconv.checkpoint import reader, schema

    monkeypatch.setattr(schema, "MAX_TENSORS", 2000)
    monkeypatch.setattr(reader, "MAX_TENSORS", 2000)
    source = _copy(pristine, tmp_path / "src")
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"].update({f"model.extra.{i}.weight": "missing.safetensors" for i in range(3000)})
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_main(capsys, "inspect", source)
    assert code == 2 and f"lists {len(index['weight_map'])} tensors, more than the 2000 moeconv plans" in err, err


def test_too_many_tensors_across_headers_are_refused(pristine, tmp_path, monkeypatch):
    """Without an index the headers are counted as they are read: the shard that passes the limit is named."""
    from moeconv.checkpoint import reader, schema

    source = _copy(pristine, tmp_path / "src")
    (source / "model.safetensors.index.json").unlink()
    monkeypatch.setattr(schema, "MAX_TENSORS", 10)
    monkeypatch.setattr(reader, "MAX_TENSORS", 10)
    with pytest.raises(MoeconvError, match=r"safetensors: with the shards before it: lists \d+ tensors, more than the 10"):
        open_checkpoint(source)


# ------------------------------------------------------------------------------ the paths around the output


def _interrupted(capsys, monkeypatch, source: Path, output: Path) -> Path:
    """A conversion of `source` into `output` stopped (Ctrl-C) before its metadata: its staging folder,
    journal and finished shards left for a resume."""
    convert_module = importlib.import_module("moeconv.conversion")
    real = convert_module._write_metadata

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "_write_metadata", interrupted)
    assert run_main(capsys, "convert", source, "-o", output, "-q")[0] == 3
    monkeypatch.setattr(convert_module, "_write_metadata", real)
    staging = output.parent / f".{output.name}.moeconv-partial"
    assert (staging / "moeconv-progress.json").is_file()
    return staging


@pytest.mark.parametrize("planted", ["symlink", "hard link", "folder", "FIFO"])
def test_a_planted_lock_file_is_refused_and_the_file_it_names_is_unchanged(pristine, tmp_path, capsys, planted):
    """The lock `.OUT.moeconv-lock` planted as a link to someone's file: convert wrote its PID through
    it (1,700 bytes replaced by 5). Now it refuses in one line naming the lock, before any work; so it
    does for a folder or a FIFO under the lock's name (a folder was "<parent>: cannot create files there")."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(bytes(range(256)) * 6 + b"x" * 164)
    lock = tmp_path / ".out.moeconv-lock"
    if planted == "symlink":
        lock.symlink_to(victim)
    elif planted == "hard link":
        os.link(victim, lock)
    elif planted == "folder":
        lock.mkdir()
        (lock / "inside.txt").write_text("someone's")
    else:
        os.mkfifo(lock)
    before, source = tree(tmp_path), tree(pristine)
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    expected = ("is a symbolic link; moeconv does not follow links next to its output: remove it"
                if planted == "symlink" else "not a lock file moeconv made (a hard link to another file, or not a "
                                             "regular file); moeconv does not write into it: remove it")
    assert err.strip() == f"error: {lock}: {expected}", err
    assert tree(tmp_path) == before and tree(pristine) == source


def test_a_staging_folder_planted_as_a_link_is_refused_and_nothing_is_deleted(pristine, tmp_path, capsys, monkeypatch):
    """The staging folder planted as a link to a folder holding a journal of this very job and someone's
    files: the resume deleted those files through the link. Now it refuses in one line naming the link;
    the folder it points to, journal and all, is as it was."""
    staging = _interrupted(capsys, monkeypatch, pristine, tmp_path / "out")
    victim = tmp_path / "victim"
    staging.rename(victim)
    (victim / "thesis.tex").write_text("four years")
    (victim / "data").mkdir()
    (victim / "data" / "results.csv").write_text("1,2,3")
    before = tree(victim)
    staging.symlink_to(victim)
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{staging}: is a symbolic link; moeconv does not follow links next to its output: remove it" in err
    assert tree(victim) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.moeconv-lock").exists()


@pytest.mark.parametrize("journal", ["of this job", "none"])
@pytest.mark.parametrize("stranger", ["a file", "a folder", "a link"])
def test_a_staging_folder_holding_files_moeconv_did_not_write_keeps_them(pristine, tmp_path, capsys, monkeypatch,
                                                                          journal, stranger):
    """A real staging folder (of an interrupted run of this job, or none moeconv made) that holds an
    entry the job does not write: refused in one line naming it, nothing there deleted (the old resume
    removed every unrecorded file, and a folder without a journal whole). Once it is moved away, the
    resume finishes byte-identical to an uninterrupted conversion."""
    assert run_main(capsys, "convert", pristine, "-o", tmp_path / "clean", "-q")[0] == 0
    staging = tmp_path / ".out.moeconv-partial"
    if journal == "of this job":
        _interrupted(capsys, monkeypatch, pristine, tmp_path / "out")
    else:
        staging.mkdir()
    (tmp_path / "elsewhere.txt").write_text("not moeconv's")
    entry = staging / "notes.txt"
    if stranger == "a file":
        entry.write_text("mine")
    elif stranger == "a folder":
        entry.mkdir()
        (entry / "inside.txt").write_text("mine too")
    else:
        entry.symlink_to(tmp_path / "elsewhere.txt")
    before = tree(staging)
    code, _, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(entry) in err, err
    assert ("is a symbolic link; moeconv does not follow links" if stranger == "a link"
            else f"moeconv deletes only its own files in {staging.name}: move it away") in err, err
    assert tree(staging) == before
    assert (tmp_path / "elsewhere.txt").read_text() == "not moeconv's"
    assert not (tmp_path / "out").exists()
    entry.rename(tmp_path / "moved")
    code, out, err = run_main(capsys, "convert", pristine, "-o", tmp_path / "out", "-q", "--json")
    assert code == 0, err
    assert bool(json.loads(out)["resumed_files"]) == (journal == "of this job")
    assert tree(tmp_path / "out") == tree(tmp_path / "clean")
    assert not staging.exists()


@pytest.mark.parametrize("place", ["inside the staging folder", "the staging folder", "the lock", "inside the output"])
def test_a_source_inside_what_convert_writes_or_removes_is_refused(pristine, tmp_path, capsys, place):
    """A source that lived in OUT's staging folder was deleted by the cleanup. A source in the output,
    its staging folder or at its lock's name is refused in one line, before anything is written or
    deleted: every source file's digest and the folder around are unchanged."""
    where = {"inside the staging folder": tmp_path / ".out.moeconv-partial" / "src",
             "the staging folder": tmp_path / ".out.moeconv-partial",
             "the lock": tmp_path / ".out.moeconv-lock",
             "inside the output": tmp_path / "out" / "src"}[place]
    where.parent.mkdir(exist_ok=True)
    source = _copy(pristine, where)
    before = tree(tmp_path)
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    expected = ("output folder exists and is not empty" if place == "inside the output"
                else "which convert writes and removes; move the source or choose another -o")
    assert expected in err, err
    assert tree(tmp_path) == before
