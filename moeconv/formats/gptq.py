"""GPTQ checkpoints (quant_method "gptq"; AutoGPTQ, GPTQModel, optimum, AutoRound).

qweight int32 (K·b/32, N) packed along K; qzeros int32 (K/g, N·b/32) packed along N; scales (K/g, N);
g_idx (K,). `checkpoint_format` "gptq" (v1) stores zero − 1, "gptq_v2" stores true zeros.

v1 cannot store a zero of 0 cleanly and producers disagree on what they write. GPTQModel makes v1
by subtracting 0x11111111 (4-bit) from each packed word, borrows crossing slots; AutoGPTQ ORs a
sign-extended −1 into the word. We decode v1 as the exact inverse of GPTQModel's arithmetic (add the
repeated-ones word back, modulo 2^32), which is right for every GPTQModel checkpoint and for every
group whose zero is not 0 in AutoGPTQ ones; groups whose stored slot is all ones (2^b − 1) are the
ones to look at, and `suspicious_zero_slots` counts them for the reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from moeconv import act_order, packing
from moeconv.canonical import QuantizedWeight
from moeconv.errors import MoeconvError
from moeconv.packed import PackedWeight, transposed
from moeconv.spec import TensorSpec
from moeconv.formats.base import (
    Detection,
    FormatDefaults,
    Linear,
    Read,
    SourceFormat,
    check_bits,
    check_headers,
    checked_group_size,
    config_bool,
    config_int,
    effective_group_size,
    group_size_from_shapes,
    groups_of,
    static_groups_only,
)

V1, V2 = "gptq", "gptq_v2"


@dataclass(frozen=True)
class GPTQ(FormatDefaults):
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    checkpoint_format: str = V1
    method: str = "gptq"
    activation_bits = 16  # class attribute, not a field: GPTQ is weight-only

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> GPTQ:
        bits = config_int(config, "bits", 4, where)
        group_size = config_int(config, "group_size", 128, where)
        check_bits(bits, (2, 4, 8), "GPTQ", where)
        group_size = checked_group_size(group_size, where)
        checkpoint_format = config.get("checkpoint_format", V1)
        if not isinstance(checkpoint_format, str):
            raise MoeconvError(f"{where}: checkpoint_format must be a string, not {checkpoint_format!r}")
        checkpoint_format = checkpoint_format.lower()
        if checkpoint_format not in (V1, V2):
            raise MoeconvError(
                f"{where}: GPTQ checkpoint_format {checkpoint_format!r} is not supported (expected 'gptq' or 'gptq_v2')"
            )
        return cls(
            bits=bits,
            group_size=group_size,
            sym=config_bool(config, "sym", True, where),
            checkpoint_format=checkpoint_format,
        )

    @property
    def symmetric(self) -> bool:
        return self.sym

    def suffixes(self) -> tuple[str, ...]:
        return ("qweight", "scales") if self.sym else ("qweight", "qzeros", "scales")

    def optional_suffixes(self) -> tuple[str, ...]:
        return ("g_idx", "qzeros") if self.sym else ("g_idx",)

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        packed_rows, out_features = shapes["qweight"]
        return out_features, packed_rows * 32 // self.bits

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        per_word = 32 // self.bits
        groups = groups_of(in_features, self.group_size)
        return {
            "qweight": TensorSpec("qweight", (in_features // per_word, out_features), "I32"),
            "qzeros": TensorSpec("qzeros", (groups, out_features // per_word), "I32"),
            "scales": TensorSpec("scales", (groups, out_features), None),
            "g_idx": TensorSpec("g_idx", (in_features,), "I32"),
        }

    def zero_offset_word(self) -> int:
        return packing.repeated_word(1, self.bits) if self.checkpoint_format == V1 else 0

    def decode(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight:
        """Static (or relabelled) groups only: an act-order g_idx is refused (act_order.py)."""
        return static_groups_only(self.decode_ordered(stored))

    def decode_ordered(self, stored: Mapping[str, np.ndarray]) -> tuple[QuantizedWeight, np.ndarray | None]:
        """The canonical form, and for an act-order g_idx (every group g channels wide, in any order)
        the input permutation P under which it holds: the source linear is `W[:, P]` = the returned
        weight. P is None for static (or relabelled) groups."""
        # Transpose the packed words (b/8 of the bytes of the codes), then unpack along the rows.
        codes = packing.unpack_array(stored["qweight"].T, self.bits, axis=1)
        in_features = codes.shape[1]
        group_size = effective_group_size(in_features, self.group_size)
        scales = np.ascontiguousarray(stored["scales"].T)
        zeros = None
        if not self.sym:
            true_words = packing.add_to_word_array(stored["qzeros"], self.zero_offset_word())
            zeros = np.ascontiguousarray(packing.unpack_array(true_words, self.bits, axis=1).T)
        codes, zeros, scales, inputs = act_order.static_form(codes, zeros, scales, stored.get("g_idx"), group_size)
        return QuantizedWeight(codes=codes, zeros=zeros, scales=scales, bits=self.bits, group_size=group_size), inputs

    packs = True

    def to_packed(self, stored: Mapping[str, np.ndarray]) -> PackedWeight | None:
        """qweight's (K·b/32, N) words, packed along K, transposed; the TRUE zero words (v1's repeated-ones
        word added back), packed along N, transposed. None for a non-trivial g_idx (the canonical route
        folds act-order or refuses it)."""
        qweight = stored["qweight"]
        in_features = qweight.shape[0] * 32 // self.bits
        if not self.static_groups(stored.get("g_idx"), in_features):
            return None
        zero_words = None
        if not self.sym:
            zero_words = transposed(packing.add_to_word_array(stored["qzeros"], self.zero_offset_word()))
        return PackedWeight(words=transposed(qweight), zero_words=zero_words, scales=transposed(stored["scales"]),
                            bits=self.bits, group_size=effective_group_size(in_features, self.group_size))

    @staticmethod
    def configures_act_order(config: Mapping[str, Any]) -> bool:
        return config.get("desc_act") is True

    def static_groups(self, g_idx: np.ndarray | None, in_features: int) -> bool:
        """The stored g_idx (if any) is the trivial k // g: the stored words mean what they say."""
        group_size = effective_group_size(in_features, self.group_size)
        return act_order.group_order(g_idx, group_size).kind == act_order.STATIC

    def encode(self, weight: QuantizedWeight) -> dict[str, np.ndarray]:
        """Writes what GPTQModel writes: v1 zeros as true-zero words minus the repeated-ones word."""
        true_words = packing.pack_array(transposed(weight.effective_zeros()), self.bits, axis=1, container=np.int32)
        return {
            "qweight": transposed(packing.pack_array(weight.codes, self.bits, axis=1, container=np.int32)),
            "qzeros": packing.add_to_word_array(true_words, -self.zero_offset_word()),
            "scales": transposed(weight.scales),
            "g_idx": np.arange(weight.in_features, dtype=np.int32) // np.int32(weight.group_size),
        }

    @property
    def has_ambiguous_zeros(self) -> bool:
        """v1 asymmetric: a true zero of 0 has no clean v1 encoding (see module doc)."""
        return not self.sym and self.checkpoint_format == V1

    def suspicious_zero_slots(self, qzeros: np.ndarray) -> int:
        """v1 asymmetric only: stored zero slots that are all ones, i.e. true zero 0 (see module doc)."""
        if not self.has_ambiguous_zeros:
            return 0
        return int((packing.unpack_array(qzeros, self.bits, axis=1) == (1 << self.bits) - 1).sum())

    vector_suffixes = ("g_idx",)
    group_index_suffix = "g_idx"  # act-order's group of each input channel (act_order.py)
    audited_suffixes = ("qzeros",)

    def audit(self, tensors: Mapping[str, np.ndarray]) -> dict[str, int]:
        return {"suspicious_zero_slots": self.suspicious_zero_slots(tensors["qzeros"])} if "qzeros" in tensors else {}

    def written_suffixes(self) -> tuple[str, ...]:
        """GPTQ producers always write g_idx, and qzeros (filler words when symmetric)."""
        return ("qweight", "qzeros", "scales", "g_idx")

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """qweight (K·b/32, N) for one b in 2, 4, 8."""
        return bool(linears) and len({_packed_bits(linear) for linear in linears} - {None}) == 1 and all(
            _packed_bits(linear) for linear in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> GPTQ | None:
        bits = _packed_bits(linears[0])
        detection.evidence.append(f"qweight {list(linears[0][0]['qweight'].shape)} is packed along K: GPTQ, {bits}-bit")
        group_size = group_size_from_shapes([(tensors["scales"], 0, k) for tensors, _, k in linears],
                                            configured.group_size, detection)
        if group_size is None:
            return None
        check_headers(linears[:SAMPLE_LINEARS], GPTQ(bits, group_size))  # the linears read below
        found = _gptq_from_data(linears, bits, group_size, configured, read, detection)
        _check_act_order(linears[:SAMPLE_LINEARS], read, detection)
        return found

    def describe(self) -> dict[str, Any]:
        return {
            "method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "checkpoint_format": self.checkpoint_format,
        }

    def quantization_config(self) -> dict[str, Any]:
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": False,
            "checkpoint_format": self.checkpoint_format,
            "format": self.checkpoint_format,
        }


