"""Act-order (GPTQ desc_act): a down projection's permuted groups are folded into static groups with
the same expert's gate and up rows; everything else is refused with the reason, or (relabelled whole
groups) decoded exactly.

Two anchors outside moeconv's reading: the act-order semantics written out independently here
(W[n, k] = s[n, g_idx[k]] · (q[n, k] − z[n, g_idx[k]]), from the codes, zeros and scales the test chose),
and checkpoints made by the REAL GPTQModel 7.7.0 with desc_act (tests/data/gptqmodel_act_order, made by
tests/packers/make_gptqmodel_act_order.py), whose own dequantization (its `dequantize_weight`, honouring
g_idx) is stored beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import moeconv
from moeconv import act_order
from moeconv.backends import REGISTRY
from moeconv.canonical import QuantizedWeight
from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.formats import GPTQ, CompressedTensors
from moeconv.packing import as_float32
from moeconv import transform
from moeconv.plan import make_plan
from moeconv.worklist import ExpertJob

from helpers import run_main
from strategies import random_canonical

DATA = Path(__file__).parent / "data" / "gptqmodel_act_order"


def _act_order_weight(weight: QuantizedWeight, g_idx: torch.Tensor) -> torch.Tensor:
    """The float64 weight an act-order GPTQ linear means, read straight from the definition."""
    groups = g_idx.numpy().astype(np.int64)
    zeros = weight.effective_zeros().astype(np.float64)[:, groups]
    scales = as_float32(weight.scales).astype(np.float64)[:, groups]
    return torch.from_numpy((weight.codes.astype(np.float64) - zeros) * scales)


def _dense(weight: QuantizedWeight) -> torch.Tensor:
    """A canonical weight in float64, as a tensor (for torch's silu and matmuls)."""
    return torch.from_numpy(weight.dequantize(np.float64))


def _stored(fmt, weight: QuantizedWeight, g_idx: torch.Tensor) -> dict[str, np.ndarray]:
    """The format's stored arrays of `weight` with `g_idx` (GPTQ's g_idx, compressed-tensors' weight_g_idx) in
    place of k // g (codes, zeros and scales are packed by column and by group index alike, whatever the
    grouping)."""
    return {**fmt.encode(weight), fmt.group_index_suffix: g_idx.to(torch.int32).numpy()}


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), sym=st.booleans(), groups=st.integers(1, 4), group_size=st.sampled_from([32, 64]),
       seed=st.integers(0, 2**31 - 1), version=st.sampled_from(["gptq", "gptq_v2", "compressed-tensors"]))
