"""Planning needs no torch (issue 27): the survey, the data detection and the act-order scan run in
numpy on the bytes read, so `inspect`, `convert --dry-run` and the help screens never import it; and no
codec needs it (issue 39): every format's decode and every layout's encode and decode are numpy, so neither
`convert` nor a lossless `verify` imports it, in the parent or in a worker.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys
from moeconv.cli import main
sys.argv = ["moeconv", *{args!r}]
try:
    main()
except SystemExit:
    pass
print("torch loaded:", "torch" in sys.modules)
print("pydantic loaded:", "pydantic" in sys.modules)
"""


@pytest.mark.parametrize("args", [["convert", "--help"], ["inspect", "--help"], ["verify", "--help"]])
def test_the_help_screens_import_no_torch(args):
    done = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True,
                          timeout=120)
    assert "Usage: moeconv" in done.stdout and "torch loaded: False" in done.stdout, done.stdout + done.stderr


def test_a_command_imports_no_pydantic(tmp_path):
    """The CLI's fixed cost: typer from 0.29 on builds a pydantic adapter for every option (pyproject.toml
    keeps it below), which no command needs."""
    args = ["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "out"), "--tp", "2"]
    done = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True,
                          timeout=120)
    assert "pydantic loaded: False" in done.stdout and "missing" in done.stderr, done.stdout + done.stderr


# The convert parent's own floors: the executor (worker pool, tree memory), the streaming writer and
# block hasher, the header reader, the journal and manifest, the audits' totals, the work list and
# its dtype tables; the plan and what it asks (survey, detection, formats, backends, the codec's
# modules), inspect, the API and the CLI.
PARENT_MODULES = ["moeconv.conversion", "moeconv.executor", "moeconv.checkpoint.reader", "moeconv.checkpoint.writer",
                  "moeconv.checkpoint.manifest", "moeconv.checkpoint.side_files", "moeconv.audit", "moeconv.spec",
                  "moeconv.worklist", "moeconv.plan", "moeconv.survey", "moeconv.detect", "moeconv.transform",
                  "moeconv.packed", "moeconv.act_order", "moeconv.canonical", "moeconv.packing",
                  "moeconv.formats", "moeconv.inspection", "moeconv.api", "moeconv.cli"]
BLOCKED = f"""
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError
for module in {PARENT_MODULES!r}:
    __import__(module)
from moeconv.backends import all_backends
all_backends()  # every registered backend's module
print("imported without torch")
"""


def test_the_convert_parents_own_modules_import_without_torch():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "imported without torch", done.stderr


