"""Where a checkpoint's bytes live: a local folder, or an object store (`s3://bucket/prefix`, and the
`gs://`, `az://` schemes obstore also speaks), behind one interface, `Storage`: the names under the
root, a name's size, and a byte range of it. Range reads are what reading a checkpoint needs (each
header is its first bytes, each tensor one range), so memory stays bounded by the range asked for.

The object store goes through obstore (docs/BENCHMARKS.md says why: it read 1.4-1.5x as fast as s3fs
from the same server, in one 5.6 MB wheel). Credentials come only from obstore's own configuration,
the standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, ...):
moeconv never takes, stores or prints them, and its errors name the location and the key, never the
library's text (which carries request URLs and headers).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from moeconv.errors import MoeconvError

OBJECT_SCHEMES = ("s3://", "gs://", "az://")
PART_BYTES = 64 * 1024 * 1024  # a multipart upload's part (S3 allows 5 MiB to 5 GiB, at most 10,000 parts)
PARTS_AT_ONCE = 8


class Storage(Protocol):
    """A checkpoint's root: a folder, or a prefix in a bucket."""

    location: str  # as the user wrote it, for messages (no credentials are ever part of it)

    def names(self) -> list[str]:
        """Every file name directly under the root, sorted."""
        ...

    def size(self, name: str) -> int:
        ...

    def read_range(self, name: str, begin: int, end: int) -> bytes:
        """Bytes [begin, end) of `name`; fewer only where the file ends first."""
        ...

    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several ranges of `name` at once (as many `read_range`s)."""
        ...


def is_object_url(location: str) -> bool:
    return str(location).startswith(OBJECT_SCHEMES)


def refuse_mangled_url(location: object, what: str) -> None:
    """A URL that went through `Path` has lost a slash (`s3:/bucket`): refused in one line, never taken for
    a folder named `s3:`."""
    text = str(location)
    if not text.startswith(OBJECT_SCHEMES) and text.startswith(tuple(scheme[:-1] for scheme in OBJECT_SCHEMES)):
        scheme = text.split(":", 1)[0]
        raise MoeconvError(f"{what} {text}: an object store URL that lost a slash (a Path of it?); give it as "
                           f"the string {scheme}://{text.split(':/', 1)[1]}")


@dataclass(frozen=True, order=True)
class StoredPath:
    """A file of a `Storage` by name, or its root (name ""): what a checkpoint's `root` and its tensors'
    `file` are when the checkpoint lives in an object store. It prints as the URL (`s3://bucket/prefix/name`),
    so every message that names a local path names the object the same way; it reads through the storage."""

    storage: Storage = field(compare=False, repr=False)
    location: str  # the storage's, for equality and hashing
    name: str = ""

    @classmethod
    def root_of(cls, storage: Storage) -> StoredPath:
        return cls(storage, storage.location)

    def __str__(self) -> str:
        return f"{self.location}/{self.name}" if self.name else self.location

    def __truediv__(self, name: str) -> StoredPath:
        if self.name:
            raise MoeconvError(f"{self}: a file, not a folder")
        return StoredPath(self.storage, self.location, name)

    def absolute(self) -> StoredPath:
        return self

    def is_dir(self) -> bool:
        """The root: a prefix with objects under it (the storage refuses an empty or missing one, naming it)."""
        return not self.name and bool(self.storage.names())

    def exists(self) -> bool:
        return self.is_dir() if not self.name else self.name in self.storage.names()

    is_file = exists

    def is_symlink(self) -> bool:
        return False  # an object store has no links

    def glob(self, pattern: str) -> list[StoredPath]:
        return [self / name for name in self.storage.names() if fnmatch.fnmatchcase(name, pattern)]

    def size(self) -> int:
        return self.storage.size(self.name)

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        return self.storage.read_ranges(self.name, ranges)

    def iterdir(self) -> list[StoredPath]:
        """The root's objects (the object store's listing, directly under the prefix)."""
        if self.name:
            raise MoeconvError(f"{self}: a file, not a folder")
        return [self / name for name in self.storage.names()]

    def stat(self) -> os.stat_result:
        """A regular file's status of the object's size (what `Path.stat` callers read: st_size, st_mode);
        FileNotFoundError where it is not there, as for a file."""
        if not self.exists():
            raise FileNotFoundError(str(self))
        return os.stat_result((stat.S_IFREG | 0o444, 0, 0, 1, 0, 0, self.size(), 0, 0, 0))

    lstat = stat  # no links

    def read_range(self, begin: int, end: int) -> bytes:
        return self.storage.read_range(self.name, begin, end)


def local_or_stored(location: str | Path) -> Path | StoredPath:
    """An object store URL as a StoredPath root, else the local path (user's ~ expanded, links resolved)."""
    if is_object_url(str(location)):
        return open_root(str(location))
    return Path(location).expanduser().resolve()


def open_root(url: str) -> StoredPath:
    """An object store URL as the root a checkpoint is read from (nothing is requested yet)."""
    return StoredPath.root_of(ObjectStore(url))


def open_storage(location: str | Path) -> Storage:
    """The storage `location` names: an object store URL, else a local folder."""
    if is_object_url(str(location)):
        return ObjectStore(str(location))
    return LocalFolder(Path(location))


class LocalFolder:
    """A folder on this machine's filesystem."""

    def __init__(self, root: Path):
        self.root, self.location = Path(root), str(root)
        if not self.root.is_dir():
            raise MoeconvError(f"{root}: not a folder")

    def names(self) -> list[str]:
        return sorted(entry.name for entry in self.root.iterdir() if entry.is_file())

    def size(self, name: str) -> int:
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            raise MoeconvError(f"{self.root / name}: no such file") from None

    def read_range(self, name: str, begin: int, end: int) -> bytes:
        try:
            fd = os.open(self.root / name, os.O_RDONLY)
        except FileNotFoundError:
            raise MoeconvError(f"{self.root / name}: no such file") from None
        try:
            return os.pread(fd, end - begin, begin)
        finally:
            os.close(fd)

    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        return [self.read_range(name, begin, end) for begin, end in ranges]


_CLIENTS: dict[str, Any] = {}  # this process's obstore client of each location (see `ObjectStore._store`)
_CLIENTS_PID = [0]  # the process they were made in
_CONFIGURATION = ("AWS_", "GOOGLE_", "AZURE_")  # the environment obstore's stores read


def clients_started() -> bool:
    """Whether this process has made an object store client: its runtime's threads do not survive a fork
    (obstore is not fork-safe), so workers must then start from a fresh interpreter (executor.py)."""
    return bool(_CLIENTS) and _CLIENTS_PID[0] == os.getpid()


def _client(location: str) -> Any:
    """This process's client of `location`, made on first use (one per process: a forked or unpickled
    copy of a store makes its own, never the parent's)."""
    from obstore.store import from_url

    if _CLIENTS_PID[0] != os.getpid():
        _CLIENTS.clear()
        _CLIENTS_PID[0] = os.getpid()
    # the environment the client reads is part of its key (a hash, in memory only): changed credentials
    # make a new client, as a new process would
    key = location + "\0" + hashlib.sha256(repr(sorted(
        (name, value) for name, value in os.environ.items() if name.startswith(_CONFIGURATION))).encode()).hexdigest()
    if key not in _CLIENTS:
        try:
            _CLIENTS[key] = from_url(location + "/")
        except Exception as error:  # noqa: BLE001 (obstore raises its own kinds for a URL it cannot take)
            raise MoeconvError(f"{location}: not an object store URL obstore can open "
                               f"({type(error).__name__}); give s3://BUCKET/PREFIX") from None
    return _CLIENTS[key]


class ObjectStore:
    """A prefix in a bucket, read through obstore by ranges. Pickled (into a worker's task), it carries
    its location and listing, never a client or a credential: the worker makes its own client from its
    environment."""

    def __init__(self, url: str):
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise MoeconvError(f"{url}: reading object stores needs obstore: pip install 'moeconv[s3]'") from None
        self.location = url.rstrip("/")
        _client(self.location)  # refuses a URL obstore cannot open, before anything else
        self._sizes: dict[str, int] | None = None

    @property
    def _store(self) -> Any:
        return _client(self.location)

    def _listing(self) -> dict[str, int]:
        if self._sizes is None:
            try:
                listed = self._store.list_with_delimiter()
            except Exception as error:  # noqa: BLE001
                raise self._refusal(error, None) from None
            sizes = {entry["path"]: entry["size"] for entry in listed["objects"]}
            if not sizes:
                raise MoeconvError(f"{self.location}: no objects there (an empty prefix, or a missing bucket)")
            self._sizes = sizes
        return self._sizes

    def names(self) -> list[str]:
        return sorted(self._listing())

    def names_if_any(self) -> list[str]:
        """Every object directly under the prefix, none where it is empty (an output's prefix may be)."""
        try:
            listed = self._store.list_with_delimiter()
        except Exception as error:  # noqa: BLE001
            raise self._refusal(error, None) from None
        return sorted(entry["path"] for entry in listed["objects"])

    def stamp(self, name: str) -> tuple[int, str | None] | None:
        """The object's size and entity tag (what changes when it is written again), None where it is not."""
        import obstore

        try:
            meta = obstore.head(self._store, name)
        except FileNotFoundError:
            return None
        except Exception as error:  # noqa: BLE001
            raise self._refusal(error, name) from None
        return meta["size"], meta["e_tag"]

    def put_file(self, name: str, path: Path) -> str | None:
        """The local file uploaded whole as object `name` (a multipart upload of `PART_BYTES` parts, a few at a
        time, when it is larger than one part; the store makes the object appear whole or not at all);
        its entity tag."""
        import obstore

        self._sizes = None
        try:
            return obstore.put(self._store, name, Path(path), chunk_size=PART_BYTES,
                               max_concurrency=PARTS_AT_ONCE)["e_tag"]
        except Exception as error:  # noqa: BLE001
            raise self._refusal(error, name) from None

    def delete(self, name: str) -> None:
        import obstore

        self._sizes = None
        try:
            obstore.delete(self._store, name)
        except FileNotFoundError:
            pass
        except Exception as error:  # noqa: BLE001
            raise self._refusal(error, name) from None

    def size(self, name: str) -> int:
        sizes = self._listing()
        if name not in sizes:
            raise MoeconvError(f"{self.location}/{name}: no such object")
        return sizes[name]

    def read_range(self, name: str, begin: int, end: int) -> bytes:
        import obstore

        end = min(end, self.size(name))
        if end <= begin:
            return b""
        try:
            return bytes(obstore.get_range(self._store, name, start=begin, end=end))
        except Exception as error:  # noqa: BLE001
            raise self._refusal(error, name) from None

    def read_ranges(self, name: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several byte ranges of one object in one call (obstore's `get_ranges`: requests made
        concurrently, neighbouring ranges coalesced into one request), each as `read_range` gives it."""
        import obstore

        size = self.size(name)
        clipped = [(begin, max(begin, min(end, size))) for begin, end in ranges]
        asked = [(begin, end) for begin, end in clipped if end > begin]
        try:
            got = iter(obstore.get_ranges(self._store, name, starts=[begin for begin, _ in asked],
                                          ends=[end for _, end in asked])) if asked else iter(())
        except Exception as error:  # noqa: BLE001
            raise self._refusal(error, name) from None
        return [bytes(next(got)) if end > begin else b"" for begin, end in clipped]

    def _refusal(self, error: Exception, name: str | None) -> MoeconvError:
        """The store's refusal as one line that names the location and the key, never the library's text."""
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        where = self.location if name is None else f"{self.location}/{name}"
        text = str(error)  # S3's error codes are read from the library's text, never printed
        if isinstance(error, (PermissionDeniedError, UnauthenticatedError)) or any(
                code in text for code in ("AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId")):
            return MoeconvError(f"{where}: access denied; check the credentials in the environment "
                                f"(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the store's configuration")
        if "NoSuchBucket" in text:
            return MoeconvError(f"{where}: no such bucket")
        if isinstance(error, FileNotFoundError):
            return MoeconvError(f"{where}: no such bucket or object")
        return MoeconvError(f"{where}: the object store refused ({_kind(error)}); check the URL, the endpoint "
                            f"(AWS_ENDPOINT_URL) and the network")


def _kind(error: Any) -> str:
    return type(error).__name__
