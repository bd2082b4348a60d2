"""Read a moeconv `--backend compressed-tensors` output back with the REAL compressed-tensors library.

Runs in .venv-packers:

    .venv-packers/bin/python tests/packers/ct_readback.py OUT TRUTH.safetensors [OUT TRUTH.safetensors ...]

The output's quantization_config goes through compressed-tensors' own `QuantizationConfig` validator;
every linear of TRUTH (`<prefix>.codes`, `.zeros`, `.scales`: what the producer's quantizer meant, see
make_moe.py) is read from OUT with the library's `unpack_from_int32` and decompressed with its
`PackedQuantizationCompressor.decompress`. Prints one JSON line per pair (one process for many outputs: the
library's import is most of the time): the output, how many linears were checked and every mismatch (codes, zero points, or the dequantized weight against (codes − zeros) · scales
computed in the scale dtype, as compressed-tensors computes it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from safetensors.torch import load_file


def main() -> None:
    pairs = sys.argv[1:]
    if not pairs or len(pairs) % 2:
        sys.exit("usage: ct_readback.py OUT TRUTH.safetensors [OUT TRUTH.safetensors ...]")
    for out, truth_path in zip(pairs[::2], pairs[1::2]):
        print(json.dumps({"output": out, **read_back(Path(out), Path(truth_path))}), flush=True)


def read_back(out: Path, truth_path: Path) -> dict:
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    args = scheme.weights
    offset = 1 << (args.num_bits - 1)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    truth = load_file(str(truth_path))
    prefixes = sorted(name.removesuffix(".codes") for name in truth if name.endswith(".codes"))
    checked, problems = 0, []
    for prefix in prefixes:
        tensors = {}
        for suffix in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
            name = f"{prefix}.{suffix}"
            if name in index:
                with safe_open(str(out / index[name]), "pt") as handle:
                    tensors[suffix] = handle.get_tensor(name)
        codes, zeros, scales = truth[f"{prefix}.codes"], truth[f"{prefix}.zeros"], truth[f"{prefix}.scales"]
        n, k = codes.shape
        unpacked = unpack_from_int32(tensors["weight_packed"], args.num_bits, torch.Size((n, k)))
        if not torch.equal(unpacked.to(torch.int16) + offset, codes.to(torch.int16)):
            problems.append(f"{prefix}: codes")
        if "weight_zero_point" in tensors:
            zero_points = unpack_from_int32(tensors["weight_zero_point"], args.num_bits, torch.Size(zeros.shape),
                                            packed_dim=0)
            if not torch.equal(zero_points.to(torch.int16) + offset, zeros.to(torch.int16)):
                problems.append(f"{prefix}: zero points")
        elif not bool((zeros == offset).all()):
            problems.append(f"{prefix}: no zero points stored, but the truth is asymmetric")
        weight = PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]
        g = k // scales.shape[1]
        expected = ((codes.to(torch.int16) - zeros.to(torch.int16).repeat_interleave(g, dim=1)).to(scales.dtype)
                    * scales.repeat_interleave(g, dim=1))
        if weight.dtype != expected.dtype or not torch.equal(weight, expected):
            error = float((weight.float() - expected.float()).abs().max())
            problems.append(f"{prefix}: dequantized weight differs by up to {error:g}")
        checked += 1
    return {"checked": checked, "problems": problems, "format": config.format}


if __name__ == "__main__":
    main()
