"""verify's first level, structure: the output folder against its manifest (every file, its size and
digest, each shard's tensors' digests (hashed once: a shard's digest is made of them), the manifest's own seal), the tensors against the plan's
shapes and dtypes, the JSON files against what this plan writes, the copied side files against the
source's; and the source's shards against the digests recorded as the conversion read them (`digests`,
on the scheduler's thread, with the published digests of an anchored source).

The manifest is `checkpoint.manifest.Manifest`, parsed once (its seal and version checked by the parse)."""

from __future__ import annotations

import json
import stat
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from moeconv import provenance
from moeconv.checkpoint import manifest as manifests
from moeconv.checkpoint.manifest import MANIFEST_NAME, QUANTIZE_CONFIG_NAME, Manifest
from moeconv.checkpoint.reader import INDEX_NAME, TensorEntry, read_json
from moeconv.checkpoint.side_files import side_files
from moeconv.checkpoint.writer import (
    TENSOR_DIGESTS_KEY, DigestScheme, file_digest, hash_threads, range_digests, shard_file_digests,
)
from moeconv.errors import MoeconvError
from moeconv.plan import Plan
from moeconv.verification.report import PROOFS, VerifyReport
from moeconv.verification.scheduler import Scheduler


def check_reading(plan: Plan) -> list[str]:
    """The source's own data against the reading the output was made with: an output converted under
    --trust-config over a config the data contradicts is not certified (decoding the source with the
    same reading would only agree with itself)."""
    if plan.detection is None or plan.trust == "data":
        return []
    return [f"the source's tensors contradict the reading this output was converted with: {disagreement}"
            for disagreement in plan.detection.disagreements]


_SECTIONS = ("files", "metadata_files", "copied_files")  # the manifest's lists of the files the output holds


def _digest_of(path: Path, key: str, tensors: dict[str, dict[str, str]], scheme: DigestScheme) -> str | None:
    """A listed file's digest as its section records it; a shard's tensors' digests, hashed on the way
    (each byte once), go into `tensors` by file name. None for a shard whose header cannot be read or
    whose tensors leave bytes uncovered."""
    if key != "files":
        return file_digest(path, scheme=scheme)
    try:
        digest, tensors[path.name] = shard_file_digests(path, scheme=scheme)
    except ValueError:
        return None
    return digest


def check_links(output: Path) -> list[str]:
    """The output folder's symbolic links, each a problem: convert writes none, and what one points to
    (any file, outside the folder too) is no file of the output to read or to report on."""
    return [f"{path.name}: a link, not a file the conversion wrote; verify reads nothing through it"
            for path in sorted(output.iterdir()) if path.is_symlink()]


def check_files(output: Path, manifest: Manifest, advance: Callable[..., None],
                tensors: dict[str, dict[str, str]] | None = None, cancelled: threading.Event | None = None) -> list[str]:
    """Every file of the output folder against the manifest: each listed one a regular file (not a link)
    of the recorded size and digest, and nothing else there. `tensors` receives each shard's tensors'
    digests (for check_tensor_digests, which then reads nothing again); once `cancelled` is set, no other
    file is read."""
    problems, listed, scheme = [], {MANIFEST_NAME}, manifest.scheme
    tensors = {} if tensors is None else tensors
    for key in _SECTIONS:
        files, digest_key = manifest.listed(key), manifests.digest_key_of(key, scheme)
        if files is None:
            problems.append(f"{MANIFEST_NAME}: {key} must map plain file names to their bytes and {digest_key}")
            continue
        for name, recorded in files.items():
            if cancelled is not None and cancelled.is_set():
                return problems
            listed.add(name)
            path = output / name
            try:
                info = path.lstat()
            except FileNotFoundError:
                problems.append(f"{name}: listed in {MANIFEST_NAME} but missing")
                continue
            if not stat.S_ISREG(info.st_mode):
                problems.append(f"{name}: not a regular file (a link or a folder), but {MANIFEST_NAME} lists a file")
            elif info.st_size != recorded["bytes"] or _digest_of(path, key, tensors, scheme) != recorded[digest_key]:
                problems.append(f"{name}: digest or size differs from {MANIFEST_NAME}")
            advance(info.st_size)
    for path in sorted(output.iterdir()):
        if path.name not in listed:
            problems.append(f"{path.name}: in the output folder but not written by the conversion (not in "
                            f"{MANIFEST_NAME})")
        if path.name not in listed or path.name == MANIFEST_NAME:
            advance(path.stat().st_size if path.is_file() else 0)
    return problems


