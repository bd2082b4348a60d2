"""Format detection on MoE checkpoints made by the REAL quantizers and packers, correctly labelled and
relabelled, with the quantizer's own zero points as the ground truth.

tests/packers/make_moe.py runs in .venv-packers: for every quantized linear of a small synthetic MoE
checkpoint (the template: names, shapes, configs) it draws a zero-mean float weight, lets the
producer's own quantizer choose scales and zero points (GPTQModel / auto-gptq `find_params`, AutoAWQ
`pseudo_quantize_tensor`, compressed-tensors `calculate_qparams`) and the producer's own packer pack
it (GPTQModel v1 and v2, auto-gptq v1, AutoAWQ GEMM, compressed-tensors pack-quantized). The truth
file beside each checkpoint holds the quantizer's codes, zero points and scales. Nothing here
decodes the source with moeconv's reading to make the expectation.

Without .venv-packers these tests FAIL (run scripts/install-packers.sh); MOECONV_SKIP_PACKERS=1
skips them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import moeconv
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.plan import make_plan
from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import PACKERS_VENV, packers_python, run_main

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.packers


@dataclass(frozen=True)
class Made:
    """One checkpoint made by a real packer: how, and where."""

    packer: str
    bits: int
    group_size: int
    sym: bool = False
    v2: bool = False
    hidden: int = 128
    intermediate: int = 64

    @property
    def name(self) -> str:
        g = "cw" if self.group_size == -1 else f"g{self.group_size}"
        return (f"{self.packer}-{self.bits}bit-{g}-{'sym' if self.sym else 'asym'}"
                f"{'-v2' if self.v2 else ''}")

    def template_format(self):
        if self.packer == "autoawq":
            return AWQ(bits=self.bits, group_size=self.group_size, zero_point=not self.sym)
        if self.packer == "ct":
            return CompressedTensors(bits=self.bits, group_size=self.group_size, symmetric=self.sym)
        return GPTQ(bits=self.bits, group_size=self.group_size, sym=self.sym,
                    checkpoint_format="gptq_v2" if self.v2 else "gptq")


# The 8-bit checkpoints are wider: 8-bit codes spread 16x more per weight, so the v1/v2 statistic needs
# more groups for the same precision (real MoE layers have far more than these).
MADE = [
    Made("gptqmodel", 4, 32),
    Made("gptqmodel", 4, 32, v2=True),
    Made("autogptq", 4, 32),
    Made("gptqmodel", 4, -1),
    Made("gptqmodel", 4, -1, v2=True),
    Made("gptqmodel", 8, 64, hidden=256, intermediate=128),
    Made("gptqmodel", 8, -1, v2=True, hidden=256, intermediate=128),
    Made("autogptq", 8, 128, hidden=256, intermediate=128),
    # one projection with K == g (down_proj: K = intermediate = 64): one group, no evidence against g = 64
    Made("gptqmodel", 4, 64),
    Made("autoawq", 4, 64),
    Made("ct", 4, 64),
    Made("gptqmodel", 4, 32, sym=True),
]
BY_NAME = {made.name: made for made in MADE}
ASYM_GPTQ = [m.name for m in MADE if m.packer in ("gptqmodel", "autogptq") and not m.sym]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    python = packers_python()
    base = tmp_path_factory.mktemp("real-moe")
    jobs = []
    for made in MADE:
        template = base / f"template-{made.name}"
        make_checkpoint(template, SynthSpec(source_format=made.template_format(), hidden=made.hidden,
                                            intermediate=made.intermediate))
        jobs.append({"template": str(template), "out": str(base / made.name), "packer": made.packer,
                     "bits": made.bits, "group_size": made.group_size, "sym": made.sym, "v2": made.v2, "seed": 7})
    (base / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([str(python), str(ROOT / "tests" / "packers" / "make_moe.py"), str(base / "jobs.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"tests/packers/make_moe.py failed (exit {proc.returncode})\n{proc.stderr[-4000:]}", pytrace=False)
    return {made.name: base / made.name for made in MADE}


def _relabel(src: Path, dst: Path, **changes) -> Path:
    """A copy of `src` whose configs say `changes` (the tensors are untouched)."""
    dst.mkdir()
    for path in src.iterdir():
        if path.name in ("config.json", "quantize_config.json"):
            config = json.loads(path.read_text())
            section = config["quantization_config"] if path.name == "config.json" else config
            section.update(changes)
            if "checkpoint_format" in changes:
                section["format"] = changes["checkpoint_format"]
            (dst / path.name).write_text(json.dumps(config))
        else:
            shutil.copy2(path, dst / path.name)  # a link out of the folder would be refused
    return dst


def _truth(src: Path) -> dict[str, torch.Tensor]:
    return load_file(str(src.parent / f"{src.name}.truth.safetensors"))


def _assert_plan_reads_truth(source: Path, truth: dict[str, torch.Tensor], trust: str | None) -> int:
    """The canonical form the plan decodes every expert linear to equals the quantizer's truth."""
    plan = make_plan(source, backend="triton", trust=trust)
    checked = 0
    with TensorReader() as reader:
        for layer in plan.layers:
            for expert in layer.experts:
                for linear in expert.values():
                    prefix = next(iter(linear.values())).name.rsplit(".", 1)[0]
                    weight = plan.codec.decode_source({s: reader.read_raw(e) for s, e in linear.items()})
                    assert np.array_equal(weight.codes, truth[f"{prefix}.codes"].numpy()), prefix
                    assert np.array_equal(weight.effective_zeros(), truth[f"{prefix}.zeros"].numpy()), prefix
                    assert np.array_equal(weight.scales.view(np.int16), truth[f"{prefix}.scales"].view(torch.int16).numpy())
                    checked += 1
    return checked


