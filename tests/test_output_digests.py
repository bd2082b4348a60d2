"""Every output byte as it was: each synthetic checkpoint of scripts/output_digests.py's matrix (8 formats x 4
architectures) and each checkpoint under tests/data, converted into every backend, gives the files (shards,
index, configs, and the manifest without its machine-dependent fields) whose sha256 the committed table
tests/data/output_digests.json holds, or the same refusal. The table was written by the code before the
codec refactoring of issue 39 and is written anew only by a change that means to alter outputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "output_digests.py"
TABLE = json.loads((Path(__file__).parent / "data" / "output_digests.json").read_text())

_spec = importlib.util.spec_from_file_location("output_digests", SCRIPT)
output_digests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(output_digests)

SYNTHETIC = [(label, arch) for label in output_digests.FORMATS for arch in output_digests.ARCHITECTURES]


def _check(label: str, source: Path, work: Path) -> None:
    for backend in output_digests.BACKENDS:
        key = f"{label}/{backend}"
        assert output_digests.output_digests(source, backend, work / backend) == TABLE[key], key


def test_the_table_covers_the_whole_matrix():
    keys = {f"{label}/{arch}/{backend}" for label, arch in SYNTHETIC for backend in output_digests.BACKENDS}
    keys |= {f"data/{name}/{backend}" for name in output_digests.FIXTURES for backend in output_digests.BACKENDS}
    assert set(TABLE) == keys
    assert sum(isinstance(entry, dict) for entry in TABLE.values()) > 150  # outputs, not only refusals


@pytest.mark.parametrize("label, arch", SYNTHETIC)
def test_synthetic_outputs_are_byte_identical(tmp_path, label, arch):
    _check(f"{label}/{arch}", output_digests.synthetic(label, arch, tmp_path / "source"), tmp_path)


@pytest.mark.parametrize("name", output_digests.FIXTURES)
def test_fixture_outputs_are_byte_identical(tmp_path, name):
    _check(f"data/{name}", output_digests.DATA / name, tmp_path)
