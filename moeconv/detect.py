"""What the tensors say the format is, cross-checked against what the config says.

The config says what a checkpoint should be; the tensors say what it is. Engines trust the config,
and a GPTQ checkpoint whose config says v1 but whose zero points are v2 (or the reverse), or that
says symmetric over asymmetric zero points, loads without complaint and generates garbage ("!!!!").
moeconv reads the header shapes of every routed-expert linear and a sample of their tensors, infers
the format from them, and stops on any disagreement with an explanation, unless the user says which
side to trust.

Evidence used:
- packing from shapes: AWQ qweight is (K, N/8), GPTQ's is (K·b/32, N), for K and N from config.json;
  the bit width follows from the GPTQ rows. The group size from the scales' rows of EVERY projection
  kind: a linear with G > 1 groups says g = K / G; one with a single group only says g ≥ K (or
  channel-wise), which is no evidence against a configured g ≥ K. A contradiction is called only
  when no group size fits every linear.
- symmetric vs asymmetric, from the zero points: a symmetric GPTQ checkpoint stores one constant
  filler word in every qzeros slot, 2^(b−1) − 1 in v1 (0x77777777 for 4-bit) and 2^(b−1) in v2
  (0x88888888); asymmetric data does not. No qzeros at all is symmetric.
- GPTQ v1 vs v2 for asymmetric zero points: GPTQ's min/max quantizer sets zero = round(−min/scale)
  and code = round(w/scale) + zero, so for weights that average to about zero a group's mean code
  sits on its TRUE zero point. The two readings of the same words differ by one code per group
  (v1 adds one back; only the borrows of v1's word arithmetic differ), so the trimmed mean over groups of (mean code − zero) is near 0 for the
  right reading and near ±1 for the wrong one. Linears are read until the standard error of that
  statistic is small; a reading is decided only when its statistic is near 0, the midpoint between
  the readings is three standard errors away, and no more than a tenth of the linears on their own
  clearly favour the other reading; otherwise the detection says "undecided" with the numbers, and
  the plan refuses to convert until the user decides. docs/GPTQ_ZERO_FORMAT.md has the measurements
  on real GPTQ output (error feedback and calibration included).
- act-order from g_idx: anything but k // g is act-order.

Each format module carries its own part (`claims` the packing from header shapes, `from_data` the
parameters); this module samples the linears, asks the registered formats, and compares.
"""

from __future__ import annotations

from typing import Any, Iterable

from moeconv.checkpoint.reader import TensorReader
from moeconv.formats import REGISTRY, SourceFormat
from moeconv.formats.base import Detection, Linear

__all__ = ["Detection", "detect", "sample_linears"]


def detect(linears: Iterable[Linear], configured: SourceFormat) -> Detection:
    """`linears`: routed-expert linears as the config sizes them, in a spread order (sample_linears)."""
    linears = list(linears)
    detection = Detection(None)
    vectors = {suffix for cls in REGISTRY.values() for suffix in cls.vector_suffixes}
    misshapen = next((entry for tensors, _, _ in linears for suffix, entry in tensors.items()
                      if len(entry.shape) not in ((0, 1) if suffix in vectors else (2,))), None)
    if misshapen is not None:  # no reading from data before the header shapes make sense (the plan says why)
        detection.evidence.append(f"{misshapen.name} has shape {list(misshapen.shape)}")
        return detection
    claimed = [cls for cls in REGISTRY.values() if cls.claims(linears)]
    if not claimed:
        if linears:
            tensors, n, k = linears[0]
            shapes = ", ".join(f"{entry.name.rsplit('.', 1)[-1]} {entry.dtype}{list(entry.shape)}"
                               for entry in tensors.values())
            if _headers_fit(configured, linears):  # e.g. int-quantized W8A8: int8 weights, one scale a channel
                described = configured.describe()
                scheme = " ".join(str(described[key]) for key in ("method", "format", "scheme") if key in described)
                detection.evidence.append(f"{shapes} for a {n}x{k} linear: the headers are what the config's "
                                          f"{scheme} says (unpacked weights: no packing or zero points in the data "
                                          f"to cross-check)")
            else:
                detection.evidence.append(f"the expert linears (e.g. {shapes} for a {n}x{k} linear) are not all packed "
                                          f"one way moeconv reads from data ({', '.join(REGISTRY)})")
        return detection
    with TensorReader() as reader:
        detection.detected = claimed[0].from_data(linears, configured, reader.read_array, detection)
    _compare(configured, detection)
    return detection


def _headers_fit(configured: SourceFormat, linears: list) -> bool:
    """Every sampled linear's tensors have the shapes and dtypes the configured format expects."""
    for tensors, n, k in linears:
        expected = configured.expected(n, k)
        for suffix, entry in tensors.items():
            want = expected.get(suffix)
            if want is None or tuple(entry.shape) != tuple(want.shape) or (want.dtype and entry.dtype != want.dtype):
                return False
    return True


def _compare(configured: SourceFormat, detection: Detection) -> None:
    found = detection.detected
    if found is None:
        return
    said, seen = configured.describe(), found.describe()
    if said["method"] != seen["method"]:
        detection.disagreements.append(
            f"config says {said['method']} but the tensors are packed like {seen['method']} ({detection.evidence[0]})")
        return
    for key in ("bits", "group_size", "sym", "symmetric", "zero_point", "checkpoint_format"):
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