def test_the_command_ends_without_the_teardown_and_its_output_and_exit_codes_whole(tmp_path):
    """`python -m moeconv` and the `moeconv` script leave through cli._end_now (no interpreter teardown:
    0.8-1.1 s after torch, docs/BENCHMARKS.md): what they printed must still arrive whole, with the exit
    status they meant; a program that calls main() itself (this test process) is never ended by it."""
    import json
    from pathlib import Path

    from moeconv import cli
    from moeconv.synth import SynthSpec, make_checkpoint

    assert not cli._is_the_command()
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    done = subprocess.run([sys.executable, "-m", "moeconv", "convert", str(source), "-o", str(tmp_path / "out"),
                           "-q", "--json", "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["files"] and (tmp_path / "out" / "moeconv.json").is_file()
    script = Path(sys.executable).with_name("moeconv")
    for command in ([sys.executable, "-m", "moeconv"], [str(script)]):
        done = subprocess.run([*command, "convert", str(source), "-o", str(tmp_path / "out"), "-q"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and "finished moeconv conversion" in done.stderr, \
            done.stderr
        done = subprocess.run([*command, "inspect", "--help"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.rstrip().endswith("Show this message and exit."), done.stdout


ACT_ORDER = Path(__file__).parent / "data" / "gptqmodel_act_order" / "down_only"  # real GPTQModel output
RUN = """
import sys
from moeconv.cli import main
sys.argv = ["moeconv", *sys.argv[1:]]
try:
    main()
except SystemExit as done:
    print("exit:", done.code)
print("torch loaded:", "torch" in sys.modules)
print("pydantic loaded:", "pydantic" in sys.modules)
"""


@pytest.mark.parametrize("args, parent_imports_torch", [
    (["inspect", str(ACT_ORDER)], False),
    (["convert", str(ACT_ORDER), "-o", "{out}", "--dry-run"], False),
    # The codecs are numpy, the act-order fold too: with one worker the parent transforms in-process.
    (["convert", str(ACT_ORDER), "-o", "{out}", "--workers", "2", "-q"], False),
    (["convert", str(ACT_ORDER), "-o", "{out}", "--workers", "1", "-q"], False),
], ids=["inspect", "dry-run", "workers-2", "workers-1"])
def test_planning_never_imports_torch_and_convert_only_in_its_workers(tmp_path, args, parent_imports_torch):
    """An asymmetric act-order GPTQ checkpoint, so the parent reads data: the v1/v2 statistic, the sampled
    g_idx, every expert g_idx (the fold), the audits."""
    args = [arg.format(out=tmp_path / "out") for arg in args]
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=300)
    assert "exit: 0" in done.stdout, done.stdout + done.stderr
    assert f"torch loaded: {parent_imports_torch}" in done.stdout, done.stdout + done.stderr
    if "--dry-run" not in args and args[0] == "convert":
        assert (tmp_path / "out" / "moeconv.json").is_file()


TORCH_FREE_POOL = """
import sys
from moeconv.executor import Executor
with Executor(2) as pool:
    seen = list(pool.map(eval, [("'torch' in __import__('sys').modules",)] * 4))
print("workers with torch:", sum(seen), "parent with torch:", "torch" in sys.modules)
"""


def test_workers_of_a_plan_without_torch_jobs_never_import_it():
    """The workers are forked from the parent, which has no torch, and import none."""
    done = subprocess.run([sys.executable, "-c", TORCH_FREE_POOL], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "workers with torch: 0 parent with torch: False", done.stdout + done.stderr


@pytest.mark.parametrize("source", ["packed", "act-order", "w8a8"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_conversion_imports_torch_nowhere(tmp_path, source, workers):
    """Synthetic asymmetric GPTQ -> triton (experts and the dense linears, written in compressed-tensors, all
    through the packed form), the real act-order GPTQModel checkpoint (the canonical route, down folded into
    gate and up) and compressed-tensors W8A8 (the int8 layout, canonical): no process of the tree can import
    torch (the import fails here, in the parent, its workers and, with one worker, its in-process transform)
    and the conversion still ends."""
    from moeconv.formats import CompressedTensors
    from moeconv.synth import SynthSpec, make_checkpoint

    spec = SynthSpec(hidden=128, intermediate=64, experts=4, layers=1, source_format=CompressedTensors(
        format="int-quantized", bits=8, group_size=-1, activation_bits=8)) if source == "w8a8" else \
        SynthSpec(hidden=128, intermediate=64, experts=4, layers=1)
    folder = ACT_ORDER if source == "act-order" else make_checkpoint(tmp_path / "src", spec)
    args = ["convert", str(folder), "-o", str(tmp_path / "out"), "--workers", workers, "-q"]
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=300)
    assert "exit: 0" in done.stdout and "torch loaded: False" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "out" / "moeconv.json").is_file()


NO_SERVER = """
import sys
from moeconv.api import convert
from moeconv.executor import descendants
report = convert(sys.argv[1], sys.argv[2], backend="triton", workers=2)
print("route:", report.plan["route"], "processes left:", len(descendants()))
"""


def test_a_conversion_leaves_no_process_behind(tmp_path):
    """The workers end with the pool, and no fork server is started (one that imported torch lived until the
    command ended: on 2 cores its import cost a torch-free conversion 1 to 2 s and 210 MB, docs/BENCHMARKS.md)."""
    from moeconv.formats import GPTQ
    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 64, sym=True), hidden=256,
                                                         intermediate=128))
    done = subprocess.run([sys.executable, "-c", NO_SERVER, str(source), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "route: packed processes left: 0", done.stdout + done.stderr


NO_TORCH = """
import sys

class NoTorch:  # any import of torch, in this process or a worker forked from it, fails
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked for this test")

sys.meta_path.insert(0, NoTorch())
""" + RUN


@pytest.mark.parametrize("backend", ["triton", "humming", "compressed-tensors", "cpu", "triton-w8a8", "cpu-w8a8",
                                     "triton-act-order", "cpu-act-order"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_lossless_verify_imports_torch_nowhere(tmp_path, backend, workers):
    """Asymmetric GPTQ (or compressed-tensors W8A8 into the int8 layouts of triton and the x86 cpu kernel, or the
    real GPTQModel act-order checkpoint, whose down projections fold into gate and up), its dense linears
    converted where the backend converts them: every codec decodes the stored arrays in numpy, so no process of
    the tree can import torch (the import fails here) and the verdict is still reached; the process itself
    imported torch and Triton (2 to 3 s on the 16-core host) before it did anything, until 2026-12-03."""
    import moeconv
    from moeconv.formats import CompressedTensors
    from moeconv.synth import SynthSpec, make_checkpoint

    spec = SynthSpec(hidden=128, intermediate=64, experts=4, layers=2)
    if backend.endswith("-w8a8"):
        backend, spec = backend.removesuffix("-w8a8"), SynthSpec(hidden=128, intermediate=64, experts=4, layers=2, source_format=(
            CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8)))
    source = ACT_ORDER if backend.endswith("-act-order") else make_checkpoint(tmp_path / "src", spec)
    backend = backend.removesuffix("-act-order")
    moeconv.convert(source, tmp_path / "out", backend=backend, workers=1)
    done = subprocess.run([sys.executable, "-c", NO_TORCH, "verify", str(tmp_path / "out"), "--level", "lossless",
                           "--workers", workers, "-q"], capture_output=True, text=True, timeout=300)
    assert "exit: 0" in done.stdout and "torch loaded: False" in done.stdout, done.stdout + done.stderr