def check_tensor_digests(entries: list, manifest: Manifest, advance: Callable[..., None],
                         hashed: dict[str, dict[str, str]] | None = None) -> list[str]:
    """Each tensor of the output's shards (reader.TensorEntry) against the digest the manifest records
    for it (writer.tensor_digest, hashed from the file: the bytes an engine reads for it); `hashed`: the
    digests check_files took while checking the shards' own, by file name, which are not hashed again."""
    recorded = manifest.tensor_digests
    if recorded is None:
        return [f"{MANIFEST_NAME}: records no digest per tensor (manifest_version 3 and later: "
                f"files -> shard -> {TENSOR_DIGESTS_KEY}; written by a moeconv before 2026-12-02); convert again"]
    problems = []
    held = {entry.name for entry in entries}
    problems += [f"{MANIFEST_NAME}: records a digest for {name} in {shard}, which holds no such tensor"
                 for name, (shard, _) in sorted(recorded.items()) if name not in held]
    by_file: dict[Path, list] = {}
    for entry in entries:
        by_file.setdefault(entry.file, []).append(entry)
    for path, inside in by_file.items():
        digests = (hashed or {}).get(path.name, {})
        if any(entry.name not in digests for entry in inside):
            digests = range_digests(path, {entry.name: (entry.begin, entry.end) for entry in inside},
                                    scheme=manifest.scheme)
        for entry in inside:
            shard, digest = recorded.get(entry.name, (None, None))
            if shard != path.name:
                problems.append(f"{path.name}: tensor {entry.name}: {MANIFEST_NAME} records no digest for it "
                                f"in this shard")
            elif digests[entry.name] != digest:
                problems.append(f"{path.name}: tensor {entry.name}: its bytes differ from {MANIFEST_NAME}'s digest")
            advance(entry.nbytes)
    return problems


