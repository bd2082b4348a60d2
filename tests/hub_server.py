"""A local stand-in for the Hugging Face Hub's HTTP API, so that huggingface_hub itself downloads a
repository and writes its real cache layout (snapshots linking to blobs named by the digests this server
publishes), with no network. It publishes what the Hub publishes for a commit: the sha256 of each LFS
file (the safetensors shards; `X-Linked-Etag` on the Hub) and the git blob id of the others (`ETag`),
computed here from the files it serves, never by moeconv.

    with HubServer({"org/model": folder}) as hub:   # then HF_ENDPOINT=hub.url, HF_HUB_CACHE=...
        snapshot_download("org/model")
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Repository:
    def __init__(self, folder: Path):
        self.files = {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}
        listing = json.dumps({name: hashlib.sha256(data).hexdigest() for name, data in self.files.items()})
        self.commit = hashlib.sha1(listing.encode()).hexdigest()

    def is_lfs(self, name: str) -> bool:
        return name.endswith(".safetensors")

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(name) else git_blob_id(data)

    def tree(self) -> list[dict]:
        entries = []
        for name, data in self.files.items():
            entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
            if self.is_lfs(name):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries


class HubServer:
    def __init__(self, repositories: dict[str, Path]):
        self.repositories = {repo: _Repository(Path(folder)) for repo, folder in repositories.items()}
        self.requests: list[str] = []
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def commit(self, repo: str) -> str:
        return self.repositories[repo].commit

    def __enter__(self) -> HubServer:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.hub.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo = self.hub.repositories.get("/".join(parts[2:4]))
            if repo is None:
                return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
            if parts[5] not in ("main", repo.commit):
                return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, head)
            if parts[4] == "revision":
                body = {"id": "/".join(parts[2:4]), "sha": repo.commit,
                        "siblings": [{"rfilename": name} for name in repo.files]}
            else:
                body = repo.tree()
            return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.hub.repositories.get("/".join(parts[:2]))
            name = "/".join(parts[4:])
            if repo is None or parts[3] not in ("main", repo.commit) or name not in repo.files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
            etag = repo.etag(name)
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
            if repo.is_lfs(name):
                headers["X-Linked-Etag"] = f'"{etag}"'
                headers["X-Linked-Size"] = str(len(repo.files[name]))
            return self._send(200, repo.files[name], headers, head)
        self._send(404, b"", {}, head)

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
        self._route(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._route(head=False)
