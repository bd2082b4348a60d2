"""The checkpoint families of late 2026 beyond the classic per-expert names: ModelOpt's
projection-before-index order, Qwen3.5's unquantized MTP experts, and the silent-failure classes
made loud (a quantized tensor under an experts module that no naming claims; gpt-oss's per-expert names)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeconv
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.formats import AWQ, GPTQ, CompressedTensors, ModelOpt
from moeconv.synth import ROUTED_EXPERTS, SynthSpec, make_checkpoint

from helpers import run_main


def test_modelopt_order_converts_to_the_standard_names(tmp_path):
    """experts.gate_proj.E.* is read as expert E's gate; a per-linear output uses the standard order."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(expert_order="modelopt", hidden=64, intermediate=64,
                                                         source_format=GPTQ(4, 32, sym=True)))
    assert "model.layers.0.mlp.experts.gate_proj.3.qweight" in open_checkpoint(source).tensors
    for backend in ("triton", "compressed-tensors"):
        moeconv.convert(source, tmp_path / backend, backend=backend)
        report = moeconv.verify(tmp_path / backend, numerics_layers=1)
        assert report.ok, report.failures()
        assert all(layer.experts_exact == 4 for layer in report.layers)
    names = open_checkpoint(tmp_path / "compressed-tensors").tensors
    assert "model.layers.0.mlp.experts.3.gate_proj.weight_packed" in names
    assert not any(".experts.gate_proj." in name for name in names)


def _legacy_twin(source, folder):
    """The same tensors under Mixtral's legacy names (block_sparse_moe.experts.E.w1/w3/w2), renamed here
    literally: what vLLM 0.33's MixtralForCausalLM maps."""
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
            save_file({_legacy(name): tensor for name, tensor in tensors.items()}, str(folder / path.name),
                      metadata={"format": "pt"})
        elif path.name == "model.safetensors.index.json":
            index = json.loads(path.read_text())
            index["weight_map"] = {_legacy(name): file for name, file in index["weight_map"].items()}
            (folder / path.name).write_text(json.dumps(index))
        else:
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


def _legacy(name: str) -> str:
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for hf, legacy in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
        if ".experts." in name:
            name = name.replace(hf, legacy)
    return name


