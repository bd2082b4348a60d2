"""Hypothesis strategies for canonical weights, with edge values forced in."""

import torch
from hypothesis import strategies as st

from moeconv.canonical import QuantizedWeight


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
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (n, k), dtype=torch.uint8, generator=generator)
    codes[0, 0], codes[-1, -1] = 0, top
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, top + 1, (n, groups), dtype=torch.uint8, generator=generator)
        zeros[0, 0] = 0
        zeros[-1, -1] = top
        if draw(st.booleans()):  # whole rows of zero points at an edge (GPTQ v1 borrow chains)
            zeros[: min(n, 8)] = draw(st.sampled_from([0, top]))
    scales = (torch.rand(n, groups, generator=generator) * 0.1 + 1e-4).to(scale_dtype)
    return QuantizedWeight(codes=codes, zeros=zeros, scales=scales, bits=bits, group_size=g)
