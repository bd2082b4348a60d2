"""Pack chosen codes/zeros/scales with the REAL packers and save packed + intended tensors.

Runs in .venv-packers (scripts/install-packers.sh), never in the main venv:

    .venv-packers/bin/python tests/packers/pack_real.py OUT.safetensors
    .venv-packers/bin/python tests/packers/pack_real.py --self-check
    .venv-packers/bin/python tests/packers/pack_real.py --compressed-tensors OUT.safetensors

For every case in cases.py: draw codes (N, K), true zeros (N, G) and scales (N, G) from the case's
seed; build the float weight W = (codes − zeros) · scales so that the packer's own arithmetic,
round((W + zeros·scales) / scales), gives back exactly those codes (the packers do not clamp, or
clamp silently); let the packer pack it; save, under "<case>.<tensor>":
  codes, zeros, scales          what we meant (uint8, uint8, float16), in moeconv's canonical layout
  qweight, qzeros, pscales, g_idx  what the packer produced (pscales: the packer's scales tensor)
  qzeros_v2                     GPTQModel only: qzeros before its v2 -> v1 conversion
With --compressed-tensors only the CT_CASES are packed, by compressed-tensors' own compressors
(quantize with the given scales and signed zero points, then pack_to_int32), and saved as the
compressor returns them (weight_packed, weight_scale, weight_shape, weight_zero_point / weight) plus
`unpacked`, compressed-tensors' unpack_from_int32 of weight_packed (signed int8).
The file's metadata holds the case list and the packer versions as JSON.

The packages are imported without running their heavy package __init__ (AutoAWQ's needs datasets and
transformers <= 4.51; auto-gptq's needs peft, rouge, gekko, ...), so only the modules that pack are imported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # pure-Python pack path, no native build
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import (  # noqa: E402
    ACT_ORDER_NAME,
    AUTOAWQ,
    AUTOGPTQ,
    AUTOGPTQ_OLD,
    CASES,
    CT_CASES,
    CT_INT,
    GPTQMODEL,
    ZERO0_SLOTS,
    Case,
)

PACKAGES = ("autoawq", "auto-gptq", "gptqmodel", "compressed-tensors", "transformers", "torch", "numpy")


def _stub_package(name: str) -> None:
    """Make `import name.sub` work without executing name/__init__.py."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed in {sys.prefix}; run scripts/install-packers.sh")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    sys.modules[name] = module


def import_packers() -> dict:
    _stub_package("awq")
    from awq.modules.linear.gemm import WQLinear_GEMM

    import transformers  # noqa: F401  (auto_gptq's qlinear modules use transformers.pytorch_utils)

    _stub_package("auto_gptq")
    from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear as AutoGPTQLinear
    from auto_gptq.nn_modules.qlinear.qlinear_cuda_old import QuantLinear as AutoGPTQOldLinear

    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

    return {
        "WQLinear_GEMM": WQLinear_GEMM,
        "AutoGPTQLinear": AutoGPTQLinear,
        "AutoGPTQOldLinear": AutoGPTQOldLinear,
        "TorchLinear": TorchLinear,
        "convert_v2_to_v1": convert_gptq_v2_to_v1_format_module,
    }


# ----------------------------------------------------------------------------------- the numbers