def _packed_bits(linear: Linear) -> int | None:
    tensors, n, k = linear
    if not {"qweight", "scales"} <= set(tensors) or len(tensors["qweight"].shape) != 2:
        return None
    rows, columns = tensors["qweight"].shape
    bits = rows * 32 // k if k else 0
    return bits if columns == n and rows * 32 == bits * k and bits in (2, 4, 8) else None


# The v1/v2 statistic (see detect.py's module doc and docs/GPTQ_ZERO_FORMAT.md for what it was measured
# on): expert linears whose tensors may be read; reading stops once the statistic is precise
# (STANDARD_ERROR) and never reads more than SAMPLE_BYTES of qweight.
SAMPLE_LINEARS = 96
SAMPLE_BYTES = 256 * 1024**2
STANDARD_ERROR = 0.05
TRIM = 0.1  # share of groups dropped at each end before averaging (all-positive or all-negative groups)
CENTRED = 0.3  # |statistic| below this: the reading puts codes on the zero points
MIDPOINT = 0.5  # half-way between the two readings: the decision must clear it by 3 standard errors
CONTRADICTING = 0.1  # most share of the sampled linears that may, each on its own, clearly favour the other reading


def _gptq_from_data(linears: list[Linear], bits: int, group_size: int, configured: SourceFormat,
                    read: Read, detection: Detection) -> GPTQ:
    with_zeros = [linear for linear in linears[:SAMPLE_LINEARS] if "qzeros" in linear[0]]
    if not with_zeros:
        detection.evidence.append("no qzeros: symmetric")
        return GPTQ(bits, group_size, sym=True, checkpoint_format=_configured_version(configured))
    words: set[int] = set()
    for tensors, _, _ in with_zeros:
        words |= {int(value) & 0xFFFFFFFF for value in np.unique(read(tensors["qzeros"])).tolist()}
        if len(words) > 1:
            break
    v1_filler = packing.repeated_word((1 << (bits - 1)) - 1, bits)
    v2_filler = packing.repeated_word(1 << (bits - 1), bits)
    if words == {v1_filler}:
        detection.evidence.append(f"every qzeros word is 0x{v1_filler:08X}: symmetric, v1 filler")
        return GPTQ(bits, group_size, sym=True, checkpoint_format=V1)
    if words == {v2_filler}:
        detection.evidence.append(f"every qzeros word is 0x{v2_filler:08X}: symmetric, v2 filler")
        return GPTQ(bits, group_size, sym=True, checkpoint_format=V2)
    detection.evidence.append("qzeros words differ from one another: asymmetric zero points")
    version = _gptq_version(with_zeros, bits, group_size, _configured_version(configured), read, detection)
    return GPTQ(bits, group_size, sym=False, checkpoint_format=version or _configured_version(configured))


