"""Hypothesis strategies for canonical weights, with edge values forced in."""

import numpy as np
import torch
from hypothesis import strategies as st

from moeconv.canonical import QuantizedWeight, groups_of
from moeconv.synth import stored_array


@st.composite
def quantized_weights(draw, bits: int, symmetric: bool, group_size: int, k_multiple: int = 32,
                      n_multiple: int = 8, scale_dtype=torch.float16):
    """A random canonical weight. group_size −1 means channel-wise. Codes and zeros include the
    edges 0 and 2^b − 1 (set explicitly in the first groups, then random)."""
    groups = draw(st.integers(1, 4))
    if group_size == -1:
        k = k_multiple * draw(st.integers(1, 4))
        g = k
        groups = 1
    else:
        g = group_size
        k = g * groups
    n = n_multiple * draw(st.integers(1, 3))
    weight = random_canonical(torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))), bits, symmetric,
                              n, k, groups, scale_dtype)
    if weight.zeros is not None and draw(st.booleans()):  # whole rows of zero points at an edge (v1 borrow chains)
        weight.zeros[: min(n, 8)] = draw(st.sampled_from([0, (1 << bits) - 1]))
    return weight


def random_canonical(generator: torch.Generator, bits: int, symmetric: bool, out_features: int, in_features: int,
                     groups: int, scale_dtype=torch.float16) -> QuantizedWeight:
    """Random codes, zeros and scales, with code and zero point 0 at the first and 2^b − 1 at the last place
    (drawn with torch's generator, in the stored form: BF16 scales as their uint16 bit patterns)."""
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (out_features, in_features), dtype=torch.uint8, generator=generator)
    codes[0, 0], codes[-1, -1] = 0, top
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, top + 1, (out_features, groups), dtype=torch.uint8, generator=generator)
        zeros[0, 0], zeros[-1, -1] = 0, top
    scales = (torch.rand(out_features, groups, generator=generator) * 0.1 + 1e-4).to(scale_dtype)
    return QuantizedWeight(codes=codes.numpy(), zeros=None if zeros is None else zeros.numpy(),
                           scales=stored_array(scales), bits=bits, group_size=in_features // groups)


@st.composite
def decoded_linears(draw, source, out_features: int, in_features: int, scale_dtype=torch.float16):
    """A random linear of this size as the source format decodes it (after the format's own round
    trip), edge codes and zero points included: the input of every backend round-trip test."""
    groups = groups_of(in_features, source.group_size)  # one group when g >= K
    weight = random_canonical(torch.Generator().manual_seed(draw(st.integers(0, 2**31))), source.bits,
                              source.symmetric, out_features, in_features, groups, scale_dtype)
    return source.decode(source.encode(weight))


def weight_rows(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Output channels [start, stop) of a canonical weight: one tensor-parallel rank's slice of N."""
    return QuantizedWeight(weight.codes[start:stop], None if weight.zeros is None else weight.zeros[start:stop],
                           weight.scales[start:stop], weight.bits, weight.group_size)


def weight_columns(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Input channels [start, stop) (whole groups) of a canonical weight: one rank's slice of K."""
    g = weight.group_size
    if weight.scales.shape[1] == 1:  # channel-wise: each slice of K keeps the one group of its channel
        return QuantizedWeight(weight.codes[:, start:stop], weight.zeros, weight.scales, weight.bits, stop - start)
    return QuantizedWeight(weight.codes[:, start:stop],
                           None if weight.zeros is None else weight.zeros[:, start // g:stop // g],
                           weight.scales[:, start // g:stop // g], weight.bits, g)


def as_tensors(stored: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Stored arrays (a codec's output) as the torch tensors an engine loads: uint16 is BF16's bit patterns."""
    return {name: torch.from_numpy(array).view(torch.bfloat16) if array.dtype == np.uint16 else torch.from_numpy(array)
            for name, array in stored.items()}