@pytest.mark.parametrize("backend", ["compressed-tensors", "humming", "triton", "cpu"])
def test_a_transformers_5_mixtral_s_outputs_carry_the_names_vllm_maps(backend, tmp_path):
    """Mixtral saved under transformers 5 names (GPTQModel 7.7: mlp.experts.E.gate_proj, router mlp.gate):
    every output carries vLLM 0.33's Mixtral names (block_sparse_moe, w1/w3/w2; its loader refuses
    'layers.0.mlp'), tensor for tensor and byte for byte what the same weights under the legacy names
    convert to; the compressed-tensors config ignores the router by that name too."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(architecture="mixtral", mixtral_naming="hf", layers=2,
                                                         experts=4, hidden=128, intermediate=64,
                                                         source_format=GPTQ(4, 32, sym=True)))
    assert "model.layers.1.mlp.experts.3.gate_proj.qweight" in open_checkpoint(source).tensors
    twin = _legacy_twin(source, tmp_path / "legacy")
    moeconv.convert(source, tmp_path / "hf-out", backend=backend, workers=1)
    moeconv.convert(twin, tmp_path / "legacy-out", backend=backend, workers=1)
    hf, legacy = open_checkpoint(tmp_path / "hf-out"), open_checkpoint(tmp_path / "legacy-out")
    assert sorted(hf.tensors) == sorted(legacy.tensors)
    assert not [name for name in hf.tensors if ".mlp." in name or ("_proj." in name and ".experts." in name)]
    assert "model.layers.1.block_sparse_moe.gate.weight" in hf.tensors
    for name, entry in hf.tensors.items():
        with open(entry.file, "rb") as mine, open(legacy.tensors[name].file, "rb") as theirs:
            mine.seek(entry.begin)
            theirs.seek(legacy.tensors[name].begin)
            assert mine.read(entry.nbytes) == theirs.read(legacy.tensors[name].nbytes), name
    config = json.loads((tmp_path / "hf-out" / "config.json").read_text())["quantization_config"]
    if backend == "compressed-tensors":
        assert {"model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"} <= set(config["ignore"])
        assert config["ignore"] == json.loads((tmp_path / "legacy-out" / "config.json").read_text())[
            "quantization_config"]["ignore"]
    report = moeconv.verify(tmp_path / "hf-out", numerics_layers=1)
    assert report.ok, report.failures()


def test_unquantized_mtp_experts_pass_through_and_are_reported(tmp_path):
    """Qwen3.5 ships its MTP layer's experts in bf16: they are copied, named in the plan, and left in
    float by the compressed-tensors config (its `ignore`), never read as a quantized layer."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(architecture="qwen3_5_moe", mtp_layers=1, hidden=64,
                                                         intermediate=64, dtype=torch.bfloat16,
                                                         source_format=CompressedTensors(bits=4, group_size=32)))
    assert moeconv.inspect(source)["unquantized_experts"] == ["mtp.layers.0.mlp.experts"]
    report = moeconv.convert(source, tmp_path / "out", backend="compressed-tensors")
    assert report.plan["unquantized_experts"] == ["mtp.layers.0.mlp.experts"]
    assert report.plan["moe_layers"] == 2
    verdict = moeconv.verify(tmp_path / "out", numerics_layers=1)
    assert verdict.ok, verdict.failures()
    mtp = [name for name in open_checkpoint(source).tensors if name.startswith("mtp.")]
    assert len(mtp) == 12 and verdict.passthrough_checked >= len(mtp)  # byte-compared with the source
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "mtp.layers.0.mlp.experts.0.gate_proj" in ignore


def test_an_unclaimed_quantized_tensor_under_experts_is_refused(tmp_path, capsys):
    """llm-compressor 0.12's fused `experts.gate_up_proj_packed` (which vLLM dropped silently) is named
    in a one-line error, not copied as if it were not an expert."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=64, intermediate=64))
    extra = "model.layers.1.mlp.experts.gate_up_proj_packed"
    save_file({extra: torch.zeros(4, 128, 8, dtype=torch.int32)}, str(source / "model-extra.safetensors"))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"][extra] = "model-extra.safetensors"
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out")
    assert code == 2
    line = err.strip()
    assert "\n" not in line and "model-extra.safetensors" in line and extra in line and "refusing" in line
    assert not (tmp_path / "out").exists()


def test_gpt_oss_names_per_expert_tensors_are_refused_as_not_its_stacked_naming(tmp_path, capsys):
    """gpt-oss stacks its experts (experts.gate_up_proj_blocks, tests/test_gpt_oss.py); per-expert integer tensors
    under a gpt_oss config match no naming of it and are refused, never copied."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=64, intermediate=64))
    config = json.loads((source / "config.json").read_text())
    config["model_type"] = "gpt_oss"
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, "inspect", source)
    assert code == 2 and "\n" not in err.strip() and "matches no gpt_oss expert naming (experts.gate_up_proj_<suffix>, " \
        "experts.down_proj_<suffix>, stacked)" in err


def _with_fp8(source, tensors):
    save_file(tensors, str(source / "model-fp8.safetensors"))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-fp8.safetensors"))
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    return source


