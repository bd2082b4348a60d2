"""What a checkpoint is, from its configs and headers (plus the small tensors its format audits, and for float
codes every expert linear's bytes: the census of its casts, casts.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from moeconv import casts, engines
from moeconv.audit import Audits
from moeconv.audit import count as audit_counts
from moeconv.backends import all_backends
from moeconv.checkpoint.reader import Checkpoint, TensorReader, file_size, open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.plan import attention_quantized, choose_backend, converts_dense, eligibility
from moeconv.spec import FLOAT_DTYPES
from moeconv.survey import ExpertSlice, check_global_scales, fp8_block_linears, linear_name, survey
from moeconv.transform import read_source


def inspect_checkpoint(source: Path | Checkpoint, tp: int = 1, casts: bool = False) -> dict[str, Any]:
    """The survey (survey.py) rendered, without refusing what the data contradicts (it is reported), and
    each backend's verdict on it; with `casts`, a float source's cast census too (it reads every expert
    linear's codes and scales, not headers only)."""
    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(Path(source))
    found = survey(checkpoint, tp=tp, strict=False)
    source_format, configured, detection, layers = found.source_format, found.configured, found.detection, found.layers
    act_orders: dict[str, str] = {}  # per MoE layer when any g_idx is not k // g
    if found.act_order_scanned:
        act_orders = {layer.module: layer.act_order for layer in layers if layer.module not in found.act_order_refusals}
        act_orders.update({module: f"refused: {reason}" for module, reason in found.act_order_refusals.items()})
    first = layers[0].shape
    expert_bytes = sum(layer.source_bytes for layer in layers)
    report: dict[str, Any] = {
        "path": str(checkpoint.root),
        "origin": checkpoint.origin,
        "architecture": found.architecture.model_type,
        "format": source_format.describe(),
        "config_format": configured.describe(),
        "detection": detection.to_json(),
        "moe_layers": [layer.module for layer in layers],
        "act_order": act_orders,  # per MoE layer when any g_idx is not k // g: static, relabelled, folded or refused
        "unquantized_experts": list(found.unquantized_experts),  # held in float: passed through
        "experts_per_layer": first.experts,
        "expert_shapes": {
            "gate": [first.intermediate, first.hidden],
            "up": [first.intermediate, first.hidden],
            "down": [first.hidden, first.intermediate],
        },
        "scale_dtype": first.scale_dtype,
        "total_bytes": checkpoint.total_bytes,
        "expert_bytes": expert_bytes,
        "tensors": len(checkpoint.tensors),
        "shards": [{"file": path.name, "bytes": file_size(path)} for path in checkpoint.files],
        "tp": tp,
        "backends": {name: _verdict(backend, layers, source_format, checkpoint.quantization_config,
                                    found.architecture.model_type, attention_quantized(checkpoint, source_format),
                                    checkpoint.config, _fp8_refusal(backend, checkpoint, layers))
                     for name, backend in all_backends().items()},
        "auto": _auto(layers, source_format, checkpoint.quantization_config),
    }
    if found.architecture.stacked is not None:
        report["stacked_experts"] = _stacked(checkpoint, found.architecture, layers)
    if detection.undecided:  # every verdict above holds once the user decides; convert refuses until then
        report["convert_refuses"] = "; ".join(detection.undecided[:1] + detection.advice[:1])
    if casts and source_format.float_scheme is not None:
        report["casts"] = cast_census(source_format, layers)
    audits = _audit(source_format, layers)
    for kind in audits.totals:
        report[kind] = audits.report(kind)
    return report


def _stacked(checkpoint: Checkpoint, architecture, layers) -> dict[str, Any]:
    """Experts stacked on disk (gpt-oss): which stacked tensors hold which projections, the row order of gate and
    up (the naming scheme's, models.StackedExperts), how one expert's linear is read (an example slice of each), and
    what passes through beside the codes: the expert biases (read with the same rows) and the router."""
    first = layers[0].experts[0]
    biases = [name for name in checkpoint.tensors if name.endswith("_bias") and
              architecture.parse_stacked(name) is not None]
    return {**architecture.stacked.describe(),
            "expert_0_of_first_layer": {projection: sorted(entry.name for entry in linear.values())
                                        for projection, linear in first.items()},
            "expert_biases": f"{len(biases)} tensors (e.g. {biases[0]}), stored "
                             f"{checkpoint.tensors[biases[0]].dtype}, unquantized" if biases else "none",
            "router": [name for name in checkpoint.tensors if ".router." in name][:2]}


def _verdict(backend, layers, source_format, source_config, model_type, attention_is_quantized,
             model_config, fp8_refusal: str | None = None) -> dict[str, Any]:
    """Whether the backend takes the checkpoint (as it is, or after --regroup), with each layer's reason,
    and how each engine (vLLM, SGLang) would serve its output."""
    factor, reason = eligibility(backend, layers, allow_regroup=True)
    reason = (reason or _global_scale_refusal(backend, layers, source_format) or source_format.unconverted
              or fp8_refusal)
    refusals = {layer.module: backend.refusal(layer.shape) for layer in layers}
    first = layers[0].shape
    shape = replace(first, group_size=first.group_size // factor)
    output = engines.output_of(backend.name, shape, source_format, converts_dense(backend, source_format, factor),
                               source_config, model_type, attention_is_quantized, model_config=model_config)
    return {
        "eligible": reason is None and factor == 1,
        "eligible_with_regroup": reason is None,
        "regroup_factor": factor,
        "reason": reason or next((f"{m}: {r}" for m, r in refusals.items() if r), None),
        "layers": {module: refusal or "ok" for module, refusal in refusals.items()},
        "serving": engines.VLLM.serving(output)._asdict(),
        "sglang_serving": engines.SGLANG.serving(output)._asdict(),
    }


def _fp8_refusal(backend, checkpoint: Checkpoint, layers) -> str | None:
    """Why a whole-checkpoint backend cannot describe the FP8 block-scaled linears beside the experts
    (survey.fp8_block_linears, as the plan asks it), or None."""
    if backend.linear_layout is None:
        return None
    experts = {entry.name for layer in layers for expert in layer.experts for linear in expert.values()
               for entry in linear.values()}
    try:
        fp8_block_linears(checkpoint, backend.linear_layout, [name for name in checkpoint.tensors if name not in experts])
    except MoeconvError as refusal:
        return str(refusal)
    return None


def _global_scale_refusal(backend, layers, source_format) -> str | None:
    """Why the backend cannot write these float codes' global scales exactly (survey.check_global_scales: the
    plan reads the dense linears' too), or None."""
    if source_format.float_scheme is None:
        return None
    try:
        with TensorReader() as reader:
            check_global_scales([entry for layer in layers for expert in layer.experts for linear in expert.values()
                                 for entry in linear.values()], source_format, backend, reader)
    except MoeconvError as refusal:
        return str(refusal)
    return None


def _auto(layers, source_format, source_config) -> str:
    """What `convert --backend auto` would choose, and why (or why nothing fits)."""
    try:
        backend, _, _, choice = choose_backend("auto", layers, True, source_format, source_config)
    except MoeconvError as refusal:
        return str(refusal)
    refusal = _global_scale_refusal(backend, layers, source_format)
    return f"convert refuses: {refusal}" if refusal else choice


def _audit(source_format, layers) -> Audits:
    """Reads the small tensors of every expert linear (zero points and scales, not the packed weights)
    for the audits: GPTQ v1 zero slots stored as all ones, NaN or infinite scales."""
    audits = Audits()
    with TensorReader() as reader:
        for layer in layers:
            for expert in layer.experts:
                for linear in expert.values():
                    if any(isinstance(entry, ExpertSlice) for entry in linear.values()):
                        continue  # stacked experts: their floats are biases, not scales (scale bytes: decode checks)
                    small = {suffix: reader.read_array(entry) for suffix, entry in linear.items()
                             if suffix in source_format.audited_suffixes or entry.dtype in FLOAT_DTYPES}
                    name = next(iter(linear.values())).name.rsplit(".", 1)[0]
                    audits.record(name, audit_counts(source_format, small, None))
    return audits


def cast_census(source_format, layers) -> dict[str, Any]:
    """Each cast of the float codes (casts.py: block-FP8, NVFP4, BF16), decided per target block from every
    expert linear's bytes, before any write: blocks, exact blocks, the linears with an inexact block (with the
    worst relative error the cast would give) and those whose bytes the format refuses to read."""
    scheme = source_format.float_scheme
    tallies = {target: casts.Tally(scheme.name, target) for target in casts.TARGETS[scheme.name]}
    refused: list[dict[str, str]] = []
    with TensorReader() as reader:
        for layer in layers:
            for expert in layer.experts:
                weights = {}
                for projection, linear in expert.items():
                    name = _linear_name(linear)
                    stored = {suffix: read_source(entry, reader) for suffix, entry in linear.items()}
                    try:
                        weights[projection] = (name, source_format.decode(stored))
                    except MoeconvError as refusal:
                        refused.append({"tensor": name, "reason": str(refusal)})
                for target, tally in tallies.items():  # an NVFP4 cast's gate and up: one global scale, as convert's
                    shared = casts.shared_exponents({key: weight for key, (_, weight) in weights.items()}, target)
                    for projection, (name, weight) in weights.items():
                        tally.add(name, casts.census(weight, target, shared[projection]))
    return {target: {**tally.to_json(), "refused": list(refused)} for target, tally in tallies.items()}


def _linear_name(linear) -> str:
    """One expert linear's module path (a stacked slice: the slice of its codes, which names the rows)."""
    first = next(entry for suffix, entry in sorted(linear.items()) if not suffix.endswith("bias"))
    return linear_name(first)
