"""Runs a conversion's output shards as Ray tasks (`convert --executor ray`), and verify's checks
(`verify --executor ray`): on one machine or many.

The driver plans from headers and keeps the journal; each task converts one output shard exactly as
the local executor does (the caller's task, moeconv.conversion.convert_shard_alone: the same jobs, the
same bytes), writing it under a temporary name of its own in the staging folder, then its record
beside it, then renaming it when whole, and returns its digest, its source fingerprint and its audit
counts. A task that finishes after its driver was killed is kept by the resume through that record,
and a task that outlives its driver never renames another attempt's temporary file
(checkpoint/journal.py). So, for an output folder, every node must see the source and the output's parent
folder at the same paths (shared storage); a task is idempotent either way: a retry (Ray retries a
task whose worker or node died) rewrites the shard from the start. An input error is not retried:
the driver raises the task's own error, one line naming the file and tensor.

An output in an object store (`-o s3://...`) needs no shared storage: each task fills its shard in a
temporary folder on its own machine and uploads it to the output prefix itself
(moeconv.conversion.convert_shard_to_store), the driver journals its size and entity tag, and commits (index,
configs, moeconv.json last) from its spool (checkpoint/upload.py). A source in a store is read by range
requests from every task; a source folder must be at the same path on every node (a copy on each).

Parallelism is one task per output shard (`--max-shard-size` makes more, smaller ones); each task
uses one core. Progress counts each shard's source bytes when its task finishes. verify sends each
expert's and linear's check as a task (`RayMap`, the local executor's `map`).
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from moeconv.errors import MoeconvError, Unfinished

Progress = Callable[[int], None]
_LOCAL_OBJECT_STORE = 256 * 1024 * 1024


def _check_reachable(address: str) -> None:
    """A cluster's GCS address (host:port) answers a TCP connect, checked first: Ray itself retries
    an unreachable address for minutes, logging as it goes. Client addresses (ray://) go to Ray."""
    import socket

    if "://" in address:
        if not address.startswith("ray://"):
            raise MoeconvError(f"--ray-address {address}: give the head node's HOST:PORT, or a Ray client address "
                               f"ray://HOST:PORT")
        return
    host, _, port = address.rpartition(":")
    if not (host and port.isdigit()):
        raise MoeconvError(f"--ray-address {address}: give the head node's HOST:PORT (e.g. 10.0.0.1:6379), "
                           f"or leave it out to start a local Ray")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as error:
        raise MoeconvError(f"--ray-address {address}: no Ray cluster reachable there ({error.strerror or error}); "
                           f"give the head node's host:port, or leave it out to start a local Ray") from None


def connect(address: str | None) -> tuple[bool, str]:
    """Joins the Ray cluster at `address`, else the one this machine belongs to (RAY_ADDRESS, or a
    local `ray start`), else starts a local Ray. Returns (started here, a description in words)."""
    try:
        import ray
    except ImportError:
        raise MoeconvError("--executor ray needs Ray: pip install 'moeconv[ray]'") from None
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False, "include_dashboard": False}
    started = False
    if not ray.is_initialized():
        if address:
            _check_reachable(address)
        try:
            ray.init(address=address or "auto", **quiet)
        except Exception as error:  # noqa: BLE001 (Ray's client raises whatever its transport does)
            if address:
                raise MoeconvError(f"--ray-address {address}: no Ray cluster reachable there "
                                   f"({_first_line(error)})") from None
            if not isinstance(error, ConnectionError):
                raise Unfinished(f"--executor ray: the Ray cluster found here did not answer "
                                   f"({_first_line(error)})") from None
            try:
                ray.init(object_store_memory=_LOCAL_OBJECT_STORE, **quiet)  # only the plan goes through it
            except Exception as error:  # noqa: BLE001 (e.g. its raylet timed out starting on a busy machine)
                raise Unfinished(f"--executor ray: a local Ray could not start ({_first_line(error)}); run the "
                                 f"same command again to resume, or use --executor local") from None
            started = True
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    cpus = int(ray.cluster_resources().get("CPU", 0))
    where = "a local Ray started for this run" if started else "the Ray cluster"
    return started, f"ray: {where} ({len(nodes)} node{'s' if len(nodes) != 1 else ''}, {cpus} CPUs)"


class RayShards:
    """Runs shards as Ray tasks (see the module docstring). `task(plan, shard index, where)` converts one
    shard in the calling process and returns what the journal records; `where` is the staging folder, or
    `destination` where one is given (an object store prefix the task uploads its shard to)."""

    def __init__(self, task: Callable, address: str | None = None, max_retries: int = 3,
                 destination: str | None = None):
        self.address, self.task, self.max_retries, self.destination = address, task, max_retries, destination
        self.device = "ray"
        # conversion.ShardRunner's accounts of the machine's process tree: Ray's tasks run elsewhere
        self.worker_peak_rss_mb = self.tree_peak_pss_mb = self.largest_worker_pss_mb = self.tree_cpu_seconds = None

    def run(self, plan: Any, shards: list, staging: Path, advance: Progress) -> Iterator[Any]:
        """The finished shards (convert.ShardDone), in the order their tasks finish."""
        started, self.device = connect(self.address)
        import ray

        pending: dict = {}
        try:
            remote = ray.remote(num_cpus=1, max_retries=self.max_retries)(self.task)
            plan_ref = ray.put(plan)
            index = {shard.file_name: number for number, shard in enumerate(plan.shards)}
            where = self.destination or str(staging)
            pending = {remote.remote(plan_ref, index[shard.file_name], where): shard for shard in shards}
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                shard = pending.pop(ready[0])
                done = _result(ready[0])
                advance(shard.source_bytes)
                yield done
        finally:  # a failed task, a stop, or a caller that took no more: the other tasks end with the run
            for other in pending:
                ray.cancel(other, force=True)
            if started:
                ray.shutdown()


def _result(reference: Any) -> Any:
    """A finished task's value; its input or filesystem error re-raised as itself, anything else (an
    unexpected exception in the task, a worker or raylet dead past the retries) as one line."""
    import ray

    try:
        return ray.get(reference)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, (MoeconvError, OSError)):
            raise error.cause from None
        raise Unfinished(f"a Ray task failed: {_first_line(error.cause)}; run the same command again to "
                         f"resume") from None
    except ray.exceptions.RayError as error:
        raise Unfinished(f"Ray could not finish a task: {_first_line(error)}; run the same command again to "
                         f"resume") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


class RayMap:
    """moeconv.executor.Executor's `map(function, tasks)` as Ray tasks, results in task order, at most
    two per cluster CPU in flight; a context manager that joins or starts Ray (see `connect`)."""

    def __init__(self, address: str | None = None):
        self.address = address
        self.started, self.device = False, "ray"

    def __enter__(self) -> RayMap:
        self.started, self.device = connect(self.address)
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        if self.started:
            ray.shutdown()

    @property
    def workers(self) -> int:
        """The cluster's CPUs: a task each runs at once (`map` keeps two each in flight)."""
        import ray

        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def map(self, function: Callable, tasks: Iterable[tuple]) -> Iterator[Any]:
        import ray

        remote = ray.remote(num_cpus=1)(function)
        window = 2 * self.workers
        pending: deque = deque()
        try:
            for task in tasks:
                pending.append(remote.remote(*task))
                if len(pending) >= window:
                    yield _result(pending.popleft())
            while pending:
                yield _result(pending.popleft())
        finally:
            for reference in pending:
                ray.cancel(reference, force=True)