def _output_zeros(output: Path) -> dict[str, torch.Tensor]:
    """The true zero points the converted (triton) output holds, per source linear prefix."""
    plan = make_plan(json.loads((output / "moeconv.json").read_text())["source"]["path"], backend="triton",
                     trust=json.loads((output / "moeconv.json").read_text())["arguments"].get("trust"))
    converted = open_checkpoint(output)
    found = {}
    with TensorReader() as reader:
        for layer in plan.layers:
            for job, expert in zip(plan.layer_jobs[layer.module], layer.experts):
                slices = {suffix: reader.read_raw_slice(converted.tensors[slot.tensor.name], slot.offset, slot.shape)
                          for suffix, slot in job.slots.items()}
                decoded = plan.backend.decode_expert(slices, layer.shape)
                for projection, linear in expert.items():
                    prefix = next(iter(linear.values())).name.rsplit(".", 1)[0]
                    found[prefix] = torch.from_numpy(getattr(decoded, projection).effective_zeros())
    return found


@pytest.mark.parametrize("name", [made.name for made in MADE])
def test_correctly_labelled_checkpoints_are_detected_and_read_exactly(made, name):
    """Zero false refusals: the detection agrees with the packer's own label and decides every
    question it asks; the decoded experts are the quantizer's codes, zero points and scales."""
    report = moeconv.inspect(made[name])
    detection = report["detection"]
    assert detection["disagreements"] == [], detection
    assert detection["undecided"] == [], detection
    assert detection["detected"] == report["config_format"], detection
    assert _assert_plan_reads_truth(made[name], _truth(made[name]), trust=None) == 2 * 4 * 3


@pytest.mark.parametrize("name", ASYM_GPTQ)
def test_relabelled_checkpoint_format_is_refused_and_trust_flags_choose(made, name, tmp_path, capsys):
    src = made[name]
    other = "gptq" if BY_NAME[name].v2 else "gptq_v2"
    lying = _relabel(src, tmp_path / "lying", checkpoint_format=other)
    code, _, err = run_main(capsys, "convert", lying, "-o", tmp_path / "refused", "--backend", "triton")
    assert code == 2, err
    assert "checkpoint_format" in err and "--trust-data" in err
    assert not (tmp_path / "refused").exists()
    # --trust-data: the tensors' reading, i.e. the quantizer's true zero points, also in the output.
    _assert_plan_reads_truth(lying, _truth(src), trust="data")
    assert run_main(capsys, "convert", lying, "-o", tmp_path / "data", "--trust-data", "-q")[0] == 0
    zeros = _output_zeros(tmp_path / "data")
    truth = _truth(src)
    assert all(torch.equal(value, truth[f"{prefix}.zeros"]) for prefix, value in zeros.items())
    assert run_main(capsys, "verify", tmp_path / "data")[0] == 0
    # --trust-config: converted as labelled (every zero off by one), and verify does not certify it.
    assert run_main(capsys, "convert", lying, "-o", tmp_path / "config", "--trust-config", "-q")[0] == 0
    zeros = _output_zeros(tmp_path / "config")
    shift = 1 if other == "gptq" else -1  # v1 adds one to the stored zeros, v2 does not
    interior = [(value.int(), truth[f"{p}.zeros"].int()) for p, value in zeros.items()]
    assert all(bool(((got - want) == shift)[(want > 0) & (want < 2 ** BY_NAME[name].bits - 1)].all())
               for got, want in interior)
    code, out, err = run_main(capsys, "verify", tmp_path / "config")
    assert code == 1, out + err
    assert "contradict" in out + err and "checkpoint_format" in out + err


