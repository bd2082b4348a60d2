"""On a CUDA machine: convert small synthetic checkpoints of every source format to every backend that
takes them and run `verify` (the Triton kernels compiled on the GPU). Prints one JSON line per case.

    PYTHONPATH=. python3 scripts/gpu_backends_check.py [--hidden 1024 --intermediate 512]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import moeconv
from moeconv.backends import REGISTRY
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

SOURCES = {
    "gptq-v1-asym-g128": GPTQ(4, 128, sym=False),
    "gptq-v2-8bit-asym-g128": GPTQ(8, 128, sym=False, checkpoint_format="gptq_v2"),
    "gptq-sym-cw": GPTQ(4, -1, sym=True),
    "awq-g64": AWQ(4, 64),
    "ct-pack-asym-g32": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w8a8": CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    with tempfile.TemporaryDirectory() as scratch:
        for name, fmt in SOURCES.items():
            source = make_checkpoint(Path(scratch) / name, SynthSpec(source_format=fmt, layers=2, experts=8,
                                                                     hidden=args.hidden,
                                                                     intermediate=args.intermediate))
            for backend in REGISTRY:
                started = time.perf_counter()
                try:
                    moeconv.convert(source, Path(scratch) / f"{name}-{backend}", backend=backend)
                except MoeconvError as refusal:
                    print(json.dumps({"source": name, "backend": backend, "refused": str(refusal)[:160]}))
                    continue
                report = moeconv.verify(Path(scratch) / f"{name}-{backend}", tokens=32)
                print(json.dumps({"source": name, "backend": backend, "ok": report.ok, "device": device,
                                  "kernel": report.numerics_device,
                                  "relative_errors": [round(layer.relative_error, 6) for layer in report.layers],
                                  "seconds": round(time.perf_counter() - started, 2)}), flush=True)


if __name__ == "__main__":
    main()
