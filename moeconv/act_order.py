"""Act-order (GPTQ `desc_act`): what a `g_idx` says about a linear's groups, and when it folds away.

`g_idx[k]` is the group of input channel k. Static groups are `g_idx == k // g`; act-order quantizes the
channels in another order (GPTQModel and AutoGPTQ: by decreasing Hessian diagonal), so group j holds the
channels `perm[j·g:(j+1)·g]` and `g_idx[k] = invperm[k] // g`. The kernels moeconv writes for know only
static groups, and vLLM (the release engines/ names) no longer loads act-order at all. A g_idx is one of:

- STATIC: `k // g`.
- RELABELLED: `σ(k // g)` for a permutation σ of the groups; the same weight with static groups and the
  scale and zero-point columns reordered by σ (exact, any linear).
- PERMUTED: every group has exactly g channels, in some order. The linear is static-grouped only with its
  inputs permuted: `W[:, P]` with `P = argsort(g_idx)` (stable). Only a down projection can take that: its
  inputs are the intermediate channels, which the same expert's gate and up produce, so permuting their
  output rows by the same P computes the same function (SiLU-and-multiply is element-wise). A gate or up
  projection's inputs are the hidden state, shared with every other layer: refused.
- IRREGULAR: groups of unequal sizes, or labels out of range: no static-group form at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeconv.canonical import QuantizedWeight
from moeconv.errors import MoeconvError

STATIC, RELABELLED, PERMUTED, IRREGULAR = "static", "relabelled", "permuted", "irregular"
FOLDED = "down folded into gate/up"  # a layer whose down projections are PERMUTED: folded


@dataclass(frozen=True, eq=False)
class GroupOrder:
    """What a g_idx is (see the module doc), with the permutation that makes it static (int64 arrays):
    `groups` (RELABELLED): canonical group j is stored group groups[j];
    `channels` (PERMUTED): canonical input i is stored input channels[i]."""

    kind: str
    groups: np.ndarray | None = None
    channels: np.ndarray | None = None


def group_order(g_idx: np.ndarray | None, group_size: int) -> GroupOrder:
    """Classify one linear's g_idx (None: a format without one, static). `group_size` is the effective
    one (K for channel-wise)."""
    if g_idx is None:
        return GroupOrder(STATIC)
    labels = np.asarray(g_idx).astype(np.int64).reshape(-1)
    in_features = labels.size
    groups = in_features // group_size
    static = np.arange(in_features, dtype=np.int64) // group_size
    if np.array_equal(labels, static):
        return GroupOrder(STATIC)
    if in_features % group_size or bool((labels < 0).any()) or bool((labels >= groups).any()):
        return GroupOrder(IRREGULAR)
    blocks = labels.reshape(groups, group_size)
    if bool((blocks == blocks[:, :1]).all()) and np.array_equal(np.sort(blocks[:, 0]), np.arange(groups)):
        return GroupOrder(RELABELLED, groups=np.ascontiguousarray(blocks[:, 0]))
    if not bool((np.bincount(labels, minlength=groups) == group_size).all()):
        return GroupOrder(IRREGULAR)
    return GroupOrder(PERMUTED, channels=np.argsort(labels, kind="stable"))


def describe(kind: str, projection: str) -> str:
    """Why a g_idx of this kind cannot be converted, for a linear playing `projection`."""
    if kind == IRREGULAR:
        return "g_idx groups are not all group_size channels wide: no static-group form exists"
    return (f"g_idx is an act-order permutation (desc_act) of the {projection}'s inputs; only a routed "
            f"expert's down projection can be folded (into its gate and up rows); this one's inputs are "
            f"shared with other layers (re-quantize with desc_act off here, or static_groups=True)")


def fold(producers: dict[str, QuantizedWeight], inputs: np.ndarray | None) -> dict[str, QuantizedWeight]:
    """The gate and up projections with their output rows permuted by `inputs`, the permutation a down
    projection's act-order inputs were put in static order with (None: unchanged)."""
    if inputs is None:
        return producers
    return {projection: QuantizedWeight(codes=weight.codes[inputs],
                                        zeros=None if weight.zeros is None else weight.zeros[inputs],
                                        scales=weight.scales[inputs],
                                        bits=weight.bits, group_size=weight.group_size)
            for projection, weight in producers.items()}


def static_form(codes: np.ndarray, zeros: np.ndarray | None, scales: np.ndarray, g_idx: np.ndarray | None,
                group_size: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """A linear's codes (N, K), zeros and scales (N, G), read with its g_idx: the same in
    static groups (relabelled groups reordered), and for act-order the input permutation P under which
    that holds (the stored linear is W[:, P]; None otherwise). Irregular groups are refused."""
    order = group_order(g_idx, group_size)
    if order.kind == IRREGULAR:
        raise MoeconvError(describe(order.kind, "linear"))
    if order.kind == RELABELLED:
        scales = np.ascontiguousarray(scales[:, order.groups])
        zeros = None if zeros is None else np.ascontiguousarray(zeros[:, order.groups])
    if order.kind != PERMUTED:
        return codes, zeros, scales, None
    return np.ascontiguousarray(codes[:, order.channels]), zeros, scales, order.channels
