"""sha256 of every output file moeconv writes, for every backend on a matrix of synthetic checkpoints and on
every checkpoint under tests/data.

Proves a refactoring changes no output byte: tests/test_output_digests.py re-makes every output and compares
it with the table committed before the change (tests/data/output_digests.json); after a change that means to
alter outputs, `python scripts/output_digests.py tests/data/output_digests.json` writes the table anew.
The manifest is compared without what depends on the machine and the run: the source's absolute path (in
`source` and `arguments`), and the manifest's own digest, which covers that path. A refusal is recorded with the folder it names made relative.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from moeconv.checkpoint.manifest import MANIFEST_NAME, SELF_DIGEST_KEY
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

FORMATS = {
    "gptq4-asym-v1": GPTQ(bits=4, group_size=32, sym=False),
    "gptq4-sym": GPTQ(bits=4, group_size=64, sym=True),
    "gptq8-asym-v2": GPTQ(bits=8, group_size=32, sym=False, checkpoint_format="gptq_v2"),
    "gptq4-channel": GPTQ(bits=4, group_size=-1, sym=False),
    "awq4": AWQ(bits=4, group_size=32),
    "ct-w4a16-asym": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w4a16-sym": CompressedTensors(bits=4, group_size=64, symmetric=True),
    "ct-w8a8": CompressedTensors(bits=8, group_size=-1, symmetric=True, activation_bits=8, format="int-quantized"),
}
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
BACKENDS = ("triton", "humming", "cpu", "compressed-tensors")
DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
# The checkpoints under tests/data (each a folder with a config.json), but the outputs kept there.
FIXTURES = sorted(path.parent.relative_to(DATA).as_posix() for path in DATA.glob("**/config.json")
                  if "output" not in path.parent.relative_to(DATA).parts)


def _manifest_digest(path: Path) -> str:
    manifest = json.loads(path.read_text())
    del manifest[SELF_DIGEST_KEY], manifest["source"]["path"], manifest["arguments"]["source"]["path"]
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def digests(folder: Path) -> dict[str, str]:
    """Each output file's sha256 (the manifest's without its machine-dependent fields)."""
    return {path.name: _manifest_digest(path) if path.name == MANIFEST_NAME else
            hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def synthetic(label: str, arch: str, folder: Path) -> Path:
    """The matrix's checkpoint of format `label` and architecture `arch`, made at `folder`."""
    return make_checkpoint(folder, SynthSpec(architecture=arch, source_format=FORMATS[label], hidden=256,
                                             intermediate=128, dense_layers=1 if arch == "deepseek_v3" else 0),
                           max_shard_size=300_000)


def sources(work: Path) -> dict[str, Path]:
    """Every source checkpoint of the table, by its label: the synthetic matrix made under `work`, then the
    fixtures."""
    made = {f"{label}/{arch}": synthetic(label, arch, work / f"{label}-{arch}")
            for label in FORMATS for arch in ARCHITECTURES}
    return {**made, **{f"data/{name}": DATA / name for name in FIXTURES}}


def output_digests(source: Path, backend: str, output: Path) -> dict[str, str] | str:
    """The digests of `source` converted into `backend` at `output` (one worker: the bytes do not depend on
    scheduling), or the refusal, its folders relative."""
    from moeconv.conversion import convert
    from moeconv.plan import make_plan

    try:
        plan = make_plan(source, backend=backend, regroup=True, max_shard_size=400_000)
    except MoeconvError as error:
        return "refused: " + str(error).replace(str(source), "<source>")
    convert(plan, output, workers=1)
    return digests(output)


def table(work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for label, source in sources(work).items():
        for backend in BACKENDS:
            key = f"{label}/{backend}"
            results[key] = output_digests(source, backend, work / ("out-" + key.replace("/", "+")))
            print(key, "ok" if isinstance(results[key], dict) else results[key], flush=True)
    return results


def main(out: str) -> None:
    with tempfile.TemporaryDirectory() as work:
        results = table(Path(work))
    Path(out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
