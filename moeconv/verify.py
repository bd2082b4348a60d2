"""Proof that a converted checkpoint is right (DESIGN.md §7).

1. structure: every tensor the layout needs is there with its shape and dtype; index, config,
   quantize_config and manifest agree; each file's sha256 matches the manifest (streamed).
2. lossless: every expert (and every dense linear a backend converts) decodes from the output back
   to the canonical form, and equals what the SOURCE format's decoder gives for the source tensors,
   bit for bit; pass-through tensors are byte-identical to the source.
3. numerics: moeconv's Triton fused-MoE kernel runs on the converted tensors for random tokens and
   routing; the reference dequantizes the source independently and computes in float64.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from moeconv.audit import Audits
from moeconv.backends import get_backend
from moeconv.backends.base import ExpertWeights
from moeconv.canonical import MoELayerShape
from moeconv.checkpoint.reader import INDEX_NAME, TensorEntry, TensorReader, open_checkpoint, read_json, same_bytes
from moeconv.checkpoint.schema import is_plain_file_name, section, weight_map
from moeconv.errors import MoeconvError
from moeconv.source import resolve_source
from moeconv.checkpoint.writer import sha256_file
from moeconv.convert import MANIFEST_NAME, QUANTIZE_CONFIG_NAME, output_quantization_config
from moeconv.plan import DenseLinear, MoELayer, PassThrough, Plan, make_plan

# Relative error ‖out − ref‖ / ‖ref‖ allowed for the kernel with fp16 activations against the
# float64 reference of the source. The kernel rounds activations, the fused gate/up output and
# the down output to fp16 (unit roundoff 4.9e-4); with fp32 accumulation the measured error on
# random inputs stays near 1e-3, so 1e-2 leaves room for unlucky routing without hiding a wrong
# nibble (a single wrong code in a layer moves the error by orders of magnitude more).
NUMERICS_TOLERANCE = 1e-2
# W8A8 kernels also round each GEMM's input to int8 per token (scale max|a| / 127), which the
# float reference does not: ‖δa‖ / ‖a‖ ≈ (max|a| / rms a) / (127 · √12) per GEMM, with max / rms ≈
# √(2 ln K) ≈ 3-4.4 for random tokens and heavier tails after SiLU-and-mul. Measured on random
# layers: 1.3e-2 (H=128) to 3.0e-2 (H=4096, I=14336); 6e-2 leaves 2x room, and a layout mistake
# still shows as an error of order 1.
W8A8_NUMERICS_TOLERANCE = 6e-2  # also the x86 CPU kernel's W4A8 (int8 activations): measured 1.3e-2 to 2.3e-2


@dataclass
class LayerResult:
    module: str
    experts_checked: int = 0
    experts_exact: int = 0
    lossless_failures: list[str] = field(default_factory=list)
    numerics_failure: str | None = None  # the kernel cannot read the tensors (it would misread them)
    relative_error: float | None = None
    max_abs_error: float | None = None
    seconds: float = 0.0
    tolerance: float = NUMERICS_TOLERANCE

    @property
    def ok(self) -> bool:
        numerics_ok = self.relative_error is None or self.relative_error <= self.tolerance
        return not self.lossless_failures and not self.numerics_failure and numerics_ok


@dataclass
class VerifyReport:
    output: str
    source: str
    structure_problems: list[str] = field(default_factory=list)
    passthrough_checked: int = 0
    passthrough_problems: list[str] = field(default_factory=list)
    dense_linears_checked: int = 0
    dense_linear_problems: list[str] = field(default_factory=list)
    layers: list[LayerResult] = field(default_factory=list)
    numerics_device: str | None = None
    tolerance: float = NUMERICS_TOLERANCE
    nonfinite_scales: dict[str, Any] = field(default_factory=dict)  # in the source: count, first tensor
    targets: dict[str, Any] = field(default_factory=dict)  # what the output is for, from its manifest

    @property
    def ok(self) -> bool:
        return (not self.structure_problems and not self.passthrough_problems and not self.dense_linear_problems
                and all(l.ok for l in self.layers))

    def failures(self) -> list[str]:
        found = self.structure_problems + self.passthrough_problems + self.dense_linear_problems
        for layer in self.layers:
            found += [f"{layer.module}: {problem}" for problem in layer.lossless_failures]
            if layer.numerics_failure:
                found.append(f"{layer.module}: numerics: {layer.numerics_failure}")
            elif not layer.ok and not layer.lossless_failures:
                found.append(f"{layer.module}: relative error {layer.relative_error:.3g} > {layer.tolerance:g}")
        return found

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for layer, result in zip(data["layers"], self.layers):
            layer["ok"] = result.ok
        return data


def verify(output: Path, source: str | Path | None = None, sample: int | None = None, numerics: bool = True,
           tokens: int = 8, numerics_layers: int | None = None, seed: int = 0,
           progress: Callable[..., None] | None = None) -> VerifyReport:
    """Runs all three levels and returns the report; `report.ok` is the verdict.

    sample: check only this many experts per layer for losslessness (chosen at random from `seed`).
    numerics_layers: run the kernel on only the first N MoE layers (the interpreter on a CPU is slow).
    """
    output = Path(output).expanduser().resolve()
    if not output.is_dir():
        raise MoeconvError(f"{output}: not a folder (give the folder `moeconv convert -o` wrote)")
    if not (output / MANIFEST_NAME).exists():
        raise MoeconvError(f"{output}: no {MANIFEST_NAME}: not a folder written by `moeconv convert`")
    manifest = read_json(output / MANIFEST_NAME)
    recorded = section(manifest, "source", str(output / MANIFEST_NAME))
    arguments = section(manifest, "arguments", str(output / MANIFEST_NAME))
    if source is None:
        source = recorded.get("path")
        if not isinstance(source, str):
            raise MoeconvError(f"{output / MANIFEST_NAME}: source.path is missing; pass --source")
    resolved = resolve_source(source)  # a folder, or a Hub id (from the cache or the Hub)
    checkpoint = open_checkpoint(resolved.path, origin=resolved.origin)
    if recorded.get("headers_sha256") not in (None, checkpoint.headers_sha256):
        raise MoeconvError(f"{checkpoint.root}: not the source {output} was made from (its configs and shard "
                           f"headers differ from those recorded in {MANIFEST_NAME})")
    backend = manifest.get("backend")
    if not isinstance(backend, str):
        raise MoeconvError(f"{output / MANIFEST_NAME}: backend is missing")
    regroup_factor = arguments.get("regroup_factor", 1)
    plan = make_plan(checkpoint, backend=backend, trust=arguments.get("trust"), tp=arguments.get("tp", 1),
                     regroup=isinstance(regroup_factor, int) and regroup_factor > 1)
    kernel = LAYER_KERNELS[plan.backend.name]
    report = VerifyReport(str(output), str(checkpoint.root), targets=section(manifest, "targets", MANIFEST_NAME),
                          tolerance=max(kernel.tolerance(l.shape) for l in plan.layers))
    converted = open_checkpoint(output)
    advance = progress or (lambda nbytes, total=None: None)
    advance(0, sum(path.stat().st_size for path in converted.files) + plan.source_expert_bytes)
    report.structure_problems = _check_reading(plan) + _check_structure(plan, output, manifest, converted.tensors,
                                                                        advance)
    if report.structure_problems:
        return report
    report.passthrough_problems, report.passthrough_checked = _check_passthrough(plan, converted.tensors)
    generator = torch.Generator().manual_seed(seed)
    audits = Audits()
    with TensorReader() as reader:
        dense_linears = plan.dense_linears
        report.dense_linear_problems = _check_dense_linears(plan, dense_linears, converted.tensors, reader)
        report.dense_linears_checked = len(dense_linears)
        for index, layer in enumerate(plan.layers):
            started = time.perf_counter()
            result = LayerResult(layer.module, tolerance=kernel.tolerance(layer.shape))
            experts = _sampled(layer.shape.experts, sample, generator)
            outputs = {t.name: converted.tensors[t.name] for t in plan.layer_tensors(layer)}
            result.lossless_failures, result.experts_exact = _check_lossless(plan, layer, experts, outputs, reader,
                                                                             audits)
            result.experts_checked = len(experts)
            advance(layer.source_bytes)
            if numerics and (numerics_layers is None or index < numerics_layers):
                report.numerics_device = kernel.device()
                try:
                    result.relative_error, result.max_abs_error = _check_numerics(
                        plan, layer, outputs, reader, tokens, generator)
                except ValueError as error:  # the serving kernel's own reading of the bytes fails
                    result.numerics_failure = str(error)
            result.seconds = time.perf_counter() - started
            report.layers.append(result)
    report.nonfinite_scales = audits.report("nonfinite_scales")
    return report


def _check_reading(plan: Plan) -> list[str]:
    """The source's own data against the reading the output was made with: an output converted under
    --trust-config over a config the data contradicts is not certified (decoding the source with the
    same reading would only agree with itself)."""
    if plan.detection is None or plan.trust == "data":
        return []
    return [f"the source's tensors contradict the reading this output was converted with: {disagreement}"
            for disagreement in plan.detection.disagreements]


def _check_structure(plan: Plan, output: Path, manifest: dict[str, Any],
                     tensors: dict[str, TensorEntry], advance: Callable[..., None]) -> list[str]:
    problems = []
    expected = {t.name: t for shard in plan.shards for t in shard.tensors}
    for name, want in expected.items():
        have = tensors.get(name)
        if have is None:
            problems.append(f"tensor {name} is missing")
        elif (have.dtype, have.shape) != (want.dtype, want.shape):
            problems.append(f"{have.file.name}: tensor {name} is {have.dtype}{list(have.shape)}, "
                            f"expected {want.dtype}{list(want.shape)}")
    problems += [f"{tensors[name].file.name}: unexpected tensor {name}" for name in sorted(set(tensors) - set(expected))]
    index = read_json(output / INDEX_NAME)
    declared = sum(entry.nbytes for entry in tensors.values())
    if index.get("metadata", {}).get("total_size") != declared:
        problems.append(f"{INDEX_NAME}: total_size {index.get('metadata', {}).get('total_size')} != {declared}")
    quantization = output_quantization_config(plan)
    if read_json(output / "config.json").get("quantization_config") != quantization:
        problems.append("config.json: quantization_config does not describe this conversion")
    if read_json(output / QUANTIZE_CONFIG_NAME) != quantization:
        problems.append(f"{QUANTIZE_CONFIG_NAME}: does not match config.json's quantization_config")
    shard_files = set(weight_map(index, output / INDEX_NAME).values())
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            is_plain_file_name(name) and isinstance(recorded, dict) and isinstance(recorded.get("bytes"), int)
            and isinstance(recorded.get("sha256"), str) for name, recorded in files.items()):
        return problems + [f"{MANIFEST_NAME}: files must map plain file names to their bytes and sha256"]
    if shard_files != set(files):
        problems.append(f"{MANIFEST_NAME}: files {sorted(files)} != index's {sorted(shard_files)}")
    for name, recorded in files.items():
        path = output / name
        if not path.is_file():
            problems.append(f"{name}: listed in {MANIFEST_NAME} but missing")
        elif path.stat().st_size != recorded["bytes"] or sha256_file(path) != recorded["sha256"]:
            problems.append(f"{name}: sha256 or size differs from {MANIFEST_NAME}")
        if path.is_file():
            advance(path.stat().st_size)
    return problems


def _check_passthrough(plan: Plan, tensors: dict[str, TensorEntry]) -> tuple[list[str], int]:
    problems, checked = [], 0
    for shard in plan.shards:
        for unit in shard.units:
            if isinstance(unit, PassThrough):
                checked += 1
                if not _same_bytes(unit.entry, tensors[unit.entry.name]):
                    problems.append(f"{tensors[unit.entry.name].file.name}: tensor {unit.entry.name} "
                                    f"differs from the source's bytes")
    return problems, checked


def _same_bytes(a: TensorEntry, b: TensorEntry) -> bool:
    return a.nbytes == b.nbytes and same_bytes(a.file, a.begin, b.file, b.begin, a.nbytes)


def _sampled(count: int, sample: int | None, generator: torch.Generator) -> list[int]:
    if sample is None or sample >= count:
        return list(range(count))
    return sorted(torch.randperm(count, generator=generator)[:sample].tolist())


def _read_expert_slices(plan: Plan, layer: MoELayer, outputs: dict[str, TensorEntry], experts: list[int],
                        reader: TensorReader) -> dict[str, torch.Tensor]:
    """The layer's backend tensors restricted to `experts`, stacked along dim 0 and keyed by suffix,
    whether the layout stacks experts in one tensor or writes one tensor per expert."""
    slices: dict[str, list[torch.Tensor]] = {}
    for e in experts:
        for suffix, (name, stacked) in plan.expert_slots(layer, e).items():
            entry = outputs[name]
            slices.setdefault(suffix, []).append(reader.read_index(entry, e) if stacked else reader.read(entry))
    return {suffix: torch.stack(tensors) for suffix, tensors in slices.items()}


def _source_expert(plan: Plan, layer: MoELayer, expert: int, reader: TensorReader) -> ExpertWeights:
    decoded = {}
    for projection, linear in layer.experts[expert].items():
        decoded[projection] = plan.decode_linear({s: reader.read(entry) for s, entry in linear.items()})
    return ExpertWeights(**decoded)


def _check_lossless(plan: Plan, layer: MoELayer, experts: list[int], outputs: dict[str, TensorEntry],
                    reader: TensorReader, audits: Audits) -> tuple[list[str], int]:
    """Mismatch descriptions, and how many experts matched on all three projections."""
    failures, exact = [], 0
    for expert in experts:
        stacked = _read_expert_slices(plan, layer, outputs, [expert], reader)
        try:
            converted = plan.backend.decode_expert({k: v[0] for k, v in stacked.items()}, layer.shape)
        except ValueError as error:  # the layout's own redundancy (e.g. CPU compensation sums) disagrees
            failures.append(f"expert {expert}: {error}")
            continue
        source = _source_expert(plan, layer, expert, reader)
        for projection, linear in layer.experts[expert].items():
            audits.record(next(iter(linear.values())).name.rsplit(".", 1)[0],
                          {"nonfinite_scales": int((~torch.isfinite(getattr(source, projection).scales)).sum())})
        for projection in ("gate", "up", "down"):
            problem = getattr(converted, projection).mismatch(getattr(source, projection))
            if problem:
                failures.append(f"expert {expert} {projection}: {problem}")
        exact += not any(failure.startswith(f"expert {expert} ") for failure in failures)
    return failures, exact


def _check_dense_linears(plan: Plan, linears: list[DenseLinear], tensors: dict[str, TensorEntry],
                         reader: TensorReader) -> list[str]:
    """Every converted dense linear decodes to the source's canonical form, bit for bit."""
    problems = []
    for linear in linears:
        converted = {t.name.rsplit(".", 1)[1]: reader.read(tensors[t.name]) for t in plan.linear_tensors(linear)}
        source = plan.decode_linear({suffix: reader.read(entry) for suffix, entry in linear.tensors.items()})
        problem = plan.backend.decode_linear(converted, linear.shape).mismatch(source)
        if problem:
            problems.append(f"{linear.prefix}: {problem}")
    return problems