def choose(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 (N, K), true zeros uint8 (N, G), scales float16 (N, G)."""
    gen = torch.Generator().manual_seed(case.seed)
    n, k, groups, top = case.n, case.k, case.groups, (1 << case.bits) - 1
    per_word = 32 // case.bits

    codes = torch.randint(0, top + 1, (n, k), generator=gen, dtype=torch.int64)
    codes[:, 0] = 0  # both ends of the range in every row, and in a packed word's first/last slot
    codes[:, 1] = top
    codes[:, per_word - 1] = top
    codes[:, per_word] = 0

    if case.zeros == "sym":
        zeros = torch.full((n, groups), 1 << (case.bits - 1), dtype=torch.int64)
    else:
        low = 0 if case.zeros == "full" else 1
        zeros = torch.randint(low, top + 1, (n, groups), generator=gen, dtype=torch.int64)
        # qzeros pack along N: force the edge values into the first and last slots of packed words.
        zeros[0, :] = low
        zeros[per_word - 1, :] = top
        zeros[per_word, :] = top
        zeros[2 * per_word - 1, :] = low  # (GPTQModel, low 0) borrows out of the top of the word
        if case.zeros == "zero0":
            for group, column in ZERO0_SLOTS[case.bits]:
                if group < groups:
                    zeros[column, group] = 0

    # Scales m · 2^e with a 2-bit mantissa: (codes − zeros) · s then needs at most 8 + 3 significant
    # bits, exact in float16, so every packer's round((W + z·s) / s) recovers the codes exactly.
    mantissa = torch.tensor([1.0, 1.25, 1.5, 1.75])[torch.randint(0, 4, (n, groups), generator=gen)]
    exponent = torch.randint(-10, -3, (n, groups), generator=gen).to(torch.float32)
    scales = (mantissa * torch.exp2(exponent)).to(torch.float16)
    return codes.to(torch.uint8), zeros.to(torch.uint8), scales


def float_weight(case: Case, codes, zeros, scales, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """(codes − zero) · scale per input channel, each channel in group g_idx[k] (default k // g)."""
    if g_idx is None:
        g_idx = torch.arange(case.k) // (case.k // case.groups)
    z = zeros.to(torch.float32)[:, g_idx.long()]
    s = scales.to(torch.float32)[:, g_idx.long()]
    w32 = (codes.to(torch.float32) - z) * s
    w = w32.to(torch.float16)
    if not torch.equal(w.to(torch.float32), w32):
        raise AssertionError(f"{case.name}: the float16 weight is not exact")
    # The packers' arithmetic, in float16 (AutoAWQ) and float32 (AutoGPTQ, GPTQModel with float zeros).
    for dtype in (torch.float16, torch.float32):
        back = torch.round((w.to(dtype) + z.to(dtype) * s.to(dtype)) / s.to(dtype))
        if not torch.equal(back, codes.to(dtype)):
            raise AssertionError(f"{case.name}: round((W + z·s)/s) does not recover the codes in {dtype}")
    return w


def linear_of(w: torch.Tensor) -> nn.Linear:
    n, k = w.shape
    linear = nn.Linear(k, n, bias=False, dtype=torch.float16)
    with torch.no_grad():
        linear.weight.copy_(w)
    return linear


# ----------------------------------------------------------------------------------- the packers


def pack_case(case: Case, api: dict, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    codes, zeros, scales = choose(case)
    w = float_weight(case, codes, zeros, scales, g_idx)
    g = case.k // case.groups
    linear = linear_of(w)
    if g_idx is None:
        g_idx = torch.arange(case.k, dtype=torch.int32) // g
    out = {"codes": codes, "zeros": zeros, "scales": scales}

    if case.packer == AUTOAWQ:
        # from_linear takes scales and zeros as (G, N) and works in the scales' dtype (float16).
        q = api["WQLinear_GEMM"].from_linear(
            linear, case.bits, g, scales=scales.T.contiguous(), zeros=zeros.T.contiguous().to(torch.float16)
        )
        out.update(qweight=q.qweight, qzeros=q.qzeros, pscales=q.scales)
    elif case.packer in (AUTOGPTQ, AUTOGPTQ_OLD):
        cls = api["AutoGPTQLinear"] if case.packer == AUTOGPTQ else api["AutoGPTQOldLinear"]
        q = cls(case.bits, case.group_size, case.k, case.n, bias=False)
        # As AutoGPTQ's own quantizer hands them over: float32 scales and zeros, (N, G).
        q.pack(linear, scales.to(torch.float32), zeros.to(torch.float32), g_idx)
        out.update(qweight=q.qweight, qzeros=q.qzeros, pscales=q.scales, g_idx=getattr(q, "g_idx", g_idx))
    elif case.packer == GPTQMODEL:
        q = api["TorchLinear"](
            bits=case.bits,
            group_size=case.group_size,
            sym=case.sym,
            desc_act=False,
            in_features=case.k,
            out_features=case.n,
            bias=False,
        )
        q.pack_block(linear, scales, zeros.to(torch.float16), g_idx)
        out["qzeros_v2"] = q.qzeros.clone()
        # The conversion reads only bits and pack_dtype from its config (a real QuantizeConfig would
        # also make a scratch offload folder per call).
        config = types.SimpleNamespace(bits=case.bits, pack_dtype=torch.int32)
        api["convert_v2_to_v1"](q, config)
        out.update(qweight=q.qweight, qzeros=q.qzeros, pscales=q.scales, g_idx=q.g_idx)
    else:
        raise ValueError(case.packer)
    return {key: value.detach().contiguous().clone() for key, value in out.items()}


def pack_act_order(api: dict) -> dict[str, torch.Tensor]:
    """AutoGPTQ qlinear_cuda with a permuted g_idx (desc_act=true), the float weight made with that
    grouping (channel k in group g_idx[k]): moeconv must read it as a linear with permuted inputs."""
    case = Case(AUTOGPTQ, 4, 64, "nonzero", seed=7)
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(case.k, generator=gen)
    g_idx = (perm // 64).to(torch.int32)
    return pack_case(case, api, g_idx=g_idx)


def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in PACKAGES}


def pack_compressed_tensors(case: Case) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    codes, zeros, scales = choose(case)
    offset = 1 << (case.bits - 1)
    strategy = {"strategy": "channel"} if case.group_size == -1 else {"strategy": "group", "group_size": case.group_size}
    weights = QuantizationArgs(num_bits=case.bits, symmetric=case.sym, **strategy)
    state = {"weight": float_weight(case, codes, zeros, scales), "weight_scale": scales,
             "weight_zero_point": (zeros.to(torch.int16) - offset).to(torch.int8)}  # signed, as CT's observers make
    if case.packer == CT_INT:
        tokens = QuantizationArgs(num_bits=8, symmetric=True, strategy="token", dynamic=True)
        out = IntQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=weights,
                                                                           input_activations=tokens))
    else:
        out = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=weights))
        out["unpacked"] = unpack_from_int32(out["weight_packed"], case.bits, torch.Size((case.n, case.k)))
    out.update(codes=codes, zeros=zeros, scales=scales)
    return {key: value.detach().contiguous().clone() for key, value in out.items() if value is not None}


