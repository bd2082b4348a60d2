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


FLOAT = Path(__file__).resolve().parent / "data" / "float"  # llm-compressor 0.14.0.1's own NVFP4 / MXFP4 checkpoints
SGLANG_LAUNCH = "python -m sglang.launch_server --model-path {output}"


def test_sglang_line_for_float_compressed_tensors_outputs_is_what_sglang_did():
    """What SGLang 0.5.23's own loader did with moeconv's compressed-tensors outputs of the float fixtures
    (run_matrix_sglang.py --only float, 2026-12-07, docs/BENCHMARKS.md), as convert plans it: NVFP4A16 and
    NVFP4 served by CompressedTensorsW4A16Nvfp4MoE (W4A4 weight-only below SM100); MXFP4 not served, with why."""
    nvfp4a16 = make_plan(FLOAT / "ct-nvfp4a16", backend="compressed-tensors").sglang_serving
    assert nvfp4a16 == ("SGLang 0.5.23 (compressed-tensors CompressedTensorsW4A16Nvfp4MoE for the experts; its loader "
                        "took every tensor on the CPU path; no GPU run yet)", SGLANG_LAUNCH)
    nvfp4 = make_plan(FLOAT / "ct-nvfp4", backend="compressed-tensors").sglang_serving
    assert nvfp4 == ("SGLang 0.5.23 (compressed-tensors CompressedTensorsW4A16Nvfp4MoE for the experts; below SM100 "
                     "(H100, H200) weight-only, the activation quantization ignored: its W4A4 method "
                     "CompressedTensorsW4A4Nvfp4MoE needs a Blackwell; its loader took every tensor on the CPU path; "
                     "no GPU run yet)", SGLANG_LAUNCH)
    for fixture in ("ct-mxfp4a16", "ct-mxfp4-fp8block"):
        engine, how = make_plan(FLOAT / fixture, backend="compressed-tensors").sglang_serving
        assert engine is None, fixture
        assert how.startswith("SGLang 0.5.23 gives compressed-tensors MXFP4 experts its gpt-oss method "
                              "Mxfp4MoEMethod, whose parameters are w13_weight / w2_weight: only its Kimi-K3 loader "
                              "renames weight_packed to weight, so qwen3_moe's loader skips every expert's "
                              "weight_packed"), fixture
        assert '"No compressed-tensors compatible scheme was found"' in how and how.endswith("serve it with vLLM")


def test_inspect_says_the_sglang_line_of_a_float_output():
    """inspect --json answers the same for SGLang as convert plans (the MXFP4 refusal, the NVFP4 method)."""
    for fixture in ("ct-mxfp4a16", "ct-nvfp4a16"):
        verdict = json.loads(cli("inspect", FLOAT / fixture, "--json").stdout)["backends"]["compressed-tensors"]
        plan = make_plan(FLOAT / fixture, backend="compressed-tensors")
        assert verdict["sglang_serving"] == plan.sglang_serving._asdict()
        assert ("Mxfp4MoEMethod" in verdict["sglang_serving"]["how"]) == (fixture == "ct-mxfp4a16")


def test_sglang_line_for_nvfp4_outside_what_was_measured():
    """An NVFP4 output of another family says it was not shown there; one whose source is mixed-precision (FP8-block
    attention beside the FP4 group) is not served: SGLang's matcher gives a fused qkv_proj the `Linear` target."""
    plan = make_plan(FLOAT / "ct-nvfp4a16", backend="compressed-tensors")
    layer = plan.layers[0].shape
    mixtral = engines.SGLANG.serving(engines.output_of("compressed-tensors", layer, plan.source_format, False,
                                                       plan.checkpoint.quantization_config, "mixtral"))
    assert mixtral.engine.endswith("no GPU run yet), not shown for mixtral") and mixtral.how == SGLANG_LAUNCH
    mixed = {**plan.checkpoint.quantization_config, "format": "mixed-precision"}
    refused = engines.SGLANG.serving(engines.output_of("compressed-tensors", layer, plan.source_format, False, mixed,
                                                       "qwen3_moe"))
    assert refused.engine is None
    assert refused.how.startswith("not shown with SGLang 0.5.23: its compressed-tensors matcher tries the module "
                                  "class before the fused q/k/v names, so a fused qkv_proj takes the nvfp4 group's")


