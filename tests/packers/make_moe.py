"""Re-quantize and re-pack every quantized linear of a small MoE checkpoint with the REAL quantizer and packer.

Runs in .venv-packers (scripts/install-packers.sh), never in the main venv:

    .venv-packers/bin/python tests/packers/make_moe.py JOBS.json

JOBS.json is a list of {"template", "out", "packer", "bits", "group_size", "sym", "v2", "seed"}, packer one
of gptqmodel, autogptq, autoawq, ct (compressed-tensors pack-quantized). `template` is a checkpoint
folder of the same format (moeconv's synth makes one in the main venv): it supplies the
tensor names, shapes, the non-quantized tensors and the configs. For every `*.qweight` linear this
script draws a roughly zero-mean float weight W (N, K) (Gaussian, seeded by the tensor name) and does
what a GPTQ producer's round-to-nearest path does, with the producer's OWN code:

  * the producer's own scale and zero-point rule per group: GPTQ's `Quantizer.find_params` (min/max,
    the range clamped to include 0, zero = round(-min / scale); symmetric: zero = 2^(b-1)), AutoAWQ's
    `AwqQuantizer.pseudo_quantize_tensor`, compressed-tensors' `calculate_qparams`; scales as float16;
  * codes q = clamp(round(W / s) + z, 0, 2^b - 1), the dequantized (q - z) * s handed to the packer's
    `pack` (as GPTQ hands its quantized weight over), exact in float32;
  * GPTQModel: `TorchLinear.pack_block` (v2 zeros), then, unless `v2`, its own
    `convert_gptq_v2_to_v1_format_module` (v1 zeros); auto-gptq: `qlinear_cuda.QuantLinear.pack` (v1);
    AutoAWQ: `WQLinear_GEMM.from_linear`; compressed-tensors: `PackedQuantizationCompressor.compress`.

The output folder holds the re-packed checkpoint with the config labelled as the producer labels it
(checkpoint_format "gptq" or "gptq_v2", `sym`); `<out>.truth.safetensors`, beside it, holds what the
quantizer meant for every linear: `<prefix>.codes` uint8 (N, K), `<prefix>.zeros` uint8 (N, G) (true
zero points), `<prefix>.scales` float16 (N, G). moeconv's tests compare their decoding with it.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
import zlib
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pack_real import _stub_package  # noqa: E402

WEIGHT_STD = 0.02


def _gptq_quantizer(packer: str, bits: int, sym: bool):
    if packer == "gptqmodel":
        from gptqmodel.quantization.quantizer import Quantizer

        quantizer = Quantizer(types.SimpleNamespace(bits=bits, sym=sym, mse=0.0))
        quantizer.configure(perchannel=True)
        return quantizer
    _stub_package("auto_gptq")
    from auto_gptq.quantization.quantizer import Quantizer

    quantizer = Quantizer()
    quantizer.configure(bits, perchannel=True, sym=sym, mse=False)
    return quantizer


def _group_params(w: torch.Tensor, job: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (N, G) float32 and zero points (N, G) float32 as the producer's own quantizer sets them.
    compressed-tensors' zero points come back signed; they are shifted to the unsigned code range."""
    n, k = w.shape
    g = k if job["group_size"] == -1 else job["group_size"]
    groups = w.reshape(n, k // g, g)
    if job["packer"] == "autoawq":
        _stub_package("awq")
        # awq.quantize.quantizer imports its calibration-data loader (which needs `datasets`) at the top;
        # the min/max rule used here never calls it.
        sys.modules.setdefault("awq.utils.calib_data", types.SimpleNamespace(get_calib_dataset=None))
        from awq.quantize.quantizer import AwqQuantizer

        state = types.SimpleNamespace(group_size=g, zero_point=not job["sym"], w_bit=job["bits"])
        _, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(state, w)
        return scales.float(), zeros.float()
    if job["packer"] == "ct":
        from compressed_tensors.quantization.utils.helpers import calculate_qparams

        scales, zero_points = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), _ct_args(job))
        return scales.float(), zero_points.float() + (1 << (job["bits"] - 1))
    quantizer = _gptq_quantizer(job["packer"], job["bits"], job["sym"])
    scales, zeros = [], []
    for start in range(0, k, g):
        quantizer.find_params(w[:, start:start + g], weight=True)
        scales.append(quantizer.scale.reshape(n).clone())
        zeros.append(quantizer.zero.reshape(n).clone())
    return torch.stack(scales, dim=1), torch.stack(zeros, dim=1)


def _ct_args(job: dict):
    from compressed_tensors.quantization import QuantizationArgs

    strategy = {"strategy": "channel"} if job["group_size"] == -1 else {"strategy": "group",
                                                                        "group_size": job["group_size"]}
    return QuantizationArgs(num_bits=job["bits"], symmetric=job["sym"], **strategy)


