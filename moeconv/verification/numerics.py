"""verify's third level, numerics: which MoE layers the reference kernel runs on, and its check of one
layer (the kernel on the output's bytes against a float64 reference computed from the source), with
the random source of the sampled experts and of the tokens."""

from __future__ import annotations

import functools
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from moeconv.checkpoint.reader import TensorEntry, TensorReader
from moeconv.float_codes import FloatWeight
from moeconv.kernels.runners import LayerKernel, kernel_of
from moeconv.plan import Plan
from moeconv.survey import MoELayer
from moeconv.verification import decoding
from moeconv.verification.lossless import Checks
from moeconv.verification.report import LayerResult, VerifyReport
from moeconv.verification.scheduler import Scheduler
from moeconv.worklist import ExpertJob

if TYPE_CHECKING:  # imported by the checks that run the kernel; a lossless verify never does
    import torch

    from moeconv.canonical import QuantizedWeight


# verify's default on a CPU, where the Triton interpreter takes about a second an expert of a real-sized layer
# (H 2048, I 768: a 128-expert layer is two minutes): the kernel on this many MoE layers, spread from the first
# to the last, and on this many of each one's checked experts, spread likewise (every tensor is still checked
# bit for bit). docs/BENCHMARKS.md, "verify's default on a CPU".
KERNEL_SAMPLE = 4
KERNEL_EXPERTS = 4


def kernel_layers(count: int, level: str | None, numerics_layers: int | None,
                  on_cpu: Callable[[], bool]) -> tuple[list[int], bool]:
    """(the indices of the MoE layers the kernel runs on, whether they are verify's default sample). `on_cpu` is
    asked only for the default (it imports torch)."""
    if level not in (None, "numerics"):
        return [], False
    if numerics_layers is not None:
        return list(range(min(numerics_layers, count))), False
    if level is None and count > KERNEL_SAMPLE and on_cpu():
        return spread(list(range(count)), KERNEL_SAMPLE), True
    return list(range(count)), False


def run(report: VerifyReport, plan: Plan, checks: Checks, tensors: dict[str, TensorEntry], reader: TensorReader,
        scheduler: Scheduler, asked: str | None, numerics_layers: int | None, tokens: int,
        generator: torch.Generator | None) -> None:
    """The kernel check of the layers `kernel_layers` picks, in its own phase, into `report.layers`; none where
    no reference kernel reads the layout's codes (float codes in a layout without a `Numerics.float_kernel`:
    said in the report)."""
    kernel = kernel_of(plan.backend.numerics, plan.layers[0].shape) if plan.layers else None
    if kernel is None:
        scheme = plan.source_format.float_scheme
        if plan.layers and asked in (None, "numerics"):
            report.numerics_not_run = (
                f"no reference kernel runs on a --cast {plan.cast} output (the lossless level compared every value)"
                if plan.cast else
                f"no reference kernel reads {scheme.name if scheme else 'the'} codes in the {plan.backend.name} "
                f"layout (the lossless level compared every code and scale byte)")
        return
    indices, sampled = kernel_layers(len(report.layers), asked, numerics_layers,
                                     lambda: kernel.device().startswith("cpu"))
    experts = checks.experts
    # The default on a CPU (no level, no --numerics-layers): a few experts of each layer, unless the source holds
    # NaN or infinite scales (counted by the lossless level): then every checked one, so the kernel check reaches
    # and names the expert that has them.
    if asked is None and numerics_layers is None and indices and kernel.device().startswith("cpu") \
            and not report.nonfinite_scales:
        experts = [spread(checked, KERNEL_EXPERTS) for checked in checks.experts]
        if any(len(few) < len(checked) for few, checked in zip(experts, checks.experts)):
            report.kernel_experts = KERNEL_EXPERTS
    report.kernel_sample = [report.layers[index].module for index in indices] \
        if sampled or report.kernel_experts else []
    if indices:
        report.numerics_device = kernel.device()
        scheduler.phase("kernel", len(indices))
    for index in indices:
        result, started = report.layers[index], time.perf_counter()
        try:
            check_numerics(plan, kernel, plan.layers[index], checks.layer_jobs[index], experts[index], tensors,
                           reader, tokens, generator, result)
        except ValueError as error:  # the serving kernel's own reading of the bytes fails
            result.numerics_failure = str(error)
        result.seconds += time.perf_counter() - started
        scheduler.advance(1)


