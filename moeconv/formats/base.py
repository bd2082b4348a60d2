"""What every source format provides, and the small helpers they share."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from moeconv import act_order
from moeconv.canonical import (  # noqa: F401
    CHANNELWISE, QuantizedWeight, effective_group_size, groups_of, is_channelwise)
from moeconv.errors import MoeconvError
from moeconv.spec import FLOAT_DTYPES, TensorSpec

if TYPE_CHECKING:
    import numpy as np

    from moeconv.float_codes import FloatScheme, FloatWeight
    from moeconv.packed import PackedWeight


class HeaderEntry(Protocol):
    """What detection may know of a stored tensor: its name, header shape, and (for messages) the
    file it is in. Values come only through a `Read`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Any


Linear = tuple[dict[str, HeaderEntry], int, int]  # one expert linear: tensors by suffix, out_features, in_features
Read = Callable[[HeaderEntry], "np.ndarray"]  # a stored tensor's values, for the detections that read data


@dataclass
class Detection:
    """The format the data shows (None: could not tell), every disagreement with the config, and what
    the data could not decide (then the config's value stands)."""

    detected: SourceFormat | None
    evidence: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)  # each one stops a conversion until the user decides
    advice: list[str] = field(default_factory=list)  # one line per undecided question: how to decide it
    decided_by_user: list[str] = field(default_factory=list)  # what the data could not decide, and who chose
    act_order: str | None = None  # why the checkpoint is act-order, if it is

    def to_json(self) -> dict[str, Any]:
        return {"detected": None if self.detected is None else self.detected.describe(),
                "evidence": self.evidence, "disagreements": self.disagreements, "undecided": self.undecided,
                "advice": self.advice, "decided_by_user": self.decided_by_user, "act_order": self.act_order}