def _configured_version(configured: SourceFormat) -> str:
    return configured.checkpoint_format if isinstance(configured, GPTQ) else V1


def _gptq_version(linears: list[Linear], bits: int, group_size: int, label: str, read: Read,
                  detection: Detection) -> str | None:
    """"gptq" or "gptq_v2" from where the codes centre, or None (undecided, recorded) when unclear.

    Per group, (mean code − zero) · scale is the group's mean weight: near 0 under the right reading
    for weights centred on zero, one code off under the wrong one. Nothing else in GPTQ's output tells
    the two apart (both readings are valid min/max quantizations of weights one step apart), so a
    checkpoint whose weights are not centred on zero, in every linear alike, is left undecided.
    Computed with numpy on the words as read (the parent plans without torch): the codes and zero
    points as `decode` gives them for both readings (qweight unpacked along K, then transposed; the
    zero words with v1's repeated-ones word added back or not), the group means exact (integer sums)."""
    offsets, per_linear, read_bytes = [], [], 0
    for tensors, _, _ in linears:
        qweight, qzeros = read(tensors["qweight"]), read(tensors["qzeros"])
        codes = packing.unpack_array(qweight, bits, axis=0).T  # (N, K)
        v1_zeros, v2_zeros = (packing.unpack_array(packing.add_to_word_array(qzeros, offset), bits, axis=1).T
                              for offset in (packing.repeated_word(1, bits), 0))  # (N, G) each
        out_features, in_features = codes.shape
        g = effective_group_size(in_features, group_size)
        sums = codes.reshape(out_features, -1, g).sum(axis=-1, dtype=np.int64)
        mean_codes = sums.astype(np.float32) / np.float32(g)
        # Only groups whose two readings are one code apart and inside the range: a zero at an edge
        # (all-positive or all-negative groups) wraps or borrows under one reading, which would move
        # those groups from one tail to the other and bias a trimmed statistic.
        interior = ((v1_zeros.astype(np.int32) - v2_zeros.astype(np.int32) == 1) & (v2_zeros > 0)
                    & (v1_zeros < (1 << bits) - 1))
        offsets.append((mean_codes - v2_zeros.astype(np.float32))[interior])
        if len(offsets[-1]) > 1:
            per_linear.append(_trimmed_mean(offsets[-1]))
        read_bytes += qweight.size * 4
        if _trimmed_mean(np.concatenate(offsets))[1] < STANDARD_ERROR or read_bytes > SAMPLE_BYTES:
            break
    v2, error = _trimmed_mean(np.concatenate(offsets))
    v1 = v2 - 1.0  # on these groups the v1 reading's zero point is the stored one plus one
    groups = sum(len(o) for o in offsets)
    numbers = (f"trimmed mean over {groups} interior groups of {len(per_linear)} linears of (mean code − zero): "
               f"v1 reading {v1:+.2f}, v2 reading {v2:+.2f} (± {error:.2f})")
    detection.evidence.append(numbers)
    for version, centred, shift in ((V1, v1, 1.0), (V2, v2, 0.0)):
        # A linear contradicts this reading when, on its own, it sits past the midpoint by 3 of its errors.
        against = sum(abs(m - shift) - MIDPOINT > 3 * e for m, e in per_linear) / max(1, len(per_linear))
        if abs(centred) < CENTRED and abs(centred) + 3 * error < MIDPOINT and against <= CONTRADICTING:
            detection.evidence.append(f"{against:.0%} of the linears, each on its own, contradict the {version} reading")
            return version
    detection.undecided.append(
        f"the data cannot tell GPTQ v1 zero points (stored zero − 1) from v2 (true zeros): {numbers}; the right "
        f"reading is near 0 in every linear and the wrong one near ±1, and neither is here (docs/GPTQ_ZERO_FORMAT.md)")
    detection.advice.append(f"pass --gptq-zero-format v1 or v2 if you know which the producer wrote, or "
                            f"--trust-config to follow the config's {_show_version(label)}")
    return None