def spread(items: list[int], count: int) -> list[int]:
    """`count` of `items` spread from the first to the last (all of them where there are no more)."""
    if len(items) <= count:
        return items
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def check_numerics(plan: Plan, kernel: LayerKernel, layer: MoELayer, jobs: list[ExpertJob], experts: list[int],
                   tensors: dict[str, TensorEntry], reader: TensorReader, tokens: int, generator: torch.Generator,
                   result: LayerResult) -> None:
    """The backend's `kernel` on the converted tensors against a float64 reference that dequantizes
    the SOURCE through the source format's decoder (float codes: float_codes.FloatWeight.dequantize, a lookup
    table of the E2M1 values times the exact scale values, never the kernel's bit decoding), for random tokens
    routed so that each of `experts` (the layer's checked ones) gets one at least: into `result`, how many
    experts the tokens reached (and, for float codes, how many scale blocks of theirs the kernel read) and the
    errors (relative, max abs, max abs of the reference), or why they say nothing (the source's weights or the
    kernel's output not finite). Only the experts the routing picks are read."""
    import torch

    from moeconv.kernels.reference import covering_routing, reference_fused_moe, relative_error

    shape = layer.shape
    configured = plan.checkpoint.config.get("num_experts_per_tok")
    # Only the check's routing depends on it: a value that is not a positive integer falls back to 2.
    topk = min(configured if isinstance(configured, int) and not isinstance(configured, bool) and configured > 0
               else 2, shape.experts)
    weights, ids = covering_routing(tokens, shape.experts, topk, generator, experts,
                                    confined=len(experts) < shape.experts)
    used = sorted(set(ids.flatten().tolist()))
    result.experts_routed = len(used)
    if shape.float_scheme is not None:  # gate and up (I x H) and down (H x I), one scale a block
        result.blocks_checked = len(used) * 3 * shape.hidden * shape.intermediate // shape.float_scheme.block
    local_ids = torch.tensor([used.index(e) for e in ids.flatten().tolist()]).reshape(ids.shape)
    x = torch.randn(len(ids), shape.hidden, generator=generator).to(torch.float16)
    nonfinite: list[str] = []

    @functools.lru_cache(maxsize=1)  # the reference asks for an expert's w13, then for its w2
    def dequantized(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One routed expert of the source in float64 (never the whole layer at once: 16 times a 4-bit layer)."""
        source = decoding.source_weights(plan, jobs[used[index]], reader)
        dense = {key: torch.from_numpy(_float64(source[key])) for key in ("gate", "up", "down")}
        nonfinite.extend(f"expert {used[index]} {key}" for key, weight in dense.items()
                         if not bool(weight.isfinite().all()))
        return torch.cat([dense["gate"], dense["up"]]), dense["down"]

    ref = reference_fused_moe(x.double(), _Indexed(lambda i: dequantized(i)[0]), _Indexed(lambda i: dequantized(i)[1]),
                              weights.double(), local_ids, dtype=torch.float64)
    if nonfinite:
        result.numerics_failure = (f"{', '.join(nonfinite)}: the source's scales are NaN or infinite (converted as "
                                   f"they are): no kernel can compute with them")
        return
    slices = decoding.kernel_tensors(plan, [jobs[e] for e in used], tensors, reader)
    with warnings.catch_warnings():  # the Triton interpreter's numpy warns of NaN or overflow: the check below says it
        warnings.simplefilter("ignore", RuntimeWarning)
        out = kernel.run(slices, shape, x, weights, local_ids).double()
    if not bool(out.isfinite().all()):
        result.numerics_failure = "the kernel's output is NaN or infinite (the reference's is finite)"
        return
    result.relative_error = float(relative_error(out, ref))
    result.max_abs_error, result.max_abs_reference = float((out - ref).abs().max()), float(ref.abs().max())


def _float64(weight: QuantizedWeight | FloatWeight) -> np.ndarray:
    """One source weight, dense, in float64."""
    return weight.dequantize() if isinstance(weight, FloatWeight) else weight.dequantize(np.float64)


class _Indexed:
    """`[index]` is `get(index)`: what `reference_fused_moe` indexes for each expert's weights."""

    def __init__(self, get: Callable[[int], Any]) -> None:
        self.get = get

    def __getitem__(self, index: int) -> Any:
        return self.get(index)
