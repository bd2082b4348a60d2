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
  statistic is small; a reading is decided only when its statistic is near 0 and the midpoint
  between the readings is three standard errors away, otherwise the detection says "undecided" with the numbers.
- act-order from g_idx: anything but k // g is act-order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import torch

from moeconv import packing
from moeconv.canonical import effective_group_size, is_channelwise
from moeconv.checkpoint.reader import TensorEntry, TensorReader
from moeconv.formats import AWQ, GPTQ, CompressedTensors, SourceFormat

# Expert linears whose tensors may be read for the v1/v2 statistic; reading stops earlier once the
# statistic is precise (STANDARD_ERROR), and never reads more than SAMPLE_BYTES of qweight.
SAMPLE_LINEARS = 96
SAMPLE_BYTES = 256 * 1024**2
STANDARD_ERROR = 0.05
TRIM = 0.1  # share of groups dropped at each end before averaging (all-positive or all-negative groups)
CENTRED = 0.3  # |statistic| below this: the reading puts codes on the zero points
MIDPOINT = 0.5  # half-way between the two readings: the decision must clear it by 3 standard errors


@dataclass
class Detection:
    """The format the data shows (None: could not tell), every disagreement with the config, and what
    the data could not decide (then the config's value stands)."""

    detected: SourceFormat | None
    evidence: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)
    act_order: str | None = None  # why the checkpoint is act-order, if it is

    def to_json(self) -> dict[str, Any]:
        return {"detected": None if self.detected is None else self.detected.describe(),
                "evidence": self.evidence, "disagreements": self.disagreements, "undecided": self.undecided,
                "act_order": self.act_order}


Linear = tuple[dict[str, TensorEntry], int, int]  # tensors by suffix, out_features, in_features


def detect(linears: Iterable[Linear], configured: SourceFormat) -> Detection:
    """`linears`: routed-expert linears as the config sizes them, in a spread order (sample_linears)."""
    linears = list(linears)
    detection = Detection(None)
    misshapen = next((entry for tensors, _, _ in linears for suffix, entry in tensors.items()
                      if len(entry.shape) != (1 if suffix in ("g_idx", "weight_shape") else 2)), None)
    if misshapen is not None:  # no reading from data before the header shapes make sense (the plan says why)
        detection.evidence.append(f"{misshapen.name} has shape {list(misshapen.shape)}")
        return detection
    if linears and all({"weight_packed", "weight_scale"} <= set(tensors) for tensors, _, _ in linears):
        detection.detected = _pack_quantized_from_shapes(linears, configured, detection)
        _compare(configured, detection)
        return detection
    if not linears or not all({"qweight", "scales"} <= set(tensors) for tensors, _, _ in linears):
        return detection  # not a format this module knows how to read from data
    packed = _packing_from_shapes(linears, configured, detection)
    if packed is None:
        return detection
    method, bits, group_size = packed
    with TensorReader() as reader:
        if method == "awq":
            detection.detected = AWQ(bits=bits, group_size=group_size, zero_point="qzeros" in linears[0][0])
        else:
            detection.detected = _gptq_from_data(linears, bits, group_size, configured, reader, detection)
        _check_act_order(linears[:SAMPLE_LINEARS], reader, detection)
    _compare(configured, detection)
    return detection