def _show_version(version: str) -> str:
    return "gptq (v1)" if version == V1 else "gptq_v2"


def _trimmed_mean(values: np.ndarray) -> tuple[float, float]:
    """(mean of the central 1 − 2·TRIM share, its standard error from the sample standard deviation);
    float32 values, summed in float64."""
    if len(values) < 2:
        return float("nan"), float("inf")
    ordered = np.sort(values)
    cut = int(len(ordered) * TRIM)
    central = ordered[cut:len(ordered) - cut] if len(ordered) > 2 * cut else ordered
    spread = float(central.std(dtype=np.float64, ddof=1)) if len(central) > 1 else float("inf")
    return float(central.mean(dtype=np.float64)), spread / max(1, len(central)) ** 0.5 * 1.2


def _check_act_order(sample: list[Linear], read: Read, detection: Detection) -> None:
    """Records the first sampled linear whose g_idx is not k // g: the plan then reads every g_idx."""
    for tensors, _, in_features in sample:
        if "g_idx" not in tensors:
            continue
        g_idx = read(tensors["g_idx"])
        groups = int(g_idx.max()) + 1 if g_idx.size else 1  # g from the data: the config's may be wrong
        if act_order.group_order(g_idx, max(1, in_features // groups)).kind != act_order.STATIC:
            detection.act_order = (f"{tensors['g_idx'].file}: {tensors['g_idx'].name} is not k // group_size: "
                                   f"act-order (desc_act)")
            return