def pack_all_compressed_tensors(path: Path) -> None:
    tensors = {f"{case.name}.{key}": value for case in CT_CASES for key, value in pack_compressed_tensors(case).items()}
    metadata = {"cases": json.dumps([case.to_json() for case in CT_CASES]), "versions": json.dumps(versions())}
    save_file(tensors, str(path), metadata=metadata)


def pack_all(path: Path) -> None:
    api = import_packers()
    tensors: dict[str, torch.Tensor] = {}
    for case in CASES:
        for key, value in pack_case(case, api).items():
            tensors[f"{case.name}.{key}"] = value
    for key, value in pack_act_order(api).items():
        tensors[f"{ACT_ORDER_NAME}.{key}"] = value
    metadata = {
        "cases": json.dumps([case.to_json() for case in CASES]),
        "versions": json.dumps(versions()),
    }
    save_file(tensors, str(path), metadata=metadata)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="safetensors file to write")
    parser.add_argument("--self-check", action="store_true", help="pack every case into a scratch file")
    parser.add_argument("--compressed-tensors", action="store_true", help="pack only the compressed-tensors cases")
    args = parser.parse_args()
    if args.self_check:
        with tempfile.TemporaryDirectory() as scratch:
            pack_all(Path(scratch) / "packed.safetensors")
            pack_all_compressed_tensors(Path(scratch) / "ct.safetensors")
        print("pack_real: OK", json.dumps(versions()))
    elif args.out is not None:
        (pack_all_compressed_tensors if args.compressed_tensors else pack_all)(args.out)
    else:
        parser.error("give an output file or --self-check")


if __name__ == "__main__":
    main()