CAST_SERVED = ("SGLang 0.5.23 ({} for the experts: its loader took every tensor of MXFP4 sources' casts, 128-wide, on "
               "the CPU path; no GPU run yet)")


def test_sglang_line_for_casts_is_what_sglang_did():
    """What SGLang 0.5.23's own loader did with `convert --cast` of the two 128-wide MXFP4 sources (run_matrix_sglang.py
    --only casts, 2026-12-07, docs/BENCHMARKS.md), as convert plans the fixtures' casts: bf16 under
    UnquantizedFusedMoEMethod, nvfp4 under CompressedTensorsW4A16Nvfp4MoE; the fixtures' experts (intermediate 32) are
    too narrow for its Fp8MoEMethod; an nvfp4 cast keeping FP8 block attention is refused at its fused qkv_proj."""
    for fixture in ("ct-mxfp4a16", "ct-mxfp4-fp8block"):
        assert make_plan(FLOAT / fixture, cast="bf16").sglang_serving == (
            CAST_SERVED.format("UnquantizedFusedMoEMethod"), SGLANG_LAUNCH), fixture
        assert make_plan(FLOAT / fixture, cast="fp8-block").sglang_serving == (
            None, "SGLang 0.5.23's block-FP8 MoE method (Fp8MoEMethod) wants the expert intermediate size per rank a "
                  "multiple of 128, not 32; --cast bf16 is served"), fixture
    assert make_plan(FLOAT / "ct-mxfp4a16", cast="nvfp4").sglang_serving == (
        CAST_SERVED.format("CompressedTensorsW4A16Nvfp4MoE"), SGLANG_LAUNCH)
    engine, how = make_plan(FLOAT / "ct-mxfp4-fp8block", cast="nvfp4").sglang_serving
    assert engine is None
    assert how == ("SGLang 0.5.23's compressed-tensors matcher tries the module class before the fused q/k/v names, so "
                   "a fused qkv_proj takes the NVFP4 group's `Linear` target instead of the FP8-block group this cast "
                   "keeps, and loading the FP8 block weight_scale into its NVFP4 parameters fails; --cast bf16 is "
                   "served, or serve this one with vLLM")


def test_sglang_line_for_fp8_block_casts_follows_the_width_per_rank():
    """A 128-wide fp8-block cast (the shape run_matrix_sglang.py loaded) is served by Fp8MoEMethod; split over two ranks
    (64 each) it is not; another family says it was not shown there; a mixed nvfp4 cast 128 wide names fp8-block too."""
    from dataclasses import replace

    plan = make_plan(FLOAT / "ct-mxfp4-fp8block", cast="fp8-block")
    wide = replace(plan.layers[0].shape, hidden=256, intermediate=128)
    config = plan.checkpoint.quantization_config

    def line(cast, layer, model_type="qwen3_moe"):
        return engines.SGLANG.serving(engines.output_of(cast, layer, plan.source_format, True, config, model_type))

    assert line("fp8-block", wide) == (CAST_SERVED.format("Fp8MoEMethod"), SGLANG_LAUNCH)
    split = line("fp8-block", replace(wide, tp=2))
    assert split.engine is None and "a multiple of 128, not 64; --cast bf16 is served" in split.how
    mixtral = line("fp8-block", wide, "mixtral")
    assert mixtral.engine == CAST_SERVED.format("Fp8MoEMethod") + ", not shown for mixtral"
    assert line("nvfp4", wide).how.endswith("; --cast fp8-block or bf16 is served, or serve this one with vLLM")