def _run_triton(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    from moeconv.kernels import fused_moe, int8_fused_moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    on = {name: tensor.to(device) for name, tensor in tensors.items()}
    if shape.activation_bits == 8:
        return int8_fused_moe(x.to(device), on["w13_weight"], on["w13_weight_scale"], on["w2_weight"],
                              on["w2_weight_scale"], topk_weights.to(device), topk_ids.to(device)).cpu()
    return fused_moe(
        x.to(device), on["w13_qweight"], on["w13_scales"], on.get("w13_qzeros"),
        on["w2_qweight"], on["w2_scales"], on.get("w2_qzeros"),
        topk_weights.to(device), topk_ids.to(device), bits=shape.bits, group_size=shape.group_size,
    ).cpu()


def _run_cpu(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
             topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The x86 kernels' semantics (W4A8 or W8A8: activations rounded to uint8 per row), read from the layout
    the cpu backend wrote (blocked INT4 or VNNI INT8)."""
    from moeconv.kernels.cpu_reference import cpu_fused_moe

    return cpu_fused_moe(tensors, shape, x, topk_weights, topk_ids)


def _via_triton(backend: str) -> Callable[..., torch.Tensor]:
    """The Triton kernel on a per-linear schema's tensors (humming, compressed-tensors), re-encoded through
    the canonical form: the same GEMMs the schema's engine kernels compute."""
    def run(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        source, triton = get_backend(backend), get_backend("triton")
        experts = next(iter(tensors.values())).shape[0]
        encoded = [triton.encode_expert(source.decode_expert({k: v[e] for k, v in tensors.items()}, shape), shape)
                   for e in range(experts)]
        stacked = {suffix: torch.stack([expert[suffix] for expert in encoded]) for suffix in encoded[0]}
        return _run_triton(stacked, shape, x, topk_weights, topk_ids)

    return run


@dataclass(frozen=True)
class LayerKernel:
    """How verify checks one backend's numerics: the kernel that computes the fused MoE by reading
    that backend's tensors (keyed by suffix, restricted to the experts the routing uses, dim 0
    renumbered from 0), where it runs, and the relative error its arithmetic allows."""

    run: Callable[..., torch.Tensor]
    device: Callable[[], str]
    tolerance: Callable[[MoELayerShape], float]


def _triton_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu (Triton interpreter)"


def _triton_tolerance(shape: MoELayerShape) -> float:
    return W8A8_NUMERICS_TOLERANCE if shape.activation_bits == 8 else NUMERICS_TOLERANCE


LAYER_KERNELS: dict[str, LayerKernel] = {
    "triton": LayerKernel(_run_triton, _triton_device, _triton_tolerance),
    # W4A8 and W8A8 alike round activations to int8 per row, the error W8A8_NUMERICS_TOLERANCE bounds:
    # measured for the CPU W8A8 model 1.3e-2 (H=128) to 2.6e-2 (H=4096, I=1536).
    "humming": LayerKernel(_via_triton("humming"), _triton_device, _triton_tolerance),
    "compressed-tensors": LayerKernel(_via_triton("compressed-tensors"), _triton_device, _triton_tolerance),
    "cpu": LayerKernel(_run_cpu, lambda: "cpu (torch model of the x86 W4A8 / W8A8 kernels)",
                       lambda shape: W8A8_NUMERICS_TOLERANCE),
}


def _check_numerics(plan: Plan, layer: MoELayer, outputs: dict[str, TensorEntry], reader: TensorReader,
                    tokens: int, generator: torch.Generator) -> tuple[float, float]:
    """The backend's kernel on the converted tensors against a float64 reference that dequantizes
    the SOURCE through the source format's decoder. Only the experts the routing picks are read."""
    from moeconv.kernels import random_routing, reference_fused_moe, relative_error

    shape = layer.shape
    configured = plan.checkpoint.config.get("num_experts_per_tok")
    # Only the check's routing depends on it: a value that is not a positive integer falls back to 2.
    topk = min(configured if isinstance(configured, int) and not isinstance(configured, bool) and configured > 0
               else 2, shape.experts)
    weights, ids = random_routing(tokens, shape.experts, topk, generator)
    used = sorted(set(ids.flatten().tolist()))
    local_ids = torch.tensor([used.index(e) for e in ids.flatten().tolist()]).reshape(ids.shape)
    x = torch.randn(tokens, shape.hidden, generator=generator).to(torch.float16)
    slices = _read_expert_slices(plan, layer, outputs, used, reader)
    out = LAYER_KERNELS[plan.backend.name].run(slices, shape, x, weights, local_ids)
    sources = [_source_expert(plan, layer, e, reader) for e in used]
    w13 = torch.stack([torch.cat([s.gate.dequantize(torch.float64), s.up.dequantize(torch.float64)]) for s in sources])
    w2 = torch.stack([s.down.dequantize(torch.float64) for s in sources])
    ref = reference_fused_moe(x.double(), w13, w2, weights.double(), local_ids, dtype=torch.float64)
    return float(relative_error(out.double(), ref)), float((out.double() - ref).abs().max())
