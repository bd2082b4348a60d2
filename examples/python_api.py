"""moeconv from Python: one synthetic AWQ Mixtral checkpoint, converted to every backend and verified.

    python examples/python_api.py [WORKDIR]

The same three verbs as the CLI: moeconv.inspect, moeconv.convert, moeconv.verify. A real checkpoint
works the same way: pass its folder or its Hugging Face id instead of the synthetic one.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import moeconv
from moeconv.formats import AWQ
from moeconv.synth import SynthSpec, make_checkpoint

SPEC = SynthSpec(architecture="mixtral", source_format=AWQ(bits=4, group_size=64, zero_point=True),
                 layers=2, experts=8, hidden=256, intermediate=128)


def main(workdir: Path, spec: SynthSpec = SPEC) -> None:
    source = make_checkpoint(workdir / "mixtral-awq", spec)
    report = moeconv.inspect(source)
    print(f"{report['architecture']}: {report['format']}, {len(report['moe_layers'])} MoE layers")
    for backend, verdict in report["backends"].items():
        print(f"  {backend}: {'eligible' if verdict['eligible'] else verdict['reason']}")
    for backend in report["backends"]:  # every registered backend: triton, humming, cpu, compressed-tensors
        result = moeconv.convert(source, workdir / backend, backend=backend)
        check = moeconv.verify(result.output)
        errors = ", ".join(f"{layer.relative_error:.1e}" for layer in check.layers)
        print(f"{backend}: {len(result.files)} shard(s) in {result.seconds:.2f} s; "
              f"verify {'ok' if check.ok else check.failures()}; kernel relative errors {errors}")
        if not check.ok:
            raise SystemExit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            main(Path(scratch))