def _first_difference(have: Any, want: Any, where: str) -> str | None:
    """The dotted path of the first place two JSON values differ (None when equal)."""
    if isinstance(have, dict) and isinstance(want, dict):
        for key in sorted(set(have) | set(want)):
            if key not in have or key not in want:
                return f"{where}.{key}".lstrip(".")
            found = _first_difference(have[key], want[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(have, list) and isinstance(want, list) and len(have) == len(want):
        return next((found for i, (a, b) in enumerate(zip(have, want))
                     if (found := _first_difference(a, b, f"{where}[{i}]"))), None)
    return None if (type(have), have) == (type(want), want) else where.lstrip(".") or "(the whole file)"


def _field_problems(name: str, have: Any, want: Any, what: str) -> list[str]:
    """One problem naming the first differing field of a JSON file (`have`, as read), if any, against `want`
    as this plan makes it (tuples, integer keys: compared as the JSON they are written as). Equal
    serializations (true, 1 and 1.0 stay apart) are equal values, found by json's C encoder at once; only
    otherwise (a difference, or keys in another order) is a difference looked for field by field: a Python
    walk over the 90,000 tensors of a 25 GB manifest took seconds."""
    if json.dumps(have) == json.dumps(want):
        return []
    found = _first_difference(have, json.loads(json.dumps(want)), "")
    return [] if found is None else [f"{name}: field {found} differs from {what}"]


def _check_json_files(plan: Plan, output: Path, manifest: Manifest) -> list[str]:
    """config.json field by field against the source's config (the quantization block aside, which must
    describe this conversion); the index, quantize_config.json and the manifest's derived sections
    against what this plan writes."""
    problems = []
    try:
        config = read_json(output / "config.json")
    except MoeconvError as error:
        problems.append(str(error))
    else:
        quantization = plan.quantization_config or None  # none written for a plain checkpoint
        if config.get("quantization_config") != quantization:
            problems.append("config.json: quantization_config does not describe this conversion")
        expected = manifests.output_config(plan)
        problems += _field_problems("config.json", {**config, **({"quantization_config": quantization} if quantization
                                                                  else {})}, expected,
                                    "what the source's config.json gives")
    written = ((QUANTIZE_CONFIG_NAME, plan.quantization_config),) if plan.quantization_config else ()
    for name, want in (*written, (INDEX_NAME, manifests.output_index(plan))):
        try:
            have = read_json(output / name)
        except MoeconvError as error:
            problems.append(str(error))
            continue
        if name == QUANTIZE_CONFIG_NAME and have != want:
            problems.append(f"{QUANTIZE_CONFIG_NAME}: does not match config.json's quantization_config")
        elif name == INDEX_NAME:
            problems += _field_problems(name, have, want, "the index of this conversion")
    derived = manifests.derived(plan, manifest.scheme)
    problems += _field_problems(MANIFEST_NAME, {key: manifest.data.get(key) for key in derived}, derived,
                                "what this conversion records")
    return problems


def _check_side_files(plan: Plan, manifest: Manifest) -> list[str]:
    """The copied files against the source's files of those names, and the source folder's other files
    against those recorded as skipped (convert's own selection, side_files.py)."""
    expected, scheme = side_files(plan.checkpoint, skip_unsafe=True), manifest.scheme
    copied, skipped = manifest.copied_files or {}, manifest.skipped_files
    problems = []
    for side in expected.copied:
        if side.name not in copied:
            problems.append(f"{side.name}: a file of the source that the output lacks (not in {MANIFEST_NAME})")
        elif file_digest(side.path, scheme=scheme) != copied[side.name][scheme.file_key]:
            problems.append(f"{side.name}: differs from the source's {side.path}")
    names = {side.name for side in expected.copied}
    problems += [f"{name}: copied into the output, but the source has no such file to copy"
                 for name in sorted(set(copied) - names)]
    if set(skipped) != set(expected.skipped):
        problems.append(f"{MANIFEST_NAME}: skipped_files {sorted(skipped)} != the source folder's "
                        f"{sorted(expected.skipped)}")
    return problems


def check_source_digests(checkpoint: Any, manifest: Manifest, advance: Callable[..., None],
                         cancelled: threading.Event | None = None) -> tuple[list[str], int]:
    """Every source shard against the digest recorded while the conversion read it (until `cancelled`)."""
    scheme, recorded = manifest.scheme, manifest.source_files
    if recorded is None:
        return [f"{MANIFEST_NAME}: source.file_digests must map the source's shards to their bytes and "
                f"{scheme.file_key}"], 0
    problems = []
    if set(recorded) != {path.name for path in checkpoint.files}:
        problems.append(f"{MANIFEST_NAME}: source.file_digests {sorted(recorded)} != the source's shards")
    for path in checkpoint.files:
        if cancelled is not None and cancelled.is_set():
            break
        if path.name in recorded and (path.stat().st_size != recorded[path.name]["bytes"]
                                      or file_digest(path, scheme=scheme) != recorded[path.name][scheme.file_key]):
            problems.append(f"{path}: the source shard's data differs from what the conversion read "
                            f"(its digest in {MANIFEST_NAME})")
        advance(path.stat().st_size)
    return problems, len(checkpoint.files)


def check_structure(plan: Plan, output: Path, manifest: Manifest, tensors: dict[str, TensorEntry]) -> list[str]:
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
    shard_files = {entry.file.name for entry in tensors.values()}
    files = manifest.files or {}
    if shard_files != set(files):
        problems.append(f"{MANIFEST_NAME}: files {sorted(files)} != index's {sorted(shard_files)}")
    return problems + _check_json_files(plan, output, manifest) + _check_side_files(plan, manifest)


def digests(output: Path, manifest: Manifest, entries: list[TensorEntry], checkpoint: Any,
            anchor: provenance.Anchor | None, advance: Callable[..., None], seconds: dict[str, float],
            cancelled: threading.Event) -> tuple[list[str], list[str], int, list[str]]:
    """The structure level's digests (the output's files, then its tensors, from the same pass), the
    source's shard digests and, for an anchored source, its files against the published digests:
    (structure problems, source problems, source shards checked, files unlike their published digests),
    until `cancelled`. `seconds` gets each one's duration (they overlap verify's other work)."""
    published = None
    if anchor is not None:  # its own threads, beside the rest: a published sha256 is one stream a file
        published = _published_check(checkpoint.root, anchor, advance, seconds, cancelled)
    started = time.perf_counter()
    hashed: dict[str, dict[str, str]] = {}
    problems = check_files(output, manifest, advance, hashed, cancelled)
    if not cancelled.is_set():
        problems += check_tensor_digests(entries, manifest, lambda amount: None, hashed)
    seconds["digests"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    source_problems, checked = check_source_digests(checkpoint, manifest, advance, cancelled)
    seconds["source-digests"] = round(time.perf_counter() - started, 3)
    return problems, source_problems, checked, [] if published is None else published.result()


def _published_check(root: Path, anchor: provenance.Anchor, advance: Callable[..., None],
                     seconds: dict[str, float], cancelled: threading.Event) -> Future:
    """The source's files against the digests the Hub published, on a thread of its own (its files hashed
    `hash_threads()` at once), so that a single large shard's sha256 runs beside the other digests
    instead of after them; its seconds into `seconds["source-published-digests"]`."""
    future: Future = Future()

    def run() -> None:  # a daemon, as the digests' own thread: an interrupted verify does not wait for it
        started = time.perf_counter()
        try:
            future.set_result(provenance.mismatches(root, anchor, sorted(anchor.published), advance,
                                                    threads=hash_threads(), cancelled=cancelled))
        except BaseException as error:  # handed to whoever reads the result
            future.set_exception(error)
        finally:
            seconds["source-published-digests"] = round(time.perf_counter() - started, 3)

    threading.Thread(target=run, name="moeconv-published", daemon=True).start()
    return future


def run_alone(report: VerifyReport, opened: Any, plan: Plan, scheduler: Scheduler) -> VerifyReport:
    """The structure level by itself (asked for, or where the plan's checks already found a problem, or the
    output cannot be opened): the file digests, then each tensor's, each its own phase."""
    output, manifest, converted = opened.output, opened.manifest, opened.converted
    scheduler.phase("digests", sum(path.stat().st_size for path in output.iterdir() if path.is_file()))
    if converted is None:  # the digests then name what else differs
        report.structure_problems = check_files(output, manifest, scheduler.advance) + [str(opened.unreadable)]
        return report
    hashed: dict[str, dict[str, str]] = {}  # each shard's tensors' digests, taken once for the shard's digest
    report.structure_problems += check_files(output, manifest, scheduler.advance, hashed)
    # each tensor too: a damaged shard is then named with the tensors whose bytes changed
    entries = list(converted.tensors.values())
    scheduler.phase("tensor-digests", sum(entry.nbytes for entry in entries))
    report.structure_problems += check_tensor_digests(entries, manifest, scheduler.advance, hashed)
    if not report.structure_problems:
        report.proven["structure"] = PROOFS["structure"]
    return report