class SourceFormat(Protocol):
    """One source format with its parameters. Implementations are frozen dataclasses that inherit
    `FormatDefaults`, which holds the default of every member a format may leave out (marked
    "default:" below); nothing else in moeconv probes a format for a member.

    Besides reading and writing one linear, a format carries what is known about it: how to tell its
    packing from header shapes (`claims`) and its parameters from the data (`from_data`), what its
    audits count, and what a producer of it writes."""

    method: str  # quant_method as configs spell it
    bits: int
    group_size: int  # as configured: -1 means channel-wise
    activation_bits: int  # 16, or 8 for dynamic per-token int8 activations (W8A8)
    vector_suffixes: tuple[str, ...]  # the suffixes whose tensors are 1-D or scalars (g_idx, weight_shape); default: none
    audited_suffixes: tuple[str, ...]  # the small tensors `audit` reads (besides the scales); default: none
    # The tensor that gives each input channel's group (act_order.py), for formats that may store one;
    # the plan reads every one of them when act-order is suspected. Default: None (no such tensor).
    group_index_suffix: str | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> SourceFormat:
        """The format a `quantization_config` describes (`where`: the file, for messages); an invalid
        value raises MoeconvError naming it."""

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """Every linear's header shapes are packed this format's way."""

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> SourceFormat | None:
        """The parameters the claimed linears show (their shapes, and where needed a sample of their
        values), recording the evidence; None (with the reason) when they do not fit together."""

    @staticmethod
    def configures_act_order(config: Mapping[str, Any]) -> bool:
        """The config says the linears use act-order (GPTQ `desc_act`). Default: False."""

    @property
    def symmetric(self) -> bool: ...

    def suffixes(self) -> tuple[str, ...]:
        """Tensor name suffixes every quantized linear must have (`qweight`, `scales`, ...)."""

    def optional_suffixes(self) -> tuple[str, ...]:
        """Suffixes that may be present and are checked or ignored (`g_idx`, symmetric filler zeros)."""

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        """(out_features N, in_features K) of a linear, from its tensors' header shapes."""

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        """Every tensor's spec (named by suffix) for a linear of this size, to validate headers."""

    def decode(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight | FloatWeight:
        """One linear's stored arrays (keyed by suffix; `TensorReader.read_raw`: BF16 as its uint16 bit
        patterns) -> the canonical form (a float-coded format's: `FloatWeight`), in numpy, moving bits only."""

    def decode_ordered(self, stored: Mapping[str, np.ndarray]) -> tuple[QuantizedWeight, np.ndarray | None]:
        """As `decode`, and for an act-order linear the input permutation P under which its groups are
        static (the stored linear is W[:, P]; act_order.py). Default: `decode`, and no permutation."""

    # The format's stored words go into the packed form (`to_packed`), the fast path into every layout that
    # takes it (packed.py). Default: False (every linear takes the canonical route).
    packs: bool

    # The float scheme of a float-coded format (MXFP4, NVFP4: float_codes.py): its `decode` gives the
    # canonical float form (`FloatWeight`), which only a layout that takes float codes writes. Default: None
    # (integer codes: the canonical form).
    float_scheme: FloatScheme | None

    # Why no backend's output of this format's checkpoints is written yet though its experts are read (what blocks
    # it, and what serves the source as it is): `convert` and `auto` refuse with it, `inspect` gives it as every
    # backend's reason. Default: None (the backends decide).
    unconverted: str | None

    def to_packed(self, stored: Mapping[str, np.ndarray]) -> PackedWeight | None:
        """One linear's stored arrays (keyed by suffix) in the packed form, moving bits only; None for a linear
        the canonical route must take (an act-order g_idx). Only where `packs`; byte-identical to `decode`
        then packing (tests/test_packed.py)."""

    def encode(self, weight: QuantizedWeight | FloatWeight) -> dict[str, np.ndarray]:
        """The canonical form -> this format's stored arrays (keyed by suffix; synthetic checkpoints)."""

    def audit(self, tensors: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Counts of values worth a word in the reports (kind -> count), from one linear's stored arrays
        (BF16 widened to float32). Default: nothing to count."""

    def written_suffixes(self) -> tuple[str, ...]:
        """What a producer of this format writes for every linear (synthetic checkpoints). Default:
        the required suffixes."""

    def describe(self) -> dict[str, Any]:
        """Parameters for reports (`inspect`, manifests)."""

    def quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` a producer of this format writes (synthetic checkpoints)."""


class FormatDefaults:
    """The default of every member of `SourceFormat` a format may leave out, declared once: no 1-D
    tensors, no group index, no act-order in the config, no audits of its own, decoding without a
    permutation, and a producer writes the required suffixes."""

    vector_suffixes: tuple[str, ...] = ()
    audited_suffixes: tuple[str, ...] = ()
    group_index_suffix: str | None = None
    packs: bool = False
    float_scheme: FloatScheme | None = None
    unconverted: str | None = None

    def to_packed(self, stored: Mapping[str, np.ndarray]) -> PackedWeight | None:
        raise NotImplementedError(f"{type(self).__name__} has no packed form")

    @staticmethod
    def configures_act_order(config: Mapping[str, Any]) -> bool:
        return False

    def decode_ordered(self, stored: Mapping[str, np.ndarray]) -> tuple[QuantizedWeight, np.ndarray | None]:
        return self.decode(stored), None

    def audit(self, tensors: Mapping[str, np.ndarray]) -> dict[str, int]:
        return {}

    def written_suffixes(self) -> tuple[str, ...]:
        return self.suffixes()


def static_groups_only(decoded: tuple[QuantizedWeight, np.ndarray | None]) -> QuantizedWeight:
    """`decode` of a format whose `decode_ordered` may find an act-order permutation: refused, since only a
    down projection folds one away (act_order.fold) and `decode` reads every other linear."""
    weight, inputs = decoded
    if inputs is not None:
        raise MoeconvError(act_order.describe(act_order.PERMUTED, "linear"))
    return weight


def config_int(config: Mapping[str, Any], key: str, default: int, where: str, *fallbacks: str) -> int:
    """An integer config value (the first of `key`, `fallbacks` present), refusing 4.7, "4" and true:
    a value that changes the meaning of the bytes is never coerced."""
    for name in (key, *fallbacks):
        if name in config and config[name] is not None:
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise MoeconvError(f"{where}: {name} must be an integer, not {value!r}")
            return value
    return default


def config_bool(config: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """A boolean config value; the string "false" is an error, not true."""
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise MoeconvError(f"{where}: {key} must be true or false, not {value!r}")
    return value


def group_size_from_shapes(scales: list[tuple[HeaderEntry, int, int]], configured: int,
                           detection: Detection) -> int | None:
    """The group size every linear's scales fit, preferring the configured one when it fits.
    `scales`: (scales entry, the dim that counts groups, K). A linear with G > 1 groups says g = K / G;
    one with a single group only says g >= K (or channel-wise), which is no evidence against a
    configured g >= K. None (with the evidence) when no group size fits them all."""
    exact: dict[int, str] = {}  # g -> a linear that says so (G > 1 groups)
    one_group_k = 0  # the widest K among linears with a single group: they say only g >= K
    for entry, dim, k in scales:
        groups = entry.shape[dim]
        if groups == 1:
            one_group_k = max(one_group_k, k)
        elif groups > 1 and k % groups == 0:
            exact.setdefault(k // groups, entry.name)
        else:
            detection.evidence.append(f"{entry.name} has {groups} groups, which do not divide K = {k}")
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


def check_header(entry: HeaderEntry, spec: TensorSpec, source_format: SourceFormat) -> None:
    """One stored tensor against what its format declares (`expected`), from the header alone: run before
    any of its bytes are decoded, since words read as floats (or floats as words) decode to nonsense, with
    numpy's warnings or a traceback on the way."""
    dtype_ok = entry.dtype == spec.dtype if spec.dtype else entry.dtype in FLOAT_DTYPES
    if not dtype_ok or tuple(entry.shape) != tuple(spec.shape):
        raise MoeconvError(
            f"{entry.file}: tensor {entry.name} is {entry.dtype}{list(entry.shape)}, expected "
            f"{spec.dtype or 'a float dtype'}{list(spec.shape)} for {source_format.method} "
            f"{source_format.bits}-bit group {source_format.group_size}")


def check_headers(linears: list[Linear], source_format: SourceFormat) -> None:
    """`check_header` on every tensor of `linears` that `source_format` declares, with the parameters the
    shapes gave (`from_data`, before it reads a value); other suffixes are refused where the layers are
    grouped (survey.py)."""
    expected: dict[tuple[int, int], dict[str, TensorSpec]] = {}
    for tensors, out_features, in_features in linears:
        specs = expected.get((out_features, in_features))
        if specs is None:
            specs = expected[out_features, in_features] = source_format.expected(out_features, in_features)
        for suffix, entry in tensors.items():
            if suffix in specs:
                check_header(entry, specs[suffix], source_format)


def checked_group_size(group_size: int, where: str) -> int:
    """A configured group size, normalised once: a power of two, or CHANNELWISE for -1 and 0 (configs
    write both), so nothing past `from_config` meets the second spelling."""
    if is_channelwise(group_size):
        return CHANNELWISE
    if group_size < 1 or group_size & (group_size - 1):
        raise MoeconvError(f"{where}: group_size {group_size} is not -1 or a power of two")
    return group_size


def check_bits(bits: int, allowed: tuple[int, ...], method: str, where: str) -> None:
    if bits not in allowed:
        choices = ", ".join(map(str, allowed))
        raise MoeconvError(f"{where}: {method} with {bits} bits is not supported (supported: {choices})")


# `{,n}`: Python reads 0 to n repeats, RE2 the literal text (checked on the pattern's text, escaped or not).
_OPEN_MINIMUM = re.compile(r"\{,\d*\}")
SHOWN_PATTERN = 80  # characters of a refused pattern a message quotes
# Module-name patterns are tens of characters; past this, compiling alone (Python's parser: 2 s a megabyte)
# would be the cost.
MAX_PATTERN = 4096


def config_pattern(pattern: str, where: str) -> Any:
    """A regular expression from a config (compressed-tensors' `re:` targets), compiled for RE2, whose
    matching takes time linear in the name: Python's `re`, which compressed-tensors matches with,
    backtracks, and a pattern written to (`(.*.*)*X`) hangs it for good, while a time budget would make
    the answer depend on the host's load. Python's parser stays the judge of the syntax, so a pattern
    means to moeconv what it means to compressed-tensors; what RE2 cannot run in linear time
    (backreferences, lookaround), or reads otherwise than Python (`{,n}`, a POSIX class in a set), is
    refused naming the pattern and `where` (the config field)."""
    import re2

    shown = repr(pattern) if len(pattern) <= SHOWN_PATTERN else \
        f"{pattern[:SHOWN_PATTERN]!r}... ({len(pattern)} characters)"

    def refused(why: str) -> MoeconvError:
        return MoeconvError(f"{where}: pattern {shown} {why}")

    if len(pattern) > MAX_PATTERN:
        raise refused(f"is longer than the {MAX_PATTERN} characters moeconv takes in a module-name pattern")
    options = re2.Options()
    options.log_errors = False  # RE2 would also print its refusal on stderr
    try:
        compiled = re2.compile(pattern, options)
    except re2.error as error:
        _check_python_syntax(pattern, refused)  # an invalid pattern is refused as that
        reason = error.args[0].decode() if isinstance(error.args[0], bytes) else error.args[0]
        raise refused(f"uses syntax moeconv does not match in linear time (RE2: {reason}): backreferences, "
                      f"lookaround, possessive repeats and \\Z (write $) are not taken") from None
    if _OPEN_MINIMUM.search(pattern):
        raise refused("has a repeat {,n}, which Python reads as {0,n} and RE2 as text; write {0,n}")
    _check_python_syntax(pattern, refused)
    return compiled


def _check_python_syntax(pattern: str, refused: Callable[[str], MoeconvError]) -> None:
    """Python's parser on the pattern (compiling, never matching: no backtracking), its warnings refusals
    too: they mark what it reads otherwise than other engines (a nested set)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            re.compile(pattern)
        except (re.error, FutureWarning, DeprecationWarning) as error:
            raise refused(f"is not a valid Python pattern ({error})") from None
        except RecursionError:
            raise refused("nests its groups deeper than Python's parser goes") from None
