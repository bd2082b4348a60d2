"""`convert --device`: where the experts are transformed. The bytes must not depend on it: on a GPU
every (source format, backend) pair is converted on both and compared file by file; without one,
asking for cuda is a one-line refusal and the default is the CPU."""

from __future__ import annotations

import pytest
import torch

import moeconv
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import run_main

GPU = torch.cuda.is_available()
SOURCES = {
    "gptq4-asym": GPTQ(4, 32, sym=False),
    "gptq8-sym": GPTQ(8, 64, sym=True),
    "awq4": AWQ(4, 32),
    "ct-w4a16-asym": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w8a8": CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
}
BACKENDS = ("triton", "humming", "cpu", "compressed-tensors")


def _files(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.skipif(GPU, reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_in_one_line(tmp_path, capsys):
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--device", "cuda", "-q")
    assert code == 2 and "--device cuda: no CUDA GPU is visible" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    report = moeconv.convert(source, tmp_path / "default", workers=2)
    assert report.device == "cpu"


def test_an_unknown_device_is_refused(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    with pytest.raises(MoeconvError, match="--device tpu: choose cpu, cuda or cuda:N"):
        moeconv.convert(source, tmp_path / "out", device="tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SOURCES)
def test_the_gpu_writes_the_bytes_the_cpu_writes(tmp_path, name, backend):
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=SOURCES[name], hidden=256, intermediate=128,
                                                         experts=8, layers=2))
    try:
        on_cpu = moeconv.convert(source, tmp_path / "cpu", backend=backend, device="cpu", workers=2)
    except MoeconvError as error:  # a pair the backend does not take (e.g. the cpu backend's W8A8 groups)
        pytest.skip(str(error))
    on_gpu = moeconv.convert(source, tmp_path / "gpu", backend=backend, device="cuda", workers=2)
    assert on_cpu.device == "cpu" and on_gpu.device.startswith("cuda")
    assert _files(tmp_path / "cpu") == _files(tmp_path / "gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_a_process_that_already_uses_cuda_converts_on_it(tmp_path):
    torch.zeros(1, device="cuda")  # this process's CUDA is initialised: forked workers could not use it
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=False), hidden=256,
                                                         intermediate=128, experts=8, layers=2))
    on_gpu = moeconv.convert(source, tmp_path / "gpu", device="cuda", workers=4)
    on_cpu = moeconv.convert(source, tmp_path / "cpu", device="cpu", workers=1)
    assert on_cpu.device == "cpu" and on_gpu.device.startswith("cuda")
    assert _files(tmp_path / "cpu") == _files(tmp_path / "gpu")


def test_spawned_device_workers_write_the_bytes_forked_ones_write(tmp_path, monkeypatch):
    """The device path's plumbing (spawned workers, tensors handed over to a default device and
    back) without a GPU: the CPU named as the device."""
    import importlib

    convert_module = importlib.import_module("moeconv.convert")
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=False), hidden=256,
                                                         intermediate=128, experts=8, layers=2))
    moeconv.convert(source, tmp_path / "forked", backend="humming", workers=2, device="cpu")
    monkeypatch.setattr(convert_module, "resolve_device", lambda requested: "cpu")
    spawned = moeconv.convert(source, tmp_path / "spawned", backend="humming", workers=2, device="cpu")
    assert spawned.device == "cpu (cpu)"
    assert _files(tmp_path / "forked") == _files(tmp_path / "spawned")