def test_fp8_linears_beside_integer_experts(tmp_path, capsys):
    """MiniMax / DeepSeek ship FP8 block-scaled attention (`weight` F8_E4M3, `weight_scale_inv` F32 per
    128x128 block) beside INT4 experts: the stacked backends copy those tensors byte for byte;
    compressed-tensors copies them too, as `weight` / `weight_scale`, and describes them in a config group
    of their own (FP8 block, dynamic per-group activations) beside the experts' W4A16; humming, whose
    config holds one scheme, refuses naming the tensor and the way out."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=64, intermediate=64))
    weight = (torch.arange(256 * 192, dtype=torch.float32).reshape(256, 192) % 97 - 48).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.5, 0.25], [3.0, 0.125]])  # ceil(256 / 128) x ceil(192 / 128) blocks
    _with_fp8(source, {"model.layers.0.self_attn.kv_b_proj.weight": weight,
                       "model.layers.0.self_attn.kv_b_proj.weight_scale_inv": scale})
    moeconv.convert(source, tmp_path / "triton", backend="triton")
    report = moeconv.verify(tmp_path / "triton", level="lossless")
    assert report.ok, report.failures()
    moeconv.convert(source, tmp_path / "ct", backend="compressed-tensors")
    report = moeconv.verify(tmp_path / "ct", level="lossless")
    assert report.ok, report.failures()
    out = load_file(str(next(path for path in (tmp_path / "ct").glob("*.safetensors")
                             if "model.layers.0.self_attn.kv_b_proj.weight" in load_file(str(path)))))
    assert out["model.layers.0.self_attn.kv_b_proj.weight"].view(torch.uint8).equal(weight.view(torch.uint8))
    assert out["model.layers.0.self_attn.kv_b_proj.weight_scale"].equal(scale)
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" not in open_checkpoint(tmp_path / "ct").tensors
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    experts, fp8 = config["config_groups"]["group_0"], config["config_groups"]["group_1"]
    assert experts["targets"] == ["Linear"] and experts["weights"]["type"] == "int" and experts["format"] == "pack-quantized"
    assert fp8["targets"] == ["model.layers.0.self_attn.kv_b_proj"] and fp8["format"] == "float-quantized"
    assert (fp8["weights"]["type"], fp8["weights"]["num_bits"], fp8["weights"]["strategy"],
            fp8["weights"]["block_structure"]) == ("float", 8, "block", [128, 128])
    assert fp8["input_activations"]["dynamic"] is True and fp8["input_activations"]["group_size"] == 128
    assert "model.layers.0.self_attn.kv_b_proj" not in config["ignore"]
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "humming", "--backend", "humming")
    assert code == 2 and "F8_E4M3" in err and "kv_b_proj.weight" in err and "--backend compressed-tensors" in err


def test_fp8_tensors_that_are_not_block_scaled_linears_are_refused_by_name(tmp_path, capsys):
    """An FP8 weight whose scale is not one F32 per 128x128 block (here per-tensor) is not described as
    FP8_BLOCK: refused naming the tensor, nothing written."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=64, intermediate=64))
    _with_fp8(source, {"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(256, 192, dtype=torch.float8_e4m3fn),
                       "model.layers.0.self_attn.kv_b_proj.weight_scale_inv": torch.ones(1, 1)})
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "ct", "--backend", "compressed-tensors")
    assert code == 2, err
    assert "kv_b_proj.weight is F8_E4M3[256, 192] with model.layers.0.self_attn.kv_b_proj.weight_scale_inv F32[1, 1]" in err
    assert "(F32[2, 2] here)" in err and not (tmp_path / "ct").exists()