def _packing_from_shapes(linears: list[Linear], configured: SourceFormat,
                         detection: Detection) -> tuple[str, int, int] | None:
    methods = set()
    for tensors, n, k in linears:
        rows, columns = tensors["qweight"].shape
        if (rows, columns) == (k, n // 8):
            methods.add(("awq", 4))
        elif columns == n and (rows * 32) % k == 0 and rows * 32 // k in (2, 4, 8):
            methods.add(("gptq", rows * 32 // k))
        else:
            detection.evidence.append(f"{tensors['qweight'].name} {list(tensors['qweight'].shape)} fits neither "
                                      f"AWQ nor GPTQ packing for a {n}x{k} linear")
            return None
    if len(methods) > 1:
        detection.evidence.append(f"expert linears are packed in different ways: {sorted(methods)}")
        return None
    (method, bits), = methods
    shape = list(linears[0][0]["qweight"].shape)
    detection.evidence.append(f"qweight {shape} is packed along {'N: AWQ' if method == 'awq' else 'K: GPTQ'}, "
                              f"{bits}-bit")
    group_size = _group_size_from_shapes([(tensors["scales"], 0, k) for tensors, _, k in linears],
                                         configured.group_size, detection)
    return None if group_size is None else (method, bits, group_size)


def _pack_quantized_from_shapes(linears: list[Linear], configured: SourceFormat,
                                detection: Detection) -> CompressedTensors | None:
    """compressed-tensors pack-quantized: bits from weight_packed's words per row, the group size from
    weight_scale's columns, symmetry from whether zero points are stored."""
    widths = {tensors["weight_packed"].shape[1] * 32 // k for tensors, _, k in linears}
    if len(widths) != 1 or not widths <= {4, 8}:
        detection.evidence.append(f"weight_packed rows hold {sorted(widths)} bits per weight")
        return None
    (bits,) = widths
    detection.evidence.append(f"weight_packed {list(linears[0][0]['weight_packed'].shape)}: {bits}-bit")
    group_size = _group_size_from_shapes([(tensors["weight_scale"], 1, k) for tensors, _, k in linears],
                                         configured.group_size, detection)
    if group_size is None:
        return None
    stored = {"weight_zero_point" in tensors for tensors, _, _ in linears}
    if len(stored) != 1:
        detection.evidence.append("some expert linears store zero points and others do not")
        return None
    symmetric = not stored.pop()
    detection.evidence.append("no weight_zero_point: symmetric" if symmetric else "weight_zero_point stored: asymmetric")
    base = configured if isinstance(configured, CompressedTensors) else CompressedTensors()
    return replace(base, bits=bits, group_size=group_size, symmetric=symmetric)


def _group_size_from_shapes(linears: list[Linear], configured: int, detection: Detection) -> int | None:
    """The group size every linear's scales fit, preferring the configured one when it fits.
    `linears`: (scales entry, the dim that counts groups, K)."""
    exact: dict[int, str] = {}  # g -> a linear that says so (G > 1 groups)
    one_group_k = 0  # the widest K among linears with a single group: they say only g >= K
    for scales, dim, k in linears:
        groups = scales.shape[dim]
        if groups == 1:
            one_group_k = max(one_group_k, k)
        elif groups > 1 and k % groups == 0:
            exact.setdefault(k // groups, scales.name)
        else:
            detection.evidence.append(f"{scales.name} has {groups} groups, which do not divide K = {k}")
            return None
    if len(exact) > 1:
        detection.evidence.append("the scales imply different group sizes: " +
                                  ", ".join(f"{g} ({name})" for g, name in sorted(exact.items())))
        return None
    if exact:
        (g, name), = exact.items()
        if one_group_k > g:
            detection.evidence.append(f"{name} implies group size {g}, but a linear with K = {one_group_k} "
                                      f"has a single group")
            return None
        detection.evidence.append(f"scales give group size {g}" +
                                  (f" (linears with K = {one_group_k} hold one group)" if one_group_k else ""))
        return g
    if is_channelwise(configured) or configured >= one_group_k:
        detection.evidence.append(f"every linear has a single group: channel-wise or a group size >= "
                                  f"{one_group_k}; the config's {configured} fits")
        return configured
    detection.evidence.append("every linear has a single group: channel-wise")
    return -1


def _gptq_from_data(linears: list[Linear], bits: int, group_size: int, configured: SourceFormat,
                    reader: TensorReader, detection: Detection) -> GPTQ:
    with_zeros = [linear for linear in linears[:SAMPLE_LINEARS] if "qzeros" in linear[0]]
    if not with_zeros:
        detection.evidence.append("no qzeros: symmetric")
        return GPTQ(bits, group_size, sym=True, checkpoint_format=_configured_version(configured))
    words: set[int] = set()
    for tensors, _, _ in with_zeros:
        words |= {int(value) & 0xFFFFFFFF for value in torch.unique(reader.read(tensors["qzeros"])).tolist()}
        if len(words) > 1:
            break
    v1_filler = packing.repeated_word((1 << (bits - 1)) - 1, bits)
    v2_filler = packing.repeated_word(1 << (bits - 1), bits)
    if words == {v1_filler}:
        detection.evidence.append(f"every qzeros word is 0x{v1_filler:08X}: symmetric, v1 filler")
        return GPTQ(bits, group_size, sym=True, checkpoint_format="gptq")
    if words == {v2_filler}:
        detection.evidence.append(f"every qzeros word is 0x{v2_filler:08X}: symmetric, v2 filler")
        return GPTQ(bits, group_size, sym=True, checkpoint_format="gptq_v2")
    detection.evidence.append("qzeros words differ from one another: asymmetric zero points")
    version = _gptq_version(with_zeros, bits, group_size, reader, detection)
    return GPTQ(bits, group_size, sym=False, checkpoint_format=version or _configured_version(configured))


def _configured_version(configured: SourceFormat) -> str:
    return configured.checkpoint_format if isinstance(configured, GPTQ) else "gptq"


def _gptq_version(linears: list[Linear], bits: int, group_size: int, reader: TensorReader,
                  detection: Detection) -> str | None:
    """"gptq" or "gptq_v2" from where the codes centre, or None (undecided, recorded) when unclear."""
    readings = [GPTQ(bits, group_size, sym=False, checkpoint_format=version) for version in ("gptq", "gptq_v2")]
    offsets, read_bytes = [], 0
    for tensors, _, _ in linears:
        v1, v2 = (reading.decode({suffix: reader.read(entry) for suffix, entry in tensors.items()
                                  if suffix != "g_idx"}) for reading in readings)
        g = effective_group_size(v2.in_features, group_size)
        mean_codes = v2.codes.float().reshape(v2.out_features, -1, g).mean(dim=-1)
        # Only groups whose two readings are one code apart and inside the range: a zero at an edge
        # (all-positive or all-negative groups) wraps or borrows under one reading, which would move
        # those groups from one tail to the other and bias a trimmed statistic.
        interior = (v1.zeros.int() - v2.zeros.int() == 1) & (v2.zeros > 0) & (v1.zeros < (1 << bits) - 1)
        offsets.append((mean_codes - v2.zeros.float())[interior])
        read_bytes += tensors["qweight"].nbytes
        if _trimmed_mean(torch.cat(offsets))[1] < STANDARD_ERROR or read_bytes > SAMPLE_BYTES:
            break
    v2, error = _trimmed_mean(torch.cat(offsets))
    v1 = v2 - 1.0  # on these groups the v1 reading's zero point is the stored one plus one
    groups = sum(len(o) for o in offsets)
    numbers = (f"trimmed mean over {groups} interior groups of (mean code − zero): v1 reading {v1:+.2f}, "
               f"v2 reading {v2:+.2f} (± {error:.2f})")
    detection.evidence.append(numbers)
    for version, centred in (("gptq", v1), ("gptq_v2", v2)):
        if abs(centred) < CENTRED and abs(centred) + 3 * error < MIDPOINT:
            return version
    detection.undecided.append(f"checkpoint_format: the data cannot tell v1 from v2 ({numbers}; the right "
                               f"reading is near 0 and the wrong one near ±1)")
    return None


def _trimmed_mean(values: torch.Tensor) -> tuple[float, float]:
    """(mean of the central 1 − 2·TRIM share, its standard error)."""
    if len(values) < 2:
        return float("nan"), float("inf")
    ordered = values.sort().values
    cut = int(len(ordered) * TRIM)
    central = ordered[cut:len(ordered) - cut] if len(ordered) > 2 * cut else ordered
    spread = float(central.std()) if len(central) > 1 else float("inf")
    return float(central.mean()), spread / max(1, len(central)) ** 0.5 * 1.2


def _check_act_order(sample: list[Linear], reader: TensorReader, detection: Detection) -> None:
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
