"""A local folder or a Hugging Face Hub id -> a checkpoint folder on disk.

Hub ids go through `huggingface_hub.snapshot_download`, restricted to the files a conversion needs,
into the normal cache; `HF_HUB_OFFLINE=1` and `local_files_only` are honoured by the library. A Hub
source, or a folder that is a snapshot in a Hub cache, carries its anchor (moeconv.provenance): the
repository, the commit and the digests the Hub published for its files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeconv.errors import MoeconvError
from moeconv.provenance import anchor_of
from moeconv.storage import StoredPath, is_object_url, open_root

# safetensors shards and index, configs, tokenizer and generation files.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_AT_REVISION = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)@(?P<revision>[^@]+)$")  # org/model@rev


@dataclass(frozen=True)
class ResolvedSource:
    path: Path | StoredPath  # StoredPath: a prefix in an object store (s3://bucket/prefix), read by ranges
    # Hub snapshots: {"repo", "revision" (a commit), "published": provenance.Anchor.to_json()}
    origin: dict[str, Any] = field(default_factory=dict)


def resolve_source(source: str | Path, revision: str | None = None, local_files_only: bool = False) -> ResolvedSource:
    """A folder that exists wins; otherwise `org/name` (or `org/name@revision`) is fetched (or found in
    the cache). An object store URL (`s3://bucket/prefix`, storage.OBJECT_SCHEMES) is read where it is,
    by ranges, with the credentials of the store's standard environment."""
    if is_object_url(str(source)):
        if revision or local_files_only:
            flag = "--revision" if revision else "--local-files-only"
            raise MoeconvError(f"{source}: {flag} applies to Hub ids, not to an object store URL")
        return ResolvedSource(open_root(str(source)))
    path = Path(source).expanduser()
    if path.is_dir():
        if revision:
            raise MoeconvError(f"{path}: --revision applies to Hub ids, not to a local folder")
        return ResolvedSource(path, _origin(path))
    text = str(source)
    pinned = _AT_REVISION.match(text)
    if pinned and revision is not None and revision != pinned["revision"]:
        raise MoeconvError(f"{text}: names revision {pinned['revision']}, but --revision says {revision}")
    if pinned:
        text, revision = pinned["repo"], pinned["revision"]
    if not is_hub_id(text):
        raise MoeconvError(f"{text}: not a folder, and not a Hugging Face id like org/model")
    if revision is not None and not _is_revision_name(revision):
        raise MoeconvError(f"--revision {revision}: not a branch, tag or commit name")
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub

    wanted = f"{text}@{revision or 'main'}"
    try:
        folder = snapshot_download(text, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                   local_files_only=local_files_only)
    except hub.RevisionNotFoundError:
        raise MoeconvError(f"{wanted}: revision {revision!r} does not exist in {text}") from None
    except hub.RepositoryNotFoundError:
        raise MoeconvError(f"{text}: {_no_folder(path)}, and no such model repository on the Hub (or it is private: "
                           f"log in with `hf auth login`)") from None
    except hub.LocalEntryNotFoundError:
        raise MoeconvError(_not_cached(text, revision, path)) from None
    except hub.HFValidationError as error:
        raise MoeconvError(f"{text}: {_no_folder(path)}, and not a valid Hugging Face id "
                           f"({str(error).splitlines()[0]})") from None
    except hub.HfHubHTTPError as error:
        raise MoeconvError(f"{wanted}: the Hub refused the download ({error.__class__.__name__}: {error})") from None
    except OSError as error:  # a damaged cache: a ref that is a folder, an unreadable file
        raise MoeconvError(f"{wanted}: the Hugging Face cache could not be read ({error})") from None
    folder = Path(folder)
    if not _COMMIT.match(folder.name) or folder.parent.name != "snapshots":
        # a ref file naming `../../elsewhere` would make the snapshot a folder outside the cache
        raise MoeconvError(f"{wanted}: the Hugging Face cache names {folder}, not a snapshot of a commit; "
                           f"its refs are damaged (remove the repository from the cache to download it again)")
    origin = _origin(folder)
    if origin.get("repo") != text:
        raise MoeconvError(f"{wanted}: the Hugging Face cache's snapshot {folder} holds files that are not links to "
                           f"its blobs (changed in place): remove the repository from the cache to download it again")
    return ResolvedSource(folder, origin)


def _origin(folder: Path) -> dict[str, Any]:
    """A Hub snapshot's repository, commit and published digests; nothing for another folder."""
    anchor = anchor_of(folder)
    return {} if anchor is None else {"repo": anchor.repo, "revision": anchor.revision, "published": anchor.to_json()}


def is_hub_id(text: str) -> bool:
    """`org/name`, as a Hub model id is spelled (the Hub may still refuse it)."""
    return bool(_REPO_ID.match(text))


def _is_revision_name(revision: str) -> bool:
    """A git ref or commit: no empty, `.` or `..` component, not absolute, no backslash or NUL (it
    becomes a path inside the cache)."""
    parts = revision.split("/")
    return bool(revision) and "\\" not in revision and "\0" not in revision and all(
        part not in ("", ".", "..") for part in parts)


def _no_folder(path: Path) -> str:
    """`org/name` is also a relative path: a mistyped local folder must read as one."""
    return f"no such folder in {path.parent}/" if path.parent.is_dir() else "no such folder"


def _not_cached(repo_id: str, revision: str | None, path: Path) -> str:
    """Downloads are off: say whether the repository or only the revision is missing from the cache."""
    from huggingface_hub import CacheNotFound, constants, scan_cache_dir

    off = "it could not be downloaded (no network, HF_HUB_OFFLINE=1 or --local-files-only)"
    try:
        cached = next((repo for repo in scan_cache_dir().repos
                       if repo.repo_id == repo_id and repo.repo_type == "model"), None)
    except CacheNotFound:
        cached = None
    if cached is None:
        return (f"{repo_id}: {_no_folder(path)}, and not a model in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}), and {off}")
    known = sorted({ref for rev in cached.revisions for ref in rev.refs} | {rev.commit_hash[:12] for rev in cached.revisions})
    return (f"{repo_id}@{revision or 'main'}: revision not in the local cache (cached: {', '.join(known)}) "
            f"and {off}")
