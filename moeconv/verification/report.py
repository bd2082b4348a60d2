"""verify's report: what each level found and proved, the verdict and its caveats; the CLI only renders it
(`render.print_verify`, `--json`: `to_json`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from moeconv.kernels.runners import NUMERICS_TOLERANCE

if TYPE_CHECKING:
    from moeconv.audit import Audits
    from moeconv.provenance import Anchor


@dataclass
class LayerResult:
    module: str
    experts: int = 0  # in the layer
    experts_checked: int = 0
    experts_exact: int = 0
    experts_routed: int | None = None  # the experts the kernel check's tokens reached (numerics)
    blocks_checked: int | None = None  # float codes: the scale blocks of those experts the kernel decoded (numerics)
    lossless_failures: list[str] = field(default_factory=list)
    numerics_failure: str | None = None  # the kernel cannot read the tensors (it would misread them)
    relative_error: float | None = None
    max_abs_error: float | None = None
    max_abs_reference: float | None = None  # the reference's largest output: the scale max_abs_error is on
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
    # The engine casts scales to the model dtype at load: how many of the checked ones change, how
    # many overflow to inf (a failure: the served model would compute with them), the largest change.
    engine_scale_cast: dict[str, Any] = field(default_factory=dict)
    level: str = "numerics"  # the level asked for
    source_files_checked: int = 0  # source shards hashed against the digests recorded at conversion
    source_problems: list[str] = field(default_factory=list)
    # Where the source came from (moeconv.provenance): the Hub repository and commit it is anchored to
    # ({} for a local folder), how many of its files were hashed against the published digests, the line.
    source_anchor: dict[str, str] = field(default_factory=dict)
    published_files_checked: int = 0
    provenance_problems: list[str] = field(default_factory=list)
    provenance: str = ""
    proven: dict[str, list[str]] = field(default_factory=dict)  # level -> what passing it proved (PROOFS)
    # What the source's data could not decide and the user chose at conversion (--gptq-zero-format,
    # --trust-config): lossless then means "exact under that choice", not "the data confirms it".
    decided_by_user: list[str] = field(default_factory=list)
    # The MoE layers the kernel ran on when verify's default sampled them (on a CPU); empty: every layer it ran on
    # was asked for (--level numerics, --numerics-layers).
    kernel_sample: list[str] = field(default_factory=list)
    kernel_experts: int | None = None  # how many of each sampled layer's checked experts the kernel ran on, if fewer
    numerics_not_run: str | None = None  # why the numerics level ran no kernel where it was asked for
    phase_seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase (PHASE_UNITS)
    # --cast outputs: the census moeconv.json records (recomputed from the source: `cast_problems` where it differs)
    cast_census: dict[str, Any] = field(default_factory=dict)
    cast_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.structure_problems and not self.source_problems and not self.provenance_problems
                and not self.passthrough_problems and not self.dense_linear_problems and not self.cast_problems
                and all(l.ok for l in self.layers) and not self.engine_scale_cast.get("overflow"))

    def failures(self) -> list[str]:
        found = (self.structure_problems + self.source_problems + self.provenance_problems + self.passthrough_problems
                 + self.dense_linear_problems + self.cast_problems)
        cast = self.engine_scale_cast
        if cast.get("overflow"):
            found.append(f"{cast['overflow']} scales overflow to inf when the engine casts them from "
                         f"{cast['stored']} to the model dtype {cast['model']}; serve with --dtype {cast['stored']}")
        for layer in self.layers:
            found += [f"{layer.module}: {problem}" for problem in layer.lossless_failures]
            if layer.numerics_failure:
                found.append(f"{layer.module}: numerics: {layer.numerics_failure}")
            elif not layer.ok and not layer.lossless_failures:
                found.append(f"{layer.module}: relative error {layer.relative_error:.3g} > {layer.tolerance:g}")
        return found

    def caveats(self) -> list[str]:
        """What a passing verdict does not say, in its own words: the last line's caveats and the JSON's (the
        table's rows carry each too)."""
        found = (["the tensors' bytes are self-consistent; not compared with the source (--level lossless compares "
                  "them)"] if self.level == "structure" else [])
        found += [f"decided by the user, not the data: {what}" for what in self.decided_by_user]
        if self.level != "structure" and any(layer.experts_checked < layer.experts for layer in self.layers):
            checked = sum(layer.experts_checked for layer in self.layers)
            total = sum(layer.experts for layer in self.layers)
            found.append(f"only {checked} of the {total} experts decoded, a random sample (--sample); the others "
                         f"were not compared with the source")
        census = self.cast_census
        if census and census.get("exact") != census.get("blocks"):
            found.append(f"an inexact cast ({census.get('label')}): {census.get('blocks', 0) - census.get('exact', 0)} of "
                         f"{census.get('blocks')} blocks hold the cast's rounding, not the source's values (worst "
                         f"relative error {census.get('bound')}, recorded and recomputed)")
        if self.numerics_not_run:
            found.append(f"numerics not run: {self.numerics_not_run}")
        if self.engine_scale_cast.get("changed"):
            found.append(f"{self.engine_scale_cast['changed']} scale(s) change when the engine casts them "
                         f"(serve with --dtype {self.engine_scale_cast['stored']})")
        if self.nonfinite_scales:
            found.append(f"{self.nonfinite_scales['count']} NaN or infinite scales in the source (first: "
                         f"{self.nonfinite_scales['first_tensor']}), converted as they are: no kernel can compute with them")
        return found

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["caveats"] = self.caveats()
        for layer, result in zip(data["layers"], self.layers):
            layer["ok"] = result.ok
        return data


LEVELS = ("structure", "lossless", "numerics")  # each includes the ones before it
# verify's progress, phase by phase: `progress(0, total, phase)` starts a phase, `progress(n)` advances it.
# --level structure: digests (the output's file bytes, hashed), then tensor-digests (the output's tensor
# bytes: hashed in the same pass, counted again). Above it, one phase, lossless: the output's file bytes
# and the source's shard bytes hashed (on a thread) while the source bytes of the checked jobs are read
# and compared (in the workers), all three counted; then kernel: MoE layers run through the reference
# kernel. `phase_seconds` also gives what came before the first phase (`prepare`: the manifest, both
# checkpoints' headers, the plan, the structure checks) and, inside lossless, how long the output's digests,
# the source's, the workers' start and the checks each took (the digests overlap the other two).
PHASE_UNITS = {"digests": "bytes", "tensor-digests": "bytes", "lossless": "bytes", "kernel": "layers"}

# What passing each level proves, as the report states it (docs/FORMAT.md, "What verify proves").
PROOFS = {
    "structure": [
        "every file in the output folder is listed in moeconv.json with its size and block digest, and "
        "nothing else is there; moeconv.json matches its own digest (this proves the output is as recorded, "
        "not who recorded it: the levels below compare it with the source)",
        "every tensor of every shard hashes to the digest moeconv.json records for it (what vLLM's plugin checks "
        "with MOECONV_VERIFY_ON_LOAD=1)",
        "config.json equals the source's config.json field by field, with moeconv's quantization_config; "
        "quantize_config.json, the index and moeconv.json's derived sections are what this conversion writes",
        "every tensor the layout needs is there with the planned shape and dtype, and no other tensor",
        "each copied file equals the source's file of that name; every other file of the source folder is one "
        "recorded as skipped",
    ],
    "lossless": [
        "every source shard hashes to the digest recorded while the conversion read it",
        "every expert and every converted dense linear decodes bit for bit to what the source format's decoder "
        "gives for the source's tensors; every pass-through tensor is byte-identical to the source's",
    ],
    "numerics": [
        "the backend's reference kernel, run on the output's bytes for random tokens that reach every checked "
        "expert, agrees with a float64 reference computed from the source within the stated tolerance (on the "
        "layers it ran)",
    ],
}


def finished(report: VerifyReport, audits: Audits, cast: tuple[str, str] | None, sample: int | None,
             anchor: Anchor | None) -> VerifyReport:
    """The checked report with what passing proved (the source's non-finite scales already in it: the kernel
    check's sample depends on them)."""
    if cast is not None:
        report.engine_scale_cast = {"stored": cast[0], "model": cast[1], **audits.casts}
    if report.ok:
        report.proven["lossless"] = PROOFS["lossless"] + ([f"(only {sample} random experts per layer were "
                                                            f"decoded: --sample)"] if sample else [])
        if anchor is not None:
            report.proven["lossless"].append(f"every file of the source matches the digest the Hub published for it "
                                             f"in {anchor.repo}@{anchor.revision}")
        if report.level == "numerics" and any(layer.relative_error is not None for layer in report.layers):
            report.proven["numerics"] = PROOFS["numerics"]
    return report
