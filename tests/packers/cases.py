"""The cross-check cases, shared by tests/test_real_packers.py (main venv) and pack_real.py (.venv-packers).

Pure Python: importing this must not need torch or any packer.

Each case is one linear (out N, in K) whose codes, zeros and scales are chosen with a seed, packed by a
REAL packer, and decoded by moeconv. `zeros` says how the asymmetric zero points are drawn:
  "sym"    symmetric: every zero 2^(b-1), as GPTQ sym=True and the packers write it
  "full"   uniform over [0, 2^b), with 0 and 2^b - 1 forced into slots 0 and 7 of packed words
  "nonzero" uniform over [1, 2^b), with 1 and 2^b - 1 forced (AutoGPTQ cannot store a zero of 0)
  "zero0"  like "nonzero", plus true zeros of 0 at chosen slots (see ZERO0_SLOTS) in some groups
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# packer ids
AUTOAWQ = "autoawq"  # awq WQLinear_GEMM.from_linear
AUTOGPTQ = "autogptq"  # auto_gptq qlinear_cuda.QuantLinear.pack (honours g_idx)
AUTOGPTQ_OLD = "autogptq_old"  # auto_gptq qlinear_cuda_old.QuantLinear.pack
GPTQMODEL = "gptqmodel"  # gptqmodel TorchLinear.pack_block (v2), then convert_gptq_v2_to_v1_format_module
CT_PACK = "ct_pack_quantized"  # compressed_tensors PackedQuantizationCompressor.compress (pack_to_int32)
CT_INT = "ct_int_quantized"  # compressed_tensors IntQuantizationCompressor.compress (W8A8 int8)

N_OUT = 64
K_IN = 256

# (group index, output column n) of the true zeros of 0 in "zero0" cases, chosen to sit at the first,
# a middle and the last slot of packed qzeros words, for 4 bits (8 slots per word) and 8 bits (4 slots).
ZERO0_SLOTS = {
    4: ((0, 0), (1, 8 + 3), (2, 16 + 7), (2, 40 + 5)),
    8: ((0, 0), (1, 4 + 2), (2, 8 + 3), (2, 20 + 1)),
}


@dataclass(frozen=True)
class Case:
    packer: str
    bits: int
    group_size: int  # as configured: -1 is channel-wise
    zeros: str  # "sym" | "full" | "nonzero" | "zero0"
    seed: int
    n: int = N_OUT
    k: int = K_IN

    @property
    def name(self) -> str:
        g = "cw" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.packer}-{self.bits}bit-{g}-{self.zeros}"

    @property
    def sym(self) -> bool:
        return self.zeros == "sym"

    @property
    def groups(self) -> int:
        return 1 if self.group_size == -1 else self.k // self.group_size

    def to_json(self) -> dict:
        return {**asdict(self), "name": self.name}


def _build() -> list[Case]:
    cases: list[Case] = []
    seed = 1000

    def add(*args) -> None:
        nonlocal seed
        seed += 1
        cases.append(Case(*args, seed=seed))

    # AutoAWQ: GEMM is 4-bit only, and always has zero points (zero_point=False is not a GEMM layout
    # AutoAWQ can pack: from_linear asserts zeros is not None). AWQ stores true zeros, so 0 is fine.
    for g in (32, 64, 128, -1):
        add(AUTOAWQ, 4, g, "full")
    # AutoGPTQ (v1, zero - 1 ORed in): asymmetric without zeros of 0, symmetric, both kernels' pack().
    for bits in (4, 8):
        for g in (32, 64, 128, -1):
            add(AUTOGPTQ, bits, g, "nonzero")
        add(AUTOGPTQ, bits, 128, "sym")
        add(AUTOGPTQ, bits, -1, "sym")
        add(AUTOGPTQ_OLD, bits, 32, "nonzero")
        add(AUTOGPTQ_OLD, bits, 64, "sym")
        # The corrupting case: documented, not bit-exact (see the test).
        add(AUTOGPTQ, bits, 64, "zero0")
    # GPTQModel (v2 packed, converted to v1 by word subtraction): zeros of 0 included.
    for bits in (4, 8):
        for g in (32, 64, 128, -1):
            add(GPTQMODEL, bits, g, "full")
        add(GPTQMODEL, bits, 64, "zero0")
        add(GPTQMODEL, bits, 128, "sym")
        add(GPTQMODEL, bits, -1, "sym")
    return cases


CASES: list[Case] = _build()
CASES_BY_NAME: dict[str, Case] = {case.name: case for case in CASES}
assert len(CASES_BY_NAME) == len(CASES), "case names must be unique"

# AutoGPTQ's qlinear_cuda honours a non-trivial g_idx (act-order); moeconv must refuse it, not misread it.
ACT_ORDER_NAME = "autogptq-4bit-g64-actorder"


def _build_compressed_tensors() -> list[Case]:
    """Kept out of CASES: tests/test_compressed_tensors.py checks these, with their own packer run."""
    specs = [(CT_PACK, 4, g, "full") for g in (32, 128, -1)] + [(CT_PACK, 4, 64, "sym"), (CT_PACK, 4, -1, "sym"),
             (CT_PACK, 8, 64, "full"), (CT_PACK, 8, -1, "sym"), (CT_INT, 8, -1, "sym")]
    return [Case(*spec, seed=2000 + index) for index, spec in enumerate(specs)]


CT_CASES: list[Case] = _build_compressed_tensors()
assert len({case.name for case in CASES + CT_CASES}) == len(CASES) + len(CT_CASES), "case names must be unique"