@pytest.mark.parametrize("fmt", [GPTQ(4, 32, sym=True), CompressedTensors(bits=4, group_size=32)], ids=str)
def test_a_float_down_proj_beside_int4_gate_up_is_refused_by_every_backend(tmp_path, capsys, fmt):
    """GLM "AWQ" copies keep down_proj bf16 and quantize gate/up: no stacked layout holds that, so
    `--backend auto` refuses in one line naming the float tensor, and nothing is written."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=64, intermediate=64, source_format=fmt))
    for shard in source.glob("*.safetensors"):
        tensors = load_file(str(shard))
        mixed = {name: value for name, value in tensors.items() if ".experts." not in name or ".down_proj." not in name}
        for name in tensors:
            if ".experts." in name and ".down_proj." in name:
                mixed[name.rsplit(".", 1)[0] + ".weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
        save_file(mixed, str(shard), metadata={"format": "pt"})
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"] = {(name.rsplit(".", 1)[0] + ".weight" if ".experts." in name and ".down_proj." in name
                            else name): file for name, file in index["weight_map"].items()}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    for backend in ("auto", "triton", "compressed-tensors"):
        code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--backend", backend)
        line = err.strip()
        assert code == 2 and "\n" not in line
        assert "model.layers.0.mlp.experts.0.down_proj.weight is BF16[64, 64]" in line
        assert "mixed precision inside one MoE layer" in line and "no backend takes it" in line
        assert not (tmp_path / "out").exists()


def _gptq_v1_symmetric_codes(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K) codes of a GPTQ 4-bit qweight (K/8, N): input 8r + i in nibble i of row r (the format's own
    definition, written out here rather than read through moeconv's decoder)."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1)  # (K/8, 8, N)
    return nibbles.reshape(-1, qweight.shape[1]).T.to(torch.uint8)


@pytest.mark.parametrize("backend", ["triton", "cpu", "compressed-tensors", "humming"])
def test_a_quantized_router_is_converted_or_copied_never_dropped(backend, tmp_path, capsys):
    """A Qwen3-MoE whose router mlp.gate is GPTQ-quantized like its experts (AutoAWQ without an exclusion,
    AutoRound before its predefined `.gate` exclusion; AutoRound 0.16.1 itself always keeps it 16-bit):
    triton and cpu copy its tensors byte for byte, compressed-tensors converts it (and does not list it in
    `ignore`), humming refuses it by name where its packing cannot hold 8 outputs."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(experts=8, layers=1, quantized_router=True,
                                                         source_format=GPTQ(4, 32, sym=True)))
    router = "model.layers.0.mlp.gate"
    stored = load_file(str(next(source.glob("*.safetensors"))))
    assert f"{router}.qweight" in stored and f"{router}.weight" not in stored
    if backend == "humming":
        code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--backend", backend)
        assert code == 2 and f"{router}: backend 'humming' cannot convert this 8x128 linear" in err, err
        assert not (tmp_path / "out").exists()
        return
    moeconv.convert(source, tmp_path / "out", backend=backend, workers=1)
    written = {}
    for shard in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(str(shard)))
    kept = {name: tensor for name, tensor in written.items() if name.startswith(router + ".")}
    if backend in ("triton", "cpu"):
        assert sorted(kept) == sorted(name for name in stored if name.startswith(router + "."))
        assert all(torch.equal(kept[name].view(torch.uint8), stored[name].view(torch.uint8)) for name in kept)
        return
    assert sorted(kept) == [f"{router}.weight_packed", f"{router}.weight_scale", f"{router}.weight_shape"]
    codes = _gptq_v1_symmetric_codes(stored[f"{router}.qweight"])  # (8, 128)
    packed = kept[f"{router}.weight_packed"].to(torch.int64) & 0xFFFFFFFF  # (N, K/8): k in nibble k % 8
    unpacked = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], dim=2).reshape(8, -1)
    assert torch.equal(unpacked.to(torch.uint8), codes)  # symmetric: offset-binary codes, the zero 8 implied
    assert torch.equal(kept[f"{router}.weight_scale"], stored[f"{router}.scales"].T.contiguous())
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert not any("mlp.gate" in entry for entry in config["ignore"]), config["ignore"]


# DeepSeek-V3's linears that are not routed experts, in one MoE layer (N) and in the leading dense layer (0).
_MLA_LINEARS = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                "self_attn.o_proj")
_SHARED = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
_DENSE = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors' reading of `ignore`: a module name, or `re:` and a pattern the whole name matches."""
    return any(re.fullmatch(entry[3:], name) if entry.startswith("re:") else entry == name for entry in ignore)


@pytest.mark.parametrize("fmt", [GPTQ(4, 32, sym=False), AWQ(4, 32), CompressedTensors(bits=4, group_size=32),
                                 CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8)],
                         ids=["gptq", "awq", "ct-w4a16", "ct-w8a8"])