@pytest.mark.parametrize("name", ASYM_GPTQ[:3])
def test_symmetric_label_over_asymmetric_data_is_refused(made, name, tmp_path, capsys):
    lying = _relabel(made[name], tmp_path / "lying", sym=True)
    code, _, err = run_main(capsys, "convert", lying, "-o", tmp_path / "out", "--backend", "triton")
    assert code == 2, err
    assert "sym=True" in err and "sym=False" in err
    _assert_plan_reads_truth(lying, _truth(made[name]), trust="data")
    assert run_main(capsys, "convert", lying, "-o", tmp_path / "config", "--trust-config", "-q")[0] == 0
    code, out, err = run_main(capsys, "verify", tmp_path / "config")
    assert code == 1 and "sym" in out + err, out + err


def test_asymmetric_label_over_symmetric_data_is_refused(made, tmp_path, capsys):
    lying = _relabel(made["gptqmodel-4bit-g32-sym"], tmp_path / "lying", sym=False)
    code, _, err = run_main(capsys, "convert", lying, "-o", tmp_path / "out")
    assert code == 2 and "sym=False" in err, err
    _assert_plan_reads_truth(lying, _truth(made["gptqmodel-4bit-g32-sym"]), trust="data")


@pytest.mark.parametrize("value", ["false", "true", 0, 1.0])
def test_sym_that_is_not_a_boolean_is_an_error(made, tmp_path, value, capsys):
    lying = _relabel(made[ASYM_GPTQ[0]], tmp_path / "lying", sym=value)
    code, _, err = run_main(capsys, "inspect", lying)
    assert code == 2, err
    assert f"sym must be true or false, not {value!r}" in err
    assert len(err.strip().splitlines()) == 1


CT_READBACK = ("gptqmodel-4bit-g32-asym", "gptqmodel-4bit-g32-asym-v2", "autogptq-4bit-g32-asym",
               "gptqmodel-8bit-g64-asym", "gptqmodel-4bit-cw-asym", "autoawq-4bit-g64-asym", "ct-4bit-g64-asym",
               "gptqmodel-4bit-g32-sym")


@pytest.fixture(scope="module")
def ct_read_back(made, tmp_path_factory) -> dict[str, tuple[Path, Path, dict]]:
    """name -> (its compressed-tensors output, the producer's truth, what the real compressed-tensors library read
    from the output): every checkpoint of CT_READBACK converted, then read back in one .venv-packers process."""
    root = tmp_path_factory.mktemp("ct-read-back")
    cases = {name: (moeconv.convert(made[name], root / name, backend="compressed-tensors").output,
                    made[name].parent / f"{made[name].name}.truth.safetensors") for name in CT_READBACK}
    proc = subprocess.run([str(PACKERS_VENV / "bin" / "python"), str(ROOT / "tests" / "packers" / "ct_readback.py"),
                           *[str(path) for pair in cases.values() for path in pair]], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {answer["output"]: answer for answer in map(json.loads, proc.stdout.splitlines()[-len(cases):])}
    return {name: (out, truth, results[str(out)]) for name, (out, truth) in cases.items()}


@pytest.mark.parametrize("name", CT_READBACK)
def test_compressed_tensors_output_read_back_by_the_real_library(ct_read_back, name, capsys):
    """Real packer in, real compressed-tensors out: the library's own validator accepts the output's
    config, and its unpacker and decompressor give the producer's quantizer's codes, TRUE zero points
    and dequantized weights for every linear (GPTQ v1 zeros included: no off-by-one)."""
    out, truth, result = ct_read_back[name]
    assert run_main(capsys, "verify", out, "--numerics-layers", "1")[0] == 0
    assert result["problems"] == [] and result["checked"] == len(load_file(str(truth))) // 3
    assert result["format"] == "pack-quantized"
