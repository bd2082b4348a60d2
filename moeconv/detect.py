"""What the tensors say the format is, cross-checked against what the config says.

The config says what a checkpoint should be; the tensors say what it is. Engines trust the config,
and a GPTQ checkpoint whose config says v1 but whose zero points are v2 (or the reverse) loads
without complaint and generates garbage ("!!!!"). moeconv reads a sample of the expert tensors,
infers the format from them, and stops on any disagreement with an explanation, unless the user
says which side to trust.

Evidence used:
- packing from shapes: AWQ qweight is (K, N/8), GPTQ's is (K·b/32, N), for K and N from config.json;
  the bit width follows from the GPTQ rows, the group size from the scales' rows.
- GPTQ symmetric vs asymmetric: symmetric checkpoints carry one filler word in every qzeros slot,
  2^(b−1) − 1 in v1 (0x77777777 for 4-bit) and 2^(b−1) in v2 (0x88888888).
- GPTQ v1 vs v2 for asymmetric zero points: with round-to-nearest min/max quantization of weights
  that average to about zero, a group's mean code sits near its zero point. Read with the right
  convention, the median over groups of (mean code − zero) is near 0; read with the wrong one it is
  off by one. The convention whose median is closer to 0, by a clear margin, wins.
- act-order from g_idx: anything but k // g is act-order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from moeconv import packing
from moeconv.checkpoint.reader import TensorEntry, TensorReader
from moeconv.formats import AWQ, GPTQ, SourceFormat
from moeconv.formats.base import effective_group_size

# Expert linears read for the statistics: enough groups for a stable median, little I/O.
SAMPLE_LINEARS = 12
_MARGIN = 0.3  # code units by which one convention's median must beat the other's


@dataclass
class Detection:
    """The format the data shows (None: could not tell) and every disagreement with the config."""

    detected: SourceFormat | None
    evidence: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    act_order: str | None = None  # why the checkpoint is act-order, if it is

    def to_json(self) -> dict[str, Any]:
        return {"detected": None if self.detected is None else self.detected.describe(),
                "evidence": self.evidence, "disagreements": self.disagreements, "act_order": self.act_order}


def detect(linears: Iterable[tuple[dict[str, TensorEntry], int, int]], configured: SourceFormat) -> Detection:
    """`linears`: (tensors by suffix, out_features, in_features) of routed experts, as the config sizes them."""
    sample = []
    for linear in linears:
        sample.append(linear)
        if len(sample) == SAMPLE_LINEARS:
            break
    detection = Detection(None)
    if not sample or not {"qweight", "scales"} <= set(sample[0][0]):
        return detection  # not a format this module knows how to read from data
    tensors, out_features, in_features = sample[0]
    packed = _packing_from_shapes(tensors, out_features, in_features, detection)
    if packed is None:
        return detection
    method, bits, group_size = packed
    with TensorReader() as reader:
        if method == "awq":
            detection.detected = AWQ(bits=bits, group_size=group_size, zero_point="qzeros" in tensors)
        else:
            detection.detected = _gptq_from_data(sample, bits, group_size, reader, detection)
        _check_act_order(sample, reader, detection)
    _compare(configured, detection)
    return detection


def _packing_from_shapes(tensors: dict[str, TensorEntry], n: int, k: int,
                         detection: Detection) -> tuple[str, int, int] | None:
    rows, columns = tensors["qweight"].shape
    groups = tensors["scales"].shape[0]
    group_size = -1 if groups == 1 else k // groups
    if (rows, columns) == (k, n // 8):
        detection.evidence.append(f"qweight {list(tensors['qweight'].shape)} is packed along N: AWQ, 4-bit")
        return "awq", 4, group_size
    if columns == n and (rows * 32) % k == 0 and rows * 32 // k in (2, 4, 8):
        bits = rows * 32 // k
        detection.evidence.append(f"qweight {list(tensors['qweight'].shape)} is packed along K: GPTQ, {bits}-bit")
        return "gptq", bits, group_size
    detection.evidence.append(f"qweight {list(tensors['qweight'].shape)} fits neither AWQ nor GPTQ for {n}x{k}")
    return None


def _gptq_from_data(sample, bits: int, group_size: int, reader: TensorReader, detection: Detection) -> GPTQ | None:
    words = [reader.read(tensors["qzeros"]) for tensors, _, _ in sample if "qzeros" in tensors]
    if not words:
        detection.evidence.append("no qzeros: symmetric")
        return GPTQ(bits, group_size, sym=True)
    filler = {int(value) & 0xFFFFFFFF for w in words for value in torch.unique(w).tolist()}
    v1_filler = packing.repeated_word((1 << (bits - 1)) - 1, bits)
    v2_filler = packing.repeated_word(1 << (bits - 1), bits)
    if filler == {v1_filler}:
        detection.evidence.append(f"every qzeros word is 0x{v1_filler:08X}: symmetric, v1 filler")
        return GPTQ(bits, group_size, sym=True, checkpoint_format="gptq")
    if filler == {v2_filler}:
        detection.evidence.append(f"every qzeros word is 0x{v2_filler:08X}: symmetric, v2 filler")
        return GPTQ(bits, group_size, sym=True, checkpoint_format="gptq_v2")
    medians = {}
    for version in ("gptq", "gptq_v2"):
        fmt = GPTQ(bits, group_size, sym=False, checkpoint_format=version)
        offsets = []
        for tensors, _, _ in sample:
            weight = fmt.decode({suffix: reader.read(entry) for suffix, entry in tensors.items() if suffix != "g_idx"})
            g = effective_group_size(weight.in_features, group_size)
            mean_codes = weight.codes.float().reshape(weight.out_features, -1, g).mean(dim=-1)
            offsets.append((mean_codes - weight.zeros.float()).flatten())
        medians[version] = float(torch.cat(offsets).median())
    detection.evidence.append(
        f"asymmetric; median over groups of (mean code − zero): v1 reading {medians['gptq']:+.2f}, "
        f"v2 reading {medians['gptq_v2']:+.2f}")
    v1, v2 = abs(medians["gptq"]), abs(medians["gptq_v2"])
    if abs(v1 - v2) < _MARGIN:
        detection.evidence.append("v1 and v2 readings are too close to tell apart")
        return None
    return GPTQ(bits, group_size, sym=False, checkpoint_format="gptq" if v1 < v2 else "gptq_v2")


def _check_act_order(sample, reader: TensorReader, detection: Detection) -> None:
    for tensors, _, in_features in sample:
        if "g_idx" not in tensors:
            continue
        g_idx = reader.read(tensors["g_idx"]).to(torch.int64)
        groups = int(g_idx.max()) + 1 if g_idx.numel() else 1
        if not torch.equal(g_idx, torch.arange(in_features) // max(1, in_features // groups)):
            detection.act_order = (
                f"{tensors['g_idx'].file}: {tensors['g_idx'].name} is not k // group_size: the checkpoint uses "
                f"act-order (desc_act), which moeconv does not convert yet")
            return


def _compare(configured: SourceFormat, detection: Detection) -> None:
    found = detection.detected
    if found is None:
        return
    said, seen = configured.describe(), found.describe()
    if said["method"] != seen["method"]:
        detection.disagreements.append(
            f"config says {said['method']} but the tensors are packed like {seen['method']} ({detection.evidence[0]})")
        return
    for key in ("bits", "group_size", "sym", "zero_point", "checkpoint_format"):
        if key in said and said[key] != seen[key]:
            detection.disagreements.append(
                f"config says {key}={_show(key, said[key])} but the tensors look like {key}={_show(key, seen[key])}")


def _show(key: str, value: Any) -> str:
    if key == "checkpoint_format":
        return {"gptq": "gptq (v1)", "gptq_v2": "gptq_v2"}[value]
    return str(value)


def sample_linears(layers_grouped: dict, out_in: dict[str, tuple[int, int]]):
    """Routed-expert linears in a spread order (first expert of each layer first), for `detect`."""
    modules = list(layers_grouped)
    experts = max((len(layers_grouped[m]) for m in modules), default=0)
    for e in range(experts):
        for module in modules:
            expert = layers_grouped[module].get(e, {})
            for projection, tensors in expert.items():
                if projection in out_in:
                    yield tensors, *out_in[projection]


