"""What verify reads before its first phase (`phase_seconds["prepare"]`): the output's manifest, the source
it names (or `--source`, which must be the same), both checkpoints' headers, and the plan the manifest's
arguments give; or the problems that stop it before anything can be planned."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeconv import engines, provenance
from moeconv.checkpoint import manifest as manifests
from moeconv.checkpoint.manifest import MANIFEST_NAME, Manifest
from moeconv.checkpoint.reader import Checkpoint, open_checkpoint, read_json
from moeconv.errors import MoeconvError
from moeconv.kernels.runners import layer_tolerance
from moeconv.plan import DEFAULT_MAX_SHARD_SIZE, Plan, make_plan
from moeconv.source import ResolvedSource, is_hub_id, resolve_source
from moeconv.storage import is_object_url
from moeconv.verification.report import VerifyReport
from moeconv.verification.structure import check_links


@dataclass(frozen=True)
class Opened:
    """An output and its source, opened: `converted` is None when the output's shards or index cannot be
    read (`unreadable` says why; the digests then name what else differs)."""

    output: Path
    manifest: Manifest
    checkpoint: Checkpoint  # the source's
    converted: Checkpoint | None
    unreadable: MoeconvError | None
    anchor: provenance.Anchor | None


def open_output(output: Path, source: str | Path | None) -> Opened | list[str]:
    """The output and its source, or the problems that leave nothing to plan from (a failed verification,
    exit 1); MoeconvError for what the user must change (a source that is not the one converted)."""
    if not output.is_dir():
        raise MoeconvError(f"{output}: not a folder (give the folder `moeconv convert -o` wrote)")
    if not ((output / MANIFEST_NAME).exists() or (output / MANIFEST_NAME).is_symlink()):
        raise MoeconvError(f"{output}: no {MANIFEST_NAME}: not a folder written by `moeconv convert`")
    linked = check_links(output)
    if linked:  # convert writes no link, and verify reads nothing through one (it may point anywhere)
        return linked
    try:  # a damaged, unsealed or too old manifest is a failed verification, not a usage error
        manifest = manifests.parse(output)
    except MoeconvError as error:
        return [str(error)]
    recorded = manifest.source
    if source is None:
        if not isinstance(recorded.get("path"), str):
            return [f"{output / MANIFEST_NAME}: source.path is missing; pass --source"]
        resolved = _recorded_source(output, recorded)
    else:
        resolved = resolve_source(source)  # a folder, or a Hub id (from the cache or the Hub)
    anchor = _anchor(output, source or recorded["path"], recorded, resolved.origin)
    checkpoint = open_checkpoint(resolved.path, origin=resolved.origin)
    if recorded.get("headers_sha256") not in (None, checkpoint.headers_sha256):
        raise MoeconvError(f"{checkpoint.root}: not the source {output} was made from (its configs and shard "
                           f"headers differ from those recorded in {MANIFEST_NAME})")
    try:
        converted, unreadable = open_checkpoint(output), None
    except MoeconvError as error:  # a damaged shard or index: reported with what the digests find
        converted, unreadable = None, error
    return Opened(output, manifest, checkpoint, converted, unreadable, anchor)


def plan_of(opened: Opened) -> Plan:
    """The plan of the conversion the manifest records (its backend and arguments, on the source)."""
    arguments = opened.manifest.arguments
    regroup_factor, shard_size = arguments.get("regroup_factor", 1), arguments.get("max_shard_size")
    return make_plan(opened.checkpoint, backend=opened.manifest.backend, trust=arguments.get("trust"),
                     tp=arguments.get("tp", 1),
                     max_shard_size=shard_size if isinstance(shard_size, int) and not isinstance(shard_size, bool)
                     and shard_size > 0 else DEFAULT_MAX_SHARD_SIZE,
                     regroup=isinstance(regroup_factor, int) and regroup_factor > 1,
                     zero_format=arguments.get("zero_format"), cast=_text(arguments.get("cast")),
                     allow_inexact=arguments.get("allow_inexact") is True)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def report_of(opened: Opened, plan: Plan, level: str, phase_seconds: dict[str, float]) -> VerifyReport:
    """The report before any check: what the output is for, the tolerance, where the source came from."""
    anchor = opened.anchor
    return VerifyReport(str(opened.output), str(opened.checkpoint.root), targets=opened.manifest.targets, level=level,
                        tolerance=max(layer_tolerance(plan.backend.numerics, layer.shape) for layer in plan.layers),
                        source_anchor={} if anchor is None else {"repo": anchor.repo, "revision": anchor.revision},
                        provenance=provenance.describe(anchor, 0, [], is_object_url(str(opened.checkpoint.root))),
                        decided_by_user=list(plan.detection.decided_by_user) if plan.detection else [],
                        phase_seconds=phase_seconds)


def scale_cast(output: Path, plan: Plan) -> tuple[str, str] | None:
    """How the engine casts the scales, for the model dtype it reads from the OUTPUT's config.json (a user
    may have changed it)."""
    config = read_json(output / "config.json")
    served = config.get("torch_dtype") or config.get("dtype")
    if not isinstance(served, str):
        return plan.scale_cast
    return engines.VLLM.scale_cast(plan.backend.name, plan.layers[0].shape.scale_dtype, served)


def _recorded_source(output: Path, recorded: dict[str, Any]) -> ResolvedSource:
    """The source moeconv.json names, found without the network: its folder (a relative path is relative
    to the output folder, not to where verify runs), else its Hub id, from the local cache only (a manifest
    must not make verify download anything: `--source ID` does)."""
    path = recorded["path"]
    if is_object_url(path):  # a source in an object store: read there again
        return resolve_source(path)
    folder = Path(os.path.normpath(output / path)) if isinstance(output, Path) else Path(path)
    if folder.is_dir():
        return resolve_source(folder)
    repo = recorded.get("repo")
    repo, revision = (repo, recorded.get("revision")) if isinstance(repo, str) else (path, None)
    where = output / MANIFEST_NAME
    if not is_hub_id(repo):
        raise MoeconvError(f"{where}: source {path}: no such folder (the source path recorded at conversion; a "
                           f"relative path is relative to {output}); if the source moved, or this is another machine, "
                           f"pass --source SRC")
    try:
        return resolve_source(repo, revision=revision if isinstance(revision, str) else None, local_files_only=True)
    except MoeconvError:
        raise MoeconvError(f"{where}: the source is the Hub id {repo}, not in the local Hugging Face cache; verify "
                           f"downloads only when asked: pass --source {repo}") from None


def _anchor(output: Path, source: str | Path, recorded: dict[str, Any],
            origin: dict[str, Any]) -> provenance.Anchor | None:
    """What the source is checked against: the Hub snapshot the conversion read (recorded in the manifest),
    else the one `--source` names now (a check anchored after a conversion from a local copy); a source
    of another commit than the one converted is refused."""
    converted, named = provenance.recorded_anchor(recorded), provenance.recorded_anchor(origin)
    if converted is not None and named is not None and (named.repo, named.revision) != (converted.repo,
                                                                                          converted.revision):
        raise MoeconvError(f"{source}: is {named.repo}@{named.revision}, but {output} was converted from "
                           f"{converted.repo}@{converted.revision}; pass --source {converted.repo}@{converted.revision}")
    return converted or named