def quantize(w: torch.Tensor, job: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 (N, K), true zeros uint8 (N, G), scales float16 (N, G), by the producer's quantizer;
    symmetric AWQ and compressed-tensors have the implicit zero 2^(b-1)."""
    n, k = w.shape
    g = k if job["group_size"] == -1 else job["group_size"]
    scales, zeros = _group_params(w, job)
    if zeros is None:
        zeros = torch.full_like(scales, 1 << (job["bits"] - 1))
    scales16 = scales.to(torch.float16)
    top = (1 << job["bits"]) - 1
    s = scales16.float().repeat_interleave(g, dim=1)
    z = torch.round(zeros).repeat_interleave(g, dim=1)
    codes = torch.clamp(torch.round(w / s) + z, 0, top)
    return codes.to(torch.uint8), torch.round(zeros).to(torch.uint8), scales16


def pack(job: dict, codes, zeros, scales16) -> dict[str, torch.Tensor]:
    n, k = codes.shape
    g = k if job["group_size"] == -1 else job["group_size"]
    s = scales16.float().repeat_interleave(g, dim=1)
    dequantized = (codes.float() - zeros.float().repeat_interleave(g, dim=1)) * s  # exact in float32
    linear = nn.Linear(k, n, bias=False, dtype=torch.float32)
    with torch.no_grad():
        linear.weight.copy_(dequantized)
    g_idx = torch.arange(k, dtype=torch.int32) // g
    if job["packer"] == "autoawq":
        from awq.modules.linear.gemm import WQLinear_GEMM

        q = WQLinear_GEMM.from_linear(linear, job["bits"], g, scales=scales16.float().T.contiguous(),
                                      zeros=zeros.float().T.contiguous())
        return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": scales16.T.contiguous()}
    if job["packer"] == "ct":
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationScheme

        offset = 1 << (job["bits"] - 1)
        state = {"weight": dequantized, "weight_scale": scales16,
                 "weight_zero_point": (zeros.to(torch.int16) - offset).to(torch.int8)}
        out = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=_ct_args(job)))
        return {key: value for key, value in out.items() if value is not None and
                (key != "weight_zero_point" or not job["sym"])}
    if job["packer"] == "gptqmodel":
        from gptqmodel.nn_modules.qlinear.torch import TorchLinear
        from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

        q = TorchLinear(bits=job["bits"], group_size=job["group_size"], sym=job["sym"], desc_act=False,
                        in_features=k, out_features=n, bias=False)
        q.pack_block(linear, scales16.float(), zeros.float(), g_idx)
        if not job["v2"]:
            convert_gptq_v2_to_v1_format_module(q, types.SimpleNamespace(bits=job["bits"], pack_dtype=torch.int32))
    else:
        import transformers  # noqa: F401  (auto_gptq's qlinear modules use transformers.pytorch_utils)

        _stub_package("auto_gptq")
        from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear

        q = QuantLinear(job["bits"], job["group_size"], k, n, bias=False)
        q.pack(linear, scales16.float(), zeros.float(), g_idx)
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": scales16.T.contiguous(), "g_idx": g_idx}


QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape",
                      "weight_zero_point")


def _linear_size(handle, name: str, job: dict) -> tuple[int, int]:
    """(N, K) of the template linear whose packed weight is `name`."""
    rows, columns = handle.get_slice(name).get_shape()
    if job["packer"] == "autoawq":
        return columns * 8, rows
    if job["packer"] == "ct":
        return rows, columns * 32 // job["bits"]
    return columns, rows * 32 // job["bits"]


def make(job: dict) -> None:
    template, out = Path(job["template"]), Path(job["out"])
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(template, out, ignore=shutil.ignore_patterns("*.safetensors"))
    truth = {}
    for shard in sorted(template.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(shard), "pt") as handle:
            names = list(handle.keys())
            packed = "weight_packed" if job["packer"] == "ct" else "qweight"
            for name in names:
                if name.rsplit(".", 1)[-1] not in QUANTIZED_SUFFIXES:
                    tensors[name] = handle.get_tensor(name)
            for name in names:
                if not name.endswith(f".{packed}"):
                    continue
                prefix = name.removesuffix(f".{packed}")
                n, k = _linear_size(handle, name, job)
                gen = torch.Generator().manual_seed(job["seed"] * 1_000_003 + zlib.crc32(prefix.encode()))
                w = torch.randn(n, k, generator=gen) * WEIGHT_STD
                codes, zeros, scales16 = quantize(w, job)
                for suffix, value in pack(job, codes, zeros, scales16).items():
                    tensors[f"{prefix}.{suffix}"] = value.detach().contiguous().clone()
                truth.update({f"{prefix}.codes": codes, f"{prefix}.zeros": zeros, f"{prefix}.scales": scales16})
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
    save_file(truth, str(out.parent / f"{out.name}.truth.safetensors"))
    if job["packer"] in ("autoawq", "ct"):
        return  # the template's config already says what these packers write
    label = {"checkpoint_format": "gptq_v2" if job["v2"] else "gptq", "format": "gptq_v2" if job["v2"] else "gptq",
             "bits": job["bits"], "group_size": job["group_size"], "sym": job["sym"], "desc_act": False,
             "quant_method": "gptq"}
    for name in ("config.json", "quantize_config.json"):
        path = out / name
        if not path.exists():
            continue
        config = json.loads(path.read_text())
        section = config["quantization_config"] if name == "config.json" else config
        section.update(label)
        path.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    for job in json.loads(Path(sys.argv[1]).read_text()):
        make(job)
    print("make_moe: OK")


if __name__ == "__main__":
    main()
