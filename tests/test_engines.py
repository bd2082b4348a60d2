"""The engines room (moeconv/engines): every "this release serves, refuses, casts" fact sits in one module per
engine release, so moving to a new release is that module and its registry line; and inspect says what
convert would plan about it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import cli

from moeconv import engines
from moeconv.formats import GPTQ
from moeconv.plan import make_plan
from moeconv.synth import SynthSpec, make_checkpoint

PACKAGE = Path(__file__).resolve().parents[1] / "moeconv"
# The one module outside engines/ that still names a release: the triton config parser's refusal of a cpu
# output, a message both plugins show, kept as it was (backends/ sits below engines/, and cannot ask it).
NAMES_A_RELEASE = {"backends/triton_config.py"}


def test_no_module_outside_engines_names_a_release():
    """Each registered release's version, as the releases' answers name it ("vLLM 0.33"), in no other module."""
    named = {release.name for release in (engines.VLLM, engines.SGLANG)}
    assert named == {"vLLM 0.33", "SGLang 0.5.23"}
    found = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             if path.relative_to(PACKAGE).parts[0] != "engines"
             and any(re.search(rf"{re.escape(name)}\b", path.read_text()) for name in named)}
    assert found == NAMES_A_RELEASE


def test_inspect_says_what_a_regrouped_triton_output_of_an_asymmetric_source_is_served_by(tmp_path):
    """Regrouped, a triton output copies the dense layers of an asymmetric GPTQ source (its compressed-tensors
    dense linears would keep the source's groups), which vLLM does not load: convert --regroup plans no engine
    for it, and inspect says the same for both engines (it used to promise SGLang's plugin)."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 128, sym=False), hidden=256,
                                                         intermediate=128))
    plan = make_plan(source, backend="triton", tp=2, regroup=True)
    assert plan.regroup_factor == 2 and plan.dense_layout is None
    copied = "the dense layers keep the source's asymmetric GPTQ, which vLLM 0.33 does not load"
    assert plan.serving.engine is None and plan.serving.how.startswith(copied)
    assert plan.sglang_serving == (None, f"{copied}, not shown to load in SGLang 0.5.23")
    verdict = json.loads(cli("inspect", source, "--tp", "2", "--json").stdout)["backends"]["triton"]
    assert verdict["eligible_with_regroup"] and verdict["regroup_factor"] == 2
    assert verdict["serving"] == plan.serving._asdict()
    assert verdict["sglang_serving"] == plan.sglang_serving._asdict()