def test_a_routed_experts_only_deepseek_keeps_every_other_linear_in_float_and_says_so(fmt, tmp_path):
    """quantized_modules="routed-experts" (the first-party INT4 DeepSeek-V3 family, moonshotai/Kimi-K2-Thinking):
    attention, shared experts and the dense layer are float `weight`s, each routed expert quantized; the
    config excludes exactly the float linears in the format's own words; every backend converts it, and the
    compressed-tensors output ignores the same linears."""
    spec = SynthSpec(architecture="deepseek_v3", quantized_modules=ROUTED_EXPERTS, layers=2, dense_layers=1,
                     source_format=fmt)
    source = make_checkpoint(tmp_path / "src", spec)
    tensors = open_checkpoint(source).tensors
    float_linears = [f"model.layers.{layer}.{linear}" for layer in (0, 1) for linear in _MLA_LINEARS] + [
        f"model.layers.0.{linear}" for linear in _DENSE] + [f"model.layers.1.{linear}" for linear in _SHARED]
    for linear in float_linears:
        held = {name: entry.dtype for name, entry in tensors.items() if name.startswith(f"{linear}.")}
        assert held == {f"{linear}.weight": "F16"}, (linear, held)
    experts = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    for expert in experts:  # integer codes (GPTQ/AWQ qweight, weight_packed: I32; W8A8 weight: I8)
        assert any(entry.dtype in ("I32", "I8") for name, entry in tensors.items() if name.startswith(f"{expert}.")), expert
    # what the engines build from them: the fused gate_up_proj of the dense layer and of the shared experts,
    # which must be excluded too (SGLang 0.5.23's DeepSeek model declares no such fusion to unfuse)
    float_linears += ["model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.shared_experts.gate_up_proj"]
    config = json.loads((source / "config.json").read_text())["quantization_config"]
    if fmt.method == "compressed-tensors":
        assert all(_ignored(linear, config["ignore"]) for linear in float_linears), config["ignore"]
        assert not any(_ignored(expert, config["ignore"]) for expert in experts)
    elif fmt.method == "gptq":  # GPTQModel: a "-:" pattern that the module name matches skips its quantization
        negative = [pattern[2:] for pattern in config["dynamic"] if pattern.startswith("-:")]
        assert all(any(re.match(pattern, linear) for pattern in negative) for linear in float_linears)
        assert not any(re.match(pattern, expert) for pattern in negative for expert in experts)
    else:  # AutoAWQ: a module whose name contains an entry stays unquantized
        skipped = config["modules_to_not_convert"]
        assert all(any(entry in linear for entry in skipped) for linear in float_linears)
        assert not any(entry in expert for entry in skipped for expert in experts)
    for backend in ("triton", "compressed-tensors", "humming"):
        moeconv.convert(source, tmp_path / backend, backend=backend, workers=1)
        report = moeconv.verify(tmp_path / backend, numerics_layers=1)
        assert report.ok, report.failures()
    written = json.loads((tmp_path / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    ignore = written["ignore"]
    assert all(_ignored(linear, ignore) for linear in float_linears) and not any(_ignored(e, ignore) for e in experts)
    written = json.loads((tmp_path / "humming" / "config.json").read_text())["quantization_config"]
    assert set(float_linears) <= set(written["ignored_layers"])
    assert not any(name.startswith("model.layers.1.mlp.experts.") for name in written["ignored_layers"])


def test_routed_experts_only_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="quantized_router needs quantized_modules='all'"):
        SynthSpec(quantized_modules=ROUTED_EXPERTS, quantized_router=True)
    with pytest.raises(ValueError, match="expected 'all' or 'routed-experts'"):
        SynthSpec(quantized_modules="experts")
    with pytest.raises(ValueError, match="no way known to say so in a 'modelopt' config"):
        SynthSpec(quantized_modules=ROUTED_EXPERTS, source_format=ModelOpt(group_size=32))
