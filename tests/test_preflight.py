"""Preflight: which backend can take a checkpoint at a tensor-parallel size, before anything is written."""

from __future__ import annotations

import json

import pytest

from moeconv.errors import MoeconvError
from moeconv.formats import GPTQ, CompressedTensors
from moeconv.plan import make_plan
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import cli, run_main


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    """DeepSeek-V2-Lite's expert width (I = 1408) at g = 128: fine whole, but 704 per rank at tp=2,
    which 128 does not divide (the case vLLM's moe_wna16 loader regroups for)."""
    return make_checkpoint(tmp_path_factory.mktemp("lite") / "src",
                           SynthSpec(architecture="deepseek_v2", source_format=GPTQ(4, 128, sym=False), layers=2,
                                     dense_layers=1, experts=2, hidden=256, intermediate=1408))


def test_triton_refuses_tp2_and_offers_regroup(lite, tmp_path):
    assert make_plan(lite, tp=1).regroup_factor == 1
    with pytest.raises(MoeconvError) as refusal:
        make_plan(lite, tp=2)
    message = str(refusal.value)
    assert "backend 'triton' does not support this checkpoint" in message
    assert "group size 128 does not divide the intermediate size per rank 704" in message
    assert "--regroup makes it eligible: group size 64, lossless" in message
    result = cli("convert", lite, "-o", tmp_path / "out", "--tp", "2")
    assert result.exit_code != 0 and not (tmp_path / "out").exists()


def test_regroup_converts_losslessly_and_verifies(lite, tmp_path):
    result = cli("convert", lite, "-o", tmp_path / "out", "--tp", "2", "--regroup", "--quiet")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["group_size"] == 64
    verified = cli("verify", tmp_path / "out", "--json", "--numerics-layers", "0")
    assert verified.exit_code == 0, verified.output


def test_inspect_shows_per_backend_per_layer_verdicts(lite):
    result = cli("inspect", lite, "--tp", "2", "--json")
    assert result.exit_code == 0, result.output
    triton = json.loads(result.stdout)["backends"]["triton"]
    assert triton["eligible"] is False and triton["eligible_with_regroup"] is True
    assert triton["regroup_factor"] == 2
    assert "704" in triton["layers"]["model.layers.1.mlp.experts"]


def test_auto_takes_the_first_eligible_backend_and_says_why(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=True)))
    plan = make_plan(source, backend="auto")
    assert plan.backend.name == "triton" and plan.skipped_backends == ()
    assert plan.choice == "--backend auto takes triton: served by vLLM 0.33 through moeconv's plugin"


