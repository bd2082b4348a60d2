"""Every member of the SourceFormat, Backend and LinearLayout interfaces is declared in the protocol and
present on every format, backend and backend's linear layout (its own, or the default from FormatDefaults /
BackendDefaults), so no code has to probe for one: one that leaves out a member it must define fails here."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from moeconv.backends import REGISTRY as BACKENDS
from moeconv.backends.base import Backend, BackendDefaults, LinearLayout
from moeconv.formats import AWQ, GPTQ, CompressedTensors, CompressedTensorsFloat, ModelOptNvfp4
from moeconv.formats.modelopt import ModelOpt
from moeconv.formats.base import FormatDefaults, SourceFormat

PLUGINS = Path(__file__).parent / "plugins"


def _members(protocol: type) -> set[str]:
    declared = set(protocol.__dict__.get("__annotations__", {}))
    declared |= {name for name, value in vars(protocol).items()
                 if not name.startswith("_") and (callable(value) or isinstance(value, (classmethod, staticmethod,
                                                                                          property)))}
    return declared


def _plugin(module: str, name: str) -> type:
    sys.path.insert(0, str(PLUGINS))
    try:
        return getattr(importlib.import_module(module), name)
    finally:
        sys.path.remove(str(PLUGINS))


def test_the_protocols_declare_the_hooks_the_plan_reads():
    assert {"decode_ordered", "configures_act_order", "group_index_suffix", "from_config"} <= _members(SourceFormat)
    assert {"linear_layout", "dense_linear_backend", "refusal"} <= _members(Backend)
    assert {"linear_tensors", "linear_refusal", "checkpoint_quantization_config"} <= _members(LinearLayout)
    assert not _members(Backend) & {"linear_tensors", "encode_linear", "decode_linear", "checkpoint_quantization_config"}


@pytest.mark.parametrize("cls", [AWQ, GPTQ, CompressedTensors, CompressedTensorsFloat, ModelOpt, ModelOptNvfp4, "toy"], ids=lambda c: getattr(c, "__name__", c))
def test_every_format_has_every_member(cls):
    cls = _plugin("toy_format", "ToyFormat") if cls == "toy" else cls
    assert issubclass(cls, FormatDefaults)
    missing = sorted(name for name in _members(SourceFormat) if not hasattr(cls, name))
    assert missing == []


@pytest.mark.parametrize("name", [*BACKENDS, "toy"])
def test_every_backend_has_every_member(name):
    backend = _plugin("toy_backend", "ToyBackend")() if name == "toy" else BACKENDS[name].load()
    assert isinstance(backend, BackendDefaults)
    missing = sorted(member for member in _members(Backend) if not hasattr(backend, member))
    assert missing == []
    layout = backend.linear_layout
    if layout is not None:  # a whole-checkpoint scheme: every member of its per-linear layout too
        assert sorted(member for member in _members(LinearLayout) if not hasattr(layout, member)) == []