def test_an_act_order_linear_decodes_to_its_inputs_permuted_exactly(bits, sym, groups, group_size, seed, version):
    gen = torch.Generator().manual_seed(seed)
    k = groups * group_size
    weight = random_canonical(gen, bits, sym, 16, k, groups)
    perm = torch.randperm(k, generator=gen)  # the quantization order: group j = perm[j·g:(j+1)·g]
    g_idx = torch.argsort(perm) // group_size  # as GPTQModel, AutoGPTQ and llm-compressor write it
    if version == "compressed-tensors":
        bits = 4 if bits == 2 else bits
        weight = random_canonical(gen, bits, sym, 16, k, groups)
        fmt = CompressedTensors(bits=bits, group_size=group_size, symmetric=sym)
    else:
        fmt = GPTQ(bits, group_size, sym=sym, checkpoint_format=version)
    if bits == 4 and not sym and version == "gptq":
        np.maximum(weight.zeros, 1, out=weight.zeros)  # v1 cannot store a zero of 0 cleanly (formats/gptq.py)
    decoded, inputs = fmt.decode_ordered(_stored(fmt, weight, g_idx))
    truth = _act_order_weight(weight, g_idx)
    if torch.equal(g_idx, torch.arange(k) // group_size):
        assert inputs is None
        assert torch.equal(_dense(decoded), truth)
        return
    assert inputs is not None and sorted(inputs.tolist()) == list(range(k))
    assert torch.equal(_dense(decoded), truth[:, inputs])
    with pytest.raises(MoeconvError, match="act-order permutation"):
        fmt.decode(_stored(fmt, weight, g_idx))


@settings(max_examples=30, deadline=None)
@given(sym=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_folding_keeps_the_expert_function(sym, seed):
    """down(silu(gate x) * up x) from the source's act-order reading == from the folded static groups."""
    gen = torch.Generator().manual_seed(seed)
    hidden, intermediate, g = 64, 96, 32
    fmt = GPTQ(4, g, sym=sym, checkpoint_format="gptq_v2")
    gate, up = (random_canonical(gen, 4, sym, intermediate, hidden, hidden // g) for _ in range(2))
    down = random_canonical(gen, 4, sym, hidden, intermediate, intermediate // g)
    g_idx = torch.argsort(torch.randperm(intermediate, generator=gen)) // g
    folded_down, inputs = fmt.decode_ordered(_stored(fmt, down, g_idx))
    folded = act_order.fold({"gate": gate, "up": up}, inputs)
    x = torch.randn(5, hidden, generator=gen, dtype=torch.float64)

    def expert(w_gate, w_up, w_down):
        return (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T

    source = expert(_dense(gate), _dense(up), _act_order_weight(down, g_idx))
    result = expert(_dense(folded["gate"]), _dense(folded["up"]), _dense(folded_down))
    torch.testing.assert_close(result, source, rtol=1e-12, atol=1e-12)  # only the summation order differs


@pytest.mark.parametrize("g_idx, kind", [
    (torch.arange(96) // 32, act_order.STATIC),
    (torch.flip(torch.arange(96) // 32, [0]), act_order.RELABELLED),  # whole groups, in another order
    (torch.arange(96) % 3, act_order.PERMUTED),  # every group 32 wide, interleaved
    (torch.cat([torch.zeros(40), torch.ones(24), torch.full((32,), 2)]), act_order.IRREGULAR),  # 40/24/32 wide
    (torch.arange(96) // 16, act_order.IRREGULAR),  # labels past the last group
])
def test_group_order_kinds(g_idx, kind):
    assert act_order.group_order(g_idx.to(torch.int32).numpy(), 32).kind == kind


def test_relabelled_groups_decode_exactly_and_need_no_fold():
    gen = torch.Generator().manual_seed(3)
    weight = random_canonical(gen, 4, False, 8, 96, 3)
    g_idx = torch.tensor([2, 0, 1]).repeat_interleave(32)
    fmt = GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2")
    decoded, inputs = fmt.decode_ordered(_stored(fmt, weight, g_idx))
    assert inputs is None
    assert torch.equal(_dense(decoded), _act_order_weight(weight, g_idx))


# ------------------------------------------------------------------ the real GPTQModel checkpoints


def test_gptqmodel_wrote_act_order_only_where_asked():
    """The data is what it claims: down_only has act-order on every routed down_proj and nowhere else."""
    for variant, permuted in (("down_only", {"down_proj"}), ("everywhere", {"gate_proj", "up_proj", "down_proj"})):
        tensors = load_file(str(DATA / variant / "model.safetensors"))
        kinds = {name: act_order.group_order(value.numpy(), 32).kind for name, value in tensors.items()
                 if name.endswith(".g_idx")}
        expert = {name.split(".")[-2] for name, kind in kinds.items() if kind == act_order.PERMUTED and ".experts." in name}
        assert expert == permuted, (variant, expert)
        if variant == "down_only":
            assert all(kind == act_order.STATIC for name, kind in kinds.items() if ".experts." not in name)


def _output_expert(plan, job: ExpertJob, out_tensors, reader) -> dict[str, torch.Tensor]:
    """The float64 gate, up and down an output file holds for one expert (its own layout decoded)."""
    blocks = {suffix: reader.read_raw_slice(out_tensors[slot.tensor.name], slot.offset, slot.shape)
              for suffix, slot in job.slots.items()}
    return {p: _dense(w) for p, w in transform.decode(job, plan.codec, blocks).items()}


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_the_real_down_only_checkpoint_converts_to_the_function_gptqmodel_computes(tmp_path, backend):
    source = DATA / "down_only"
    moeconv.convert(source, tmp_path / "out", backend=backend)
    report = moeconv.verify(tmp_path / "out", numerics_layers=2)
    assert report.ok, report.failures()
    plan = make_plan(source, backend=backend)
    assert {layer.act_order for layer in plan.layers} == {act_order.FOLDED}
    reference = load_file(str(DATA / "down_only.reference.safetensors"))
    x = reference["inputs"].double()
    out_tensors = open_checkpoint(tmp_path / "out").tensors
    checked = 0
    with TensorReader() as reader:
        for layer in plan.layers:
            for job in plan.layer_jobs[layer.module]:
                w = _output_expert(plan, job, out_tensors, reader)
                ref = {p: reference[f"{layer.module}.{job.expert}.{p}_proj.weight"].double() for p in ("gate", "up", "down")}
                ours = (torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
                theirs = (torch.nn.functional.silu(x @ ref["gate"].T) * (x @ ref["up"].T)) @ ref["down"].T
                torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
                # and GPTQModel's own float16 forward of the quantized expert agrees within fp16 rounding
                forward = reference[f"{layer.module}.{job.expert}.output"].double()
                assert float((ours - forward).abs().max()) <= 2e-3 * float(forward.abs().max()) + 1e-3
                # folded, not ignored: the output's down columns are GPTQModel's, permuted
                assert not torch.equal(w["down"], ref["down"])
                assert torch.equal(w["down"].sort(dim=1).values, ref["down"].sort(dim=1).values)
                checked += 1
    assert checked == 2 * 4


def test_act_order_over_the_hidden_dimension_is_refused_in_one_line(capsys, tmp_path):
    before = sorted(p.name for p in (DATA / "everywhere").iterdir())
    code, out, err = run_main(capsys, "convert", DATA / "everywhere", "-o", tmp_path / "out", "--quiet")
    assert code == 2
    line = err.strip()
    assert "\n" not in line and "Traceback" not in err
    assert "model.layers.0.mlp.experts.0.gate_proj.g_idx: g_idx is an act-order permutation" in line
    assert "2 of 2 MoE layers" in line
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (DATA / "everywhere").iterdir()) == before


def test_inspect_reports_each_layer_case():
    folded = moeconv.inspect(DATA / "down_only")
    assert folded["act_order"] == {f"model.layers.{i}.mlp.experts": act_order.FOLDED for i in range(2)}
    refused = moeconv.inspect(DATA / "everywhere")
    assert all(case.startswith("refused: ") and "gate_proj.g_idx" in case for case in refused["act_order"].values())


# ------------------------------------------------------- compressed-tensors actorder "group"

CT_DATA = Path(__file__).parent / "data" / "ct_actorder" / "packed.safetensors"


@pytest.mark.parametrize("case, symmetric", [("sym", True), ("asym", False)])
def test_real_compressed_tensors_actorder_group_reads_as_permuted_inputs(case, symmetric):
    """Packed by the REAL compressed-tensors 0.17.1 with a weight_g_idx (tests/packers/make_ct_actorder.py):
    moeconv reads the packer's intended codes with the inputs in static-group order, the zero points and
    scales group by group, and the weight equals the library's own decompression, permuted."""
    t = {key.split(".", 1)[1]: value for key, value in load_file(str(CT_DATA)).items() if key.startswith(f"{case}.")}
    fmt = CompressedTensors(bits=4, group_size=32, symmetric=symmetric)
    stored = {key: t[key].numpy() for key in ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx",
                                              "weight_zero_point") if key in t}
    with pytest.raises(MoeconvError, match="act-order"):
        fmt.decode(stored)
    weight, inputs = fmt.decode_ordered(stored)
    inputs = torch.from_numpy(inputs)
    assert torch.equal(t["weight_g_idx"][inputs].long(), torch.arange(128) // 32)
    assert torch.equal(torch.from_numpy(weight.codes), t["codes"][:, inputs])
    assert torch.equal(torch.from_numpy(weight.effective_zeros()), t["zeros"])
    assert torch.equal(torch.from_numpy(weight.scales), t["scales"])
    # the library dequantizes in float16: one rounding of s·(q − z)
    torch.testing.assert_close(_dense(weight).float(), t["decompressed"][:, inputs], rtol=1e-3, atol=1e-6)


def test_a_compressed_tensors_checkpoint_with_actorder_group_on_down_folds(tmp_path):
    """A compressed-tensors MoE whose experts' down_proj store weight_g_idx (actorder "group"): every
    backend converts it, bit-exact against the folded reading, and the converted experts compute what
    the act-order definition says the source computes."""
    import json

    from safetensors.torch import save_file

    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=64, intermediate=64,
                                                         source_format=CompressedTensors(bits=4, group_size=32)))
    gen = torch.Generator().manual_seed(5)
    g_idx = {}
    index = json.loads((source / "model.safetensors.index.json").read_text())
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in [n for n in tensors if n.endswith(".down_proj.weight_packed") and ".experts." in n]:
            prefix = name.removesuffix(".weight_packed")
            g_idx[prefix] = (torch.argsort(torch.randperm(64, generator=gen)) // 32).to(torch.int32)
            tensors[f"{prefix}.weight_g_idx"] = g_idx[prefix]
            index["weight_map"][f"{prefix}.weight_g_idx"] = shard.name
        save_file(tensors, str(shard), metadata={"format": "pt"})
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((source / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"
    (source / "config.json").write_text(json.dumps(config))

    assert set(moeconv.inspect(source)["act_order"].values()) == {act_order.FOLDED}
    static = CompressedTensors(bits=4, group_size=32)
    for backend in REGISTRY:
        out = tmp_path / backend
        moeconv.convert(source, out, backend=backend)
        report = moeconv.verify(out, numerics_layers=1)
        assert report.ok, (backend, report.failures())
        plan = make_plan(source, backend=backend)
        job = plan.layer_jobs[plan.layers[0].module][1]
        with TensorReader() as reader:
            w = _output_expert(plan, job, open_checkpoint(out).tensors, reader)
            raw = {p: {s: reader.read_raw(piece.entry) for s, piece in linear.items()} for p, linear in job.sources.items()}
        prefix = f"{plan.layers[0].module}.1.down_proj"
        source_down = _act_order_weight(static.decode({k: v for k, v in raw["down"].items() if k != "weight_g_idx"}),
                                        g_idx[prefix])
        gate, up = (_dense(static.decode(raw[p])) for p in ("gate", "up"))
        x = torch.randn(4, 64, generator=gen, dtype=torch.float64)
        ours = (torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
        theirs = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ source_down.T
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_relabelled_groups_on_every_projection_are_checked_in_numpy(tmp_path):
    """A compressed-tensors MoE (actorder "group") whose experts store a weight_g_idx that relabels whole groups
    (group 1's channels first): no fold, only the scales reordered, and every backend's output is bit-exact
    against that reading."""
    import json

    from safetensors.torch import save_file

    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=64, intermediate=64,
                                                         source_format=CompressedTensors(bits=4, group_size=32)))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in [n for n in tensors if n.endswith(".weight_packed") and ".experts." in n]:
            prefix = name.removesuffix(".weight_packed")
            tensors[f"{prefix}.weight_g_idx"] = (1 - torch.arange(64) // 32).to(torch.int32)
            index["weight_map"][f"{prefix}.weight_g_idx"] = shard.name
        save_file(tensors, str(shard), metadata={"format": "pt"})
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((source / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"  # what makes the plan read every g_idx
    (source / "config.json").write_text(json.dumps(config))

    assert set(moeconv.inspect(source)["act_order"].values()) == {act_order.RELABELLED}
    for backend in REGISTRY:
        moeconv.convert(source, tmp_path / backend, backend=backend)
        report = moeconv.verify(tmp_path / backend, level="lossless")
        assert report.ok and all(layer.experts_exact == layer.experts_checked > 0 for layer in report.layers), \
            (backend, report.failures())
