"""What a checkpoint is, from its configs and headers (plus the small GPTQ qzeros tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeconv.backends import REGISTRY as BACKENDS
from moeconv.checkpoint.reader import Checkpoint, TensorReader, open_checkpoint
from moeconv.formats.gptq import SuspiciousZeroTally, zero_tally
from moeconv.models import architecture_from_config
from moeconv.plan import detect_format, find_moe_layers


def inspect_checkpoint(source: Path | Checkpoint) -> dict[str, Any]:
    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(Path(source))
    where = str(checkpoint.root / "config.json")
    architecture = architecture_from_config(checkpoint.config, where)
    configured, detection = detect_format(checkpoint, architecture)
    # Describe the checkpoint as the tensors show it; disagreements are reported, not fatal, here.
    source_format = detection.detected if detection.disagreements and detection.detected else configured
    layers = find_moe_layers(checkpoint, architecture, source_format)
    first = layers[0].shape
    expert_bytes = sum(layer.source_bytes for layer in layers)
    report: dict[str, Any] = {
        "path": str(checkpoint.root),
        "origin": checkpoint.origin,
        "architecture": architecture.model_type,
        "format": source_format.describe(),
        "config_format": configured.describe(),
        "detection": detection.to_json(),
        "moe_layers": [layer.module for layer in layers],
        "experts_per_layer": first.experts,
        "expert_shapes": {
            "gate": [first.intermediate, first.hidden],
            "up": [first.intermediate, first.hidden],
            "down": [first.hidden, first.intermediate],
        },
        "scale_dtype": first.scale_dtype,
        "total_bytes": checkpoint.total_bytes,
        "expert_bytes": expert_bytes,
        "tensors": len(checkpoint.tensors),
        "shards": [{"file": path.name, "bytes": path.stat().st_size} for path in checkpoint.files],
        "backends": {name: _verdict(backend, layers) for name, backend in BACKENDS.items()},
    }
    tally = zero_tally(source_format)
    if tally is not None:
        report["suspicious_zero_slots"] = _count_suspicious(tally, layers)
    return report


def _verdict(backend, layers) -> dict[str, Any]:
    for layer in layers:
        reason = backend.refusal(layer.shape)
        if reason:
            return {"eligible": False, "reason": f"{layer.module}: {reason}"}
    return {"eligible": True, "reason": None}


def _count_suspicious(tally: SuspiciousZeroTally, layers) -> dict[str, Any]:
    """GPTQ v1 stores zero − 1, so a true zero of 0 is stored as all ones, and producers disagree on
    the bits around it (see formats/gptq.py). Count such slots and name the first tensor."""
    with TensorReader() as reader:
        for layer in layers:
            for expert in layer.experts:
                for linear in expert.values():
                    found = tally.source_format.suspicious_zero_slots(reader.read(linear["qzeros"]))
                    tally.record(linear["qzeros"].name, found)
    return tally.report()