def test_auto_chooses_what_an_engine_serves_regrouping_to_fit(tmp_path, capsys):
    """The newcomer's case: compressed-tensors W4A16 g128 at --tp 2 (64 intermediate channels per rank).
    Without regrouping only cpu fits, and no engine loads a cpu output; auto regroups to g = 64 for triton,
    says so in one line, and the report ends with how to verify and how to serve it."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=CompressedTensors(bits=4, group_size=128),
                                                         hidden=256, intermediate=128))
    plan = make_plan(source, backend="auto", tp=2)
    assert plan.backend.name == "triton" and plan.regroup_factor == 2
    report = json.loads(cli("inspect", source, "--tp", "2", "--json").stdout)
    assert report["auto"] == plan.choice and report["backends"]["cpu"]["eligible"]
    assert report["backends"]["cpu"]["serving"]["engine"] is None
    code, out, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--backend", "auto", "--tp", "2", "-q")
    assert code == 0, err
    assert err == ("--backend auto takes triton: served by vLLM 0.33 through moeconv's plugin, group size 128 "
                   "regrouped to 64 (lossless) to fit tp=2\n")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["group_size"] == 64
    assert out.splitlines()[-3:] == [
        f"next: moeconv verify {tmp_path / 'out'}",
        f"serve: vLLM 0.33 through moeconv's plugin: install moeconv into vLLM's environment (docs/SERVING.md; it "
        f"registers the plugin), then vllm serve {tmp_path / 'out'} --tensor-parallel-size 2",
        f"serve: SGLang 0.5.23 through moeconv's plugin: install moeconv into SGLang's environment (docs/SERVING.md; it "
        f"registers the plugin), then python -m sglang.launch_server --model-path {tmp_path / 'out'} --tp-size 2"]


def test_auto_prefers_a_served_layout_over_an_unserved_one(tmp_path, capsys):
    """Asymmetric GPTQ: a triton output writes the dense layers in compressed-tensors (vLLM refuses
    asymmetric GPTQ linears), so auto takes triton, served through the plugin; a channel-wise triton output
    is not served yet, so auto skips it for compressed-tensors; a cpu output is said to be unserved."""
    source = make_checkpoint(tmp_path / "asym", SynthSpec(source_format=GPTQ(4, 32, sym=False)))
    plan = make_plan(source, backend="auto")
    assert plan.backend.name == "triton" and plan.dense_layout.name == "compressed-tensors"
    assert plan.choice == "--backend auto takes triton: served by vLLM 0.33 through moeconv's plugin"
    channelwise = make_checkpoint(tmp_path / "channel", SynthSpec(source_format=GPTQ(4, -1, sym=True)))
    plan = make_plan(channelwise, backend="auto")
    assert plan.backend.name == "compressed-tensors" and [name for name, _ in plan.skipped_backends] == ["triton"]
    assert "no engine serves its output: moeconv's vLLM plugin does not serve channel-wise" in plan.skipped_backends[0][1]
    assert plan.choice == ("--backend auto takes compressed-tensors: served by stock vLLM 0.33; skipped triton: no "
                           "engine serves its output: moeconv's vLLM plugin does not serve channel-wise moe_wna16 "
                           "scales yet; for vLLM use --backend compressed-tensors")
    dry = json.loads(cli("convert", channelwise, "--backend", "auto", "--dry-run", "--json").stdout)
    assert dry["auto_choice"] == plan.choice and dry["skipped_backends"][0]["backend"] == "triton"
    assert dry["serving"] == {"engine": "stock vLLM 0.33", "how": "vllm serve {output}"}
    code, out, _ = run_main(capsys, "convert", source, "-o", tmp_path / "cpu", "--backend", "cpu", "-q")
    assert code == 0 and out.splitlines()[-2].startswith("serve: not with vLLM as it is: no engine loads this layout")
    assert out.splitlines()[-1].startswith("serve: not with SGLang as it is: no engine loads this layout")


def test_auto_with_nothing_eligible_lists_every_reason(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(2, 32, sym=False)))
    with pytest.raises(MoeconvError, match="no backend takes this checkpoint: triton: .*2-bit") as refusal:
        make_plan(source, backend="auto")
    assert "humming: model.layers.0.mlp.experts: moeconv writes" in str(refusal.value)


def test_cpu_refuses_what_does_not_block(tmp_path):
    """Mixtral-like expert width 48 (not a multiple of the 32-channel block) and an 8-bit source."""
    narrow = make_checkpoint(tmp_path / "narrow", SynthSpec(architecture="mixtral", intermediate=48, hidden=128,
                                                            source_format=GPTQ(4, 16, sym=False)))
    with pytest.raises(MoeconvError, match="backend 'cpu' does not support this checkpoint: .*intermediate size 48"):
        make_plan(narrow, backend="cpu")
    eight = make_checkpoint(tmp_path / "eight", SynthSpec(source_format=GPTQ(8, 32, sym=True)))
    with pytest.raises(MoeconvError, match="takes 4-bit weights, not 8-bit.*backends that take it: triton, humming"):
        make_plan(eight, backend="cpu")


def test_cpu_per_rank_sizes(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec(intermediate=64, hidden=128))
    assert make_plan(source, backend="cpu", tp=2).backend.name == "cpu"  # 32 per rank still blocks
    with pytest.raises(MoeconvError, match="intermediate size 16 is not a multiple of the 32-channel block"):
        make_plan(source, backend="cpu", tp=4)
