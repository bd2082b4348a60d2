"""Source formats: decode ∘ encode is the identity, and decoding matches hand-computed layouts."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeconv.canonical import QuantizedWeight
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, format_from_config

from strategies import quantized_weights

GROUPS = [32, 64, 128, -1]
SOURCES = (
    [AWQ(4, g, zero_point=zp) for g in GROUPS for zp in (True, False)]
    + [GPTQ(bits, g, sym, fmt) for bits in (2, 4, 8) for g in GROUPS for sym in (True, False)
       for fmt in ("gptq", "gptq_v2")]
)


@pytest.mark.parametrize("source", SOURCES, ids=str)
@given(data=st.data())
def test_decode_encode_round_trip(source, data):
    weight = data.draw(quantized_weights(source.bits, source.symmetric, source.group_size, n_multiple=32 // source.bits))
    tensors = source.encode(weight)
    assert set(tensors) >= set(source.suffixes())
    assert source.decode(tensors).mismatch(weight) is None


def test_awq_interleave_hand_checked():
    # Column c of one k row has code c: slot s of the word holds column (0,2,4,6,1,3,5,7)[s],
    # so the word reads, from slot 7 down to slot 0: 7 5 3 1 6 4 2 0.
    qweight = np.full((32, 1), 0x75316420, dtype=np.int32)
    qzeros = np.array([[0x75316420]], dtype=np.int32)
    scales = np.ones((1, 8), dtype=np.float16)
    weight = AWQ(4, 32, True).decode({"qweight": qweight, "qzeros": qzeros, "scales": scales})
    assert weight.codes[:, 0].tolist() == list(range(8))
    assert weight.zeros[:, 0].tolist() == list(range(8))


def test_gptq_v1_decodes_gptqmodel_borrows_exactly():
    # True zeros 0..7 in one word are 0x76543210; GPTQModel's v1 is that minus 0x11111111 = 0x654320FF.
    qzeros = np.array([[0x654320FF]], dtype=np.int32)
    qweight = np.zeros((4, 8), dtype=np.int32)
    scales = np.ones((1, 8), dtype=np.float16)
    weight = GPTQ(4, 32, sym=False).decode({"qweight": qweight, "qzeros": qzeros, "scales": scales})
    assert weight.zeros[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    # The same word read as v2 is taken literally.
    v2 = GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2").decode(
        {"qweight": qweight, "qzeros": qzeros, "scales": scales})
    assert v2.zeros[:, 0].tolist() == [15, 15, 0, 2, 3, 4, 5, 6]


def test_gptq_counts_all_ones_v1_slots():
    v1 = GPTQ(4, 32, sym=False)
    assert v1.suspicious_zero_slots(np.array([[0x654320FF]], dtype=np.int32)) == 2
    assert GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2").suspicious_zero_slots(
        np.array([[-1]], dtype=np.int32)) == 0


def test_gptq_qweight_packs_along_k_hand_checked():
    # Column n = 0 holds k = 0..7 with codes 1..8: word 0x87654321 (value j at bits 4j).
    qweight = np.array([[0x87654321 - (1 << 32)]], dtype=np.int32)
    weight = GPTQ(4, -1, sym=True).decode({"qweight": qweight, "scales": np.ones((1, 1), dtype=np.float16)})
    assert weight.codes.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert weight.group_size == 8 and weight.zeros is None


def test_gptq_refuses_act_order():
    weight = QuantizedWeight(np.zeros((8, 64), dtype=np.uint8), None, np.ones((8, 2), dtype=np.float16), 4, 32)
    tensors = GPTQ(4, 32, sym=True).encode(weight)
    tensors["g_idx"] = np.arange(64, dtype=np.int32) % 2  # both groups 32 wide, interleaved
    with pytest.raises(MoeconvError, match="act-order"):
        GPTQ(4, 32, sym=True).decode(tensors)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "only 'gemm'"),
    ({"quant_method": "awq", "bits": 3}, "AWQ with 3 bits is not supported"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "not -1 or a power of two"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8' with expert_dtype None: moeconv reads DeepSeek-V4's FP4 experts"),
    ({"quant_method": "fp8", "expert_dtype": "fp8"}, "with expert_dtype 'fp8'"),
    ({"quant_method": "fp8", "expert_dtype": "fp4", "fmt": "e4m3", "scale_fmt": "float",
      "weight_block_size": [128, 128], "activation_scheme": "dynamic"}, r"scale_fmt is 'float'; DeepSeek-V4"),
    ({"quant_method": "mlx"}, "unsupported quant_method 'mlx'"),
])
def test_config_refusals_name_the_problem(config, message):
    with pytest.raises(MoeconvError, match=message):
        format_from_config(config, "config.json")


def test_config_spellings():
    assert format_from_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"},
                              "x") == AWQ(4, 64, True)
    assert format_from_config({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False,
                               "checkpoint_format": "gptq_v2"}, "x") == GPTQ(8, -1, False, "gptq_v2")
