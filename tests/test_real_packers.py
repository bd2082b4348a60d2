"""Cross-checks against the REAL packers: AutoAWQ, auto-gptq and GPTQModel.

tests/packers/pack_real.py runs in .venv-packers (made by scripts/install-packers.sh). It chooses
codes, true zeros and scales per case (tests/packers/cases.py), has the real packer pack them, and
saves packed and intended tensors in one safetensors file. Here, in the main venv, we check that

  * moeconv's decoders give back exactly the codes, zeros and scales that were packed, and
  * moeconv's encoders (used for synthetic checkpoints) write the same int32 words as the packer.

Without .venv-packers these tests FAIL (run scripts/install-packers.sh); MOECONV_SKIP_PACKERS=1
skips them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moeconv import packing
from moeconv.canonical import QuantizedWeight
from moeconv.synth import stored_array
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ

from helpers import PACKERS_VENV, packers_python

ROOT = Path(__file__).resolve().parents[1]
PACKERS_DIR = Path(__file__).resolve().parent / "packers"
EXPECTED_VERSIONS = {"autoawq": "0.2.9", "auto-gptq": "0.7.1", "gptqmodel": "7.7.0"}


def _load_cases_module():
    spec = importlib.util.spec_from_file_location("moeconv_packer_cases", PACKERS_DIR / "cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


C = _load_cases_module()

pytestmark = pytest.mark.packers

EXACT = [case for case in C.CASES if not (case.packer in (C.AUTOGPTQ, C.AUTOGPTQ_OLD) and case.zeros == "zero0")]
GPTQMODEL_CASES = [case for case in C.CASES if case.packer == C.GPTQMODEL]


# ------------------------------------------------------------------------------------- fixtures


@dataclass
class Packed:
    tensors: dict[str, torch.Tensor]
    versions: dict[str, str]

    def of(self, name: str) -> dict[str, np.ndarray]:
        """One case's tensors as the stored arrays the codecs read (BF16 as its uint16 bit patterns)."""
        prefix = name + "."
        found = {key[len(prefix):]: stored_array(value) for key, value in self.tensors.items() if key.startswith(prefix)}
        assert found, f"no tensors for case {name}"
        return found


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Packed:
    python = packers_python()
    out = tmp_path_factory.mktemp("real-packers") / "packed.safetensors"
    proc = subprocess.run(
        [str(python), str(PACKERS_DIR / "pack_real.py"), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"tests/packers/pack_real.py failed (exit {proc.returncode}); if the environment is broken, "
            f"delete {PACKERS_VENV} and rerun scripts/install-packers.sh\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    with safe_open(str(out), "pt") as handle:
        metadata = handle.metadata()
    written = [entry["name"] for entry in json.loads(metadata["cases"])]
    assert written == [case.name for case in C.CASES], "pack_real.py and cases.py disagree"
    return Packed(tensors=load_file(str(out)), versions=json.loads(metadata["versions"]))


# ------------------------------------------------------------------------------------- helpers


def _same_bytes(got: np.ndarray | torch.Tensor, want: np.ndarray | torch.Tensor, what: str) -> None:
    got, want = (stored_array(x) if isinstance(x, torch.Tensor) else x for x in (got, want))
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    # reshape(-1) first: a transposed (N, 1) array counts as contiguous in both orders.
    got_bytes = np.ascontiguousarray(got.reshape(-1)).view(np.uint8)
    want_bytes = np.ascontiguousarray(want.reshape(-1)).view(np.uint8)
    differ = got_bytes != want_bytes
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} of {differ.size} bytes differ"


def _assert_canonical(got: QuantizedWeight, want: QuantizedWeight, what: str) -> None:
    assert (got.bits, got.group_size) == (want.bits, want.group_size), what
    _same_bytes(got.codes, want.codes, f"{what}: codes")
    _same_bytes(got.scales, want.scales, f"{what}: scales")
    assert (got.zeros is None) == (want.zeros is None), f"{what}: one side symmetric, the other not"
    if want.zeros is not None:
        _same_bytes(got.zeros, want.zeros, f"{what}: zeros")


def _fmt(case, checkpoint_format: str = "gptq", sym: bool | None = None):
    if case.packer == C.AUTOAWQ:
        return AWQ(bits=case.bits, group_size=case.group_size, zero_point=True)
    return GPTQ(
        bits=case.bits,
        group_size=case.group_size,
        sym=case.sym if sym is None else sym,
        checkpoint_format=checkpoint_format,
    )


def _source(case, t: dict[str, np.ndarray], qzeros: str = "qzeros") -> dict[str, np.ndarray]:
    tensors = {"qweight": t["qweight"], "qzeros": t[qzeros], "scales": t["pscales"]}
    if case.packer != C.AUTOAWQ:
        tensors["g_idx"] = t["g_idx"]
    return tensors


def _intended(case, t: dict[str, np.ndarray]) -> QuantizedWeight:
    return QuantizedWeight(
        codes=t["codes"],
        zeros=None if case.sym else t["zeros"],
        scales=t["scales"],
        bits=case.bits,
        group_size=case.k // case.groups,
    )


# ------------------------------------------------------------------------------------- tests


def test_the_real_packers_ran(packed):
    for package, version in EXPECTED_VERSIONS.items():
        assert packed.versions.get(package) == version, packed.versions
    assert packed.versions["torch"].startswith("2.13.0"), packed.versions


@pytest.mark.parametrize("case", EXACT, ids=lambda case: case.name)
def test_decode_gives_back_what_was_packed(packed, case):
    t = packed.of(case.name)
    fmt = _fmt(case)
    src = _source(case, t)
    assert src["scales"].dtype == np.float16
    _assert_canonical(fmt.decode(src), _intended(case, t), case.name)
    if case.packer != C.AUTOAWQ:
        # v1 stores zero − 1; only a true zero of 0 can show up as an all-ones slot in what AutoGPTQ writes.
        if case.packer != C.GPTQMODEL or case.sym:
            assert fmt.suspicious_zero_slots(t["qzeros"]) == 0
    if case.sym:
        # Symmetric v1 filler words: 0x77777777 (4-bit) / 0x7F7F7F7F (8-bit); read as asymmetric they
        # are the implicit zero 2^(b-1) everywhere.
        half = 1 << (case.bits - 1)
        filler = packing.add_to_word_array(np.zeros(1, dtype=np.int32), packing.repeated_word(half - 1, case.bits))
        assert bool((t["qzeros"] == filler).all()), f"{case.name}: qzeros are not all {int(filler[0]) & 0xFFFFFFFF:#x}"
        as_asym = _fmt(case, sym=False).decode(src)
        assert bool((as_asym.zeros == half).all())


@pytest.mark.parametrize("case", EXACT, ids=lambda case: case.name)
def test_encode_writes_what_the_packer_writes(packed, case):
    t = packed.of(case.name)
    ours = _fmt(case).encode(_intended(case, t))
    theirs = _source(case, t)
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    for key in theirs:
        _same_bytes(ours[key], theirs[key], f"{case.name}: {key}")


@pytest.mark.parametrize("case", GPTQMODEL_CASES, ids=lambda case: case.name)
def test_gptqmodel_v2_in_memory_form(packed, case):
    """Before its v2 -> v1 conversion GPTQModel holds true zeros: checkpoint_format gptq_v2."""
    t = packed.of(case.name)
    fmt = _fmt(case, checkpoint_format="gptq_v2")
    _assert_canonical(fmt.decode(_source(case, t, qzeros="qzeros_v2")), _intended(case, t), case.name)
    _same_bytes(fmt.encode(_intended(case, t))["qzeros"], t["qzeros_v2"], f"{case.name}: v2 qzeros")
    # and v1 is v2 minus the repeated-ones word, borrows included
    ones = packing.repeated_word(1, case.bits)
    _same_bytes(packing.add_to_word_array(t["qzeros_v2"], -ones), t["qzeros"], f"{case.name}: v1 = v2 - {ones:#x}")


@pytest.mark.parametrize("bits", [4, 8])
def test_gptqmodel_v1_zero_point_0_decodes_to_0(packed, bits):
    case = C.CASES_BY_NAME[f"gptqmodel-{bits}bit-g64-zero0"]
    t = packed.of(case.name)
    fmt = _fmt(case)
    decoded = fmt.decode(_source(case, t))
    for group, column in C.ZERO0_SLOTS[bits]:
        assert int(t["zeros"][column, group]) == 0
        assert int(decoded.zeros[column, group]) == 0, (column, group)
    _same_bytes(decoded.zeros, t["zeros"], case.name)
    # the all-ones slots are flagged for reports, even though GPTQModel's words decode exactly
    assert fmt.suspicious_zero_slots(t["qzeros"]) >= len(C.ZERO0_SLOTS[bits])


@pytest.mark.parametrize("bits", [4, 8])
def test_autogptq_zero_point_0_is_unrecoverable_and_flagged(packed, bits):
    """AutoGPTQ packs v1 zeros as (z − 1) cast to uint32 and ORed into the word: a true zero of 0 in
    slot j ORs 0xFFFFFFFF << (b·j), so slot j and every higher slot of that word read as all ones.

    What moeconv decodes there (it inverts GPTQModel's word subtraction): slot j gives 0 (right), and
    every higher slot of the same word gives 1, whatever its true zero was (lost). Every other slot,
    hence every group with no zero of 0, decodes exactly; codes and scales always do.
    """
    case = C.CASES_BY_NAME[f"autogptq-{bits}bit-g64-zero0"]
    t = packed.of(case.name)
    fmt = _fmt(case)
    true_zeros = torch.from_numpy(t["zeros"]).to(torch.int64)  # (N, G)
    per_word = 32 // bits
    n_out, groups = true_zeros.shape

    # 1. what AutoGPTQ wrote, word by word
    words = true_zeros.T.reshape(groups, n_out // per_word, per_word)  # [group, word, slot]
    stored = torch.zeros(groups, n_out // per_word, dtype=torch.int64)
    for slot in range(per_word):
        stored |= (((words[..., slot] - 1) & 0xFFFFFFFF) << (bits * slot)) & 0xFFFFFFFF
    _same_bytes(torch.from_numpy(t["qzeros"]).to(torch.int64) & 0xFFFFFFFF, stored, f"{case.name}: AutoGPTQ's OR model")

    # 2. what moeconv decodes from it
    expected = words.clone()
    corrupted_slots = 0
    for group in range(groups):
        for word in range(n_out // per_word):
            zero_slots = (words[group, word] == 0).nonzero().flatten().tolist()
            if zero_slots:
                first = zero_slots[0]
                expected[group, word, first + 1:] = 1
                corrupted_slots += per_word - first
    expected = expected.reshape(groups, n_out).T.to(torch.uint8)
    decoded = fmt.decode(_source(case, t))
    _same_bytes(decoded.zeros, expected.contiguous(), f"{case.name}: documented decode")
    _same_bytes(decoded.codes, t["codes"], f"{case.name}: codes")
    _same_bytes(decoded.scales, t["scales"], f"{case.name}: scales")
    assert not np.array_equal(decoded.zeros, t["zeros"]), "expected some true zeros to be unrecoverable"

    # 3. groups without a zero of 0 decode exactly; at least one such group is in the case
    clean = [g for g in range(groups) if bool((true_zeros[:, g] != 0).all())]
    assert clean, "the case must have a group with no zero of 0"
    for group in clean:
        _same_bytes(decoded.zeros[:, group], t["zeros"][:, group], f"group {group}")

    # 4. flagged: the zero-0 slots and every slot above them in their words read as all ones
    assert fmt.suspicious_zero_slots(t["qzeros"]) == corrupted_slots >= len(C.ZERO0_SLOTS[bits])


def test_act_order_g_idx_reads_as_permuted_inputs(packed):
    """AutoGPTQ's qlinear_cuda honours a permuted g_idx (desc_act=true): the plain decoder refuses it, the
    ordered one gives the packed codes with the inputs permuted to static groups, and the zeros and scales
    group by group as the packer was given them."""
    t = packed.of(C.ACT_ORDER_NAME)
    assert not np.array_equal(t["g_idx"], np.arange(t["g_idx"].size, dtype=np.int32) // 64)
    fmt = GPTQ(bits=4, group_size=64, sym=False, checkpoint_format="gptq")
    stored = {"qweight": t["qweight"], "qzeros": t["qzeros"], "scales": t["pscales"], "g_idx": t["g_idx"]}
    with pytest.raises(MoeconvError, match="act-order"):
        fmt.decode(stored)
    weight, inputs = fmt.decode_ordered(stored)
    assert np.array_equal(t["g_idx"][inputs].astype(np.int64), np.arange(t["g_idx"].size) // 64)
    _same_bytes(weight.codes, t["codes"][:, inputs], "codes")
    _same_bytes(weight.zeros, t["zeros"], "zeros")
    _same_bytes(weight.scales, t["scales"], "scales")


def test_mismatch_on_channel_wise_decode(packed):
    """A channel-wise decode's scales are a transposed (N, 1) tensor; comparing them must work."""
    case = C.CASES_BY_NAME["autoawq-4bit-cw-full"]
    t = packed.of(case.name)
    assert _fmt(case).decode(_source(case, t)).mismatch(_intended(case, t)) is None
