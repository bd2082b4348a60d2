"""Checkpoints made by the REAL llm-compressor (0.12.0, compressed-tensors 0.17.1, transformers 5.10.1)
from a Qwen3-MoE whose experts are fused 3-D tensors in memory and on disk (tests/data/llmc_fused/,
made by tests/packers/make_llmc_fused.py). llm-compressor unfuses the experts into per-expert linears
before quantizing (gate = gate_up_proj[e, :I], up = gate_up_proj[e, I:]); its config names the expert
count num_local_experts, as transformers 5 writes it. moeconv must read them as they are, convert
them to every backend bit-exactly, and its decoding must reproduce the ORIGINAL float experts within
the quantizer's rounding (an anchor outside moeconv: the float weights the quantizer was given)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import moeconv
from moeconv.backends import REGISTRY
from moeconv.checkpoint.reader import TensorReader
from moeconv import transform
from moeconv.packing import as_float32
from moeconv.plan import make_plan

DATA = Path(__file__).parent / "data" / "llmc_fused"


@pytest.mark.parametrize("variant", ["sym", "asym"])
def test_decoding_reproduces_the_float_experts_the_quantizer_was_given(variant):
    plan = make_plan(DATA / variant, backend="triton")
    floats = load_file(str(DATA / variant / "float_experts.safetensors"))
    intermediate = plan.layers[0].shape.intermediate
    checked = 0
    with TensorReader() as reader:
        for layer in plan.layers:
            gate_up, down = (floats[f"{layer.module}.{name}"].float() for name in ("gate_up_proj", "down_proj"))
            for job in plan.layer_jobs[layer.module]:
                weights, _ = transform.source_weights(job, plan.codec, reader)
                originals = {"gate": gate_up[job.expert, :intermediate], "up": gate_up[job.expert, intermediate:],
                             "down": down[job.expert]}
                for projection, weight in weights.items():
                    step = torch.from_numpy(np.repeat(as_float32(weight.scales), weight.group_size, axis=1))
                    error = (torch.from_numpy(weight.dequantize(np.float32)) - originals[projection]).abs() / step
                    # round-to-nearest is within half a step; compressed-tensors computes in bf16 (0.55 measured)
                    assert float(error.max()) < 0.6, (layer.module, job.expert, projection, float(error.max()))
                    checked += 1
    assert checked == 2 * 4 * 3


@pytest.mark.parametrize("backend", list(REGISTRY))
@pytest.mark.parametrize("variant", ["sym", "asym"])
def test_every_backend_converts_the_real_checkpoint_bit_exactly(tmp_path, variant, backend):
    moeconv.convert(DATA / variant, tmp_path / "out", backend=backend)
    report = moeconv.verify(tmp_path / "out", numerics_layers=1)
    assert report.ok, report.failures()
    assert all(layer.experts_exact == layer.experts_checked == 4 for layer in report.layers)
