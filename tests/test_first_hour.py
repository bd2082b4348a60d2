"""What a newcomer meets first: the report lines that say what a checkpoint is and what to do next."""

from __future__ import annotations

import json
import os
from pathlib import Path
import threading

import pytest

from moeconv.formats import CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import run_main


def test_w8a8_format_evidence_reads_as_evidence_not_a_failure(tmp_path, capsys):
    """int-quantized W8A8 stores unpacked int8 weights: nothing to infer from packing, and inspect says the
    headers are what the config says, while every backend stays eligible."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=CompressedTensors(
        format="int-quantized", bits=8, group_size=-1, activation_bits=8)))
    code, out, err = run_main(capsys, "inspect", source, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["detection"]["evidence"] == [
        "weight I8[64, 128], weight_scale F16[64, 1] for a 64x128 linear: the headers are what the config's "
        "compressed-tensors int-quantized W8A8 says (unpacked weights: no packing or zero points in the data to "
        "cross-check)"]
    assert all(verdict["eligible"] for verdict in report["backends"].values()), report["backends"]


def test_the_python_api_example_runs_every_backend(tmp_path, capsys):
    """examples/python_api.py, as the README describes it, on a smaller model of the same kind."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from moeconv.backends import REGISTRY

    path = Path(__file__).parents[1] / "examples" / "python_api.py"
    spec = importlib.util.spec_from_file_location("python_api", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(tmp_path, dataclasses.replace(example.SPEC, layers=1, experts=4, hidden=128, intermediate=64))
    lines = capsys.readouterr().out.splitlines()
    ran = [line.split(":")[0] for line in lines if "verify ok" in line]
    assert ran == list(REGISTRY) and "compressed-tensors" in ran, lines


def _tensor_bytes(folder) -> int:
    """The tensor data bytes of a folder's safetensors files: each file less its 8-byte length and header."""
    import struct

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as handle:
            (header,) = struct.unpack("<Q", handle.read(8))
        total += path.stat().st_size - 8 - header
    return total


def test_verify_progress_counts_what_each_phase_says(tmp_path, capsys):
    """--level structure: digests (the output's file bytes), then tensor-digests (the output's tensor
    bytes). Above it: lossless (the output's file bytes and the source's shard bytes hashed, and the source
    tensor bytes compared: for triton every source tensor, experts decoded, the rest byte-compared; the
    digests' thread may advance it too), then kernel (one per MoE layer checked). Each phase advances to its total."""
    from moeconv.verification import verify

    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    phases, done, threads = [], {}, set()

    def progress(amount, total=None, phase=None):
        if total is not None:
            phases.append((phase, total))
            done[phase] = 0
        else:
            done[phases[-1][0]] += amount
            threads.add((phases[-1][0], threading.current_thread().name))

    output_files = sum(path.stat().st_size for path in (tmp_path / "out").iterdir())
    source_shards = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    assert verify(tmp_path / "out", progress=progress, level="structure").ok
    assert phases == [("digests", output_files), ("tensor-digests", _tensor_bytes(tmp_path / "out"))]
    assert done == dict(phases)
    phases.clear()
    done.clear()
    assert verify(tmp_path / "out", progress=progress, numerics_layers=1).ok
    assert phases == [("lossless", output_files + source_shards + _tensor_bytes(source)), ("kernel", 1)]
    assert done == dict(phases)
    # this thread gathers the checks' results; the digests, begun before the plan, advance it from their own
    # thread, unless they finished before the phase began (their progress is then passed on from this one)
    assert "MainThread" in {name for phase, name in threads if phase == "lossless"}
    assert {name for phase, name in threads if phase == "lossless"} <= {"moeconv-digests", "MainThread"}


def test_verify_times_each_phase_and_what_comes_before(tmp_path):
    """`phase_seconds`: `prepare` (the manifest, both checkpoints, the plan, the structure checks), then each
    phase of the level, and inside lossless its parts; every one a duration, none longer than verify took."""
    import time

    from moeconv.api import convert
    from moeconv.verification import verify

    source = make_checkpoint(tmp_path / "src", SynthSpec())
    convert(source, tmp_path / "out", workers=1)
    for level, phases in (("structure", {"prepare", "digests", "tensor-digests"}),
                          ("lossless", {"prepare", "lossless", "pass-through", "workers-start", "checks", "digests",
                                        "source-digests"})):
        started = time.perf_counter()
        report = verify(tmp_path / "out", level=level, workers=1)
        took = time.perf_counter() - started
        assert report.ok and set(report.phase_seconds) == phases, (level, report.phase_seconds)
        assert all(0 <= seconds <= took for seconds in report.phase_seconds.values()), report.phase_seconds
        assert report.phase_seconds["prepare"] > 0


def test_verify_report_says_what_ran_and_ends_with_the_verdict(tmp_path, capsys):
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert run_main(capsys, "convert", source, "-o", tmp_path / "cpu", "--backend", "cpu", "-q")[0] == 0
    code, out, _ = run_main(capsys, "verify", tmp_path / "cpu", "--level", "structure", "-q")
    assert code == 0 and "0/0" not in out and "tolerance" not in out and "not run (--level structure)" in out
    assert out.splitlines()[-1] == ("verdict: ok (structure and digests; source not anchored (a local folder); "
                                    "--level structure); caveat: the tensors' bytes are self-consistent; not compared "
                                    "with the source (--level lossless compares them)")
    code, out, _ = run_main(capsys, "verify", tmp_path / "cpu", "-q")
    flat = " ".join(out.split())
    assert code == 0 and "rel err = ||out - ref|| / ||ref||, against a float64 reference of the source, is what is " \
                         "checked (<= 0.06); max abs is the largest single difference, for scale: the reference's " \
                         "outputs reach |ref| =" in flat, out
    shards = len(list(source.glob("*.safetensors")))
    assert out.splitlines()[-1] == (f"verdict: ok (structure and digests, {shards} source shard(s) as recorded, "
                                    f"8 expert(s) in 2 MoE layer(s) bit-exact against the source, kernel within 0.06 "
                                    f"on 2 layer(s); source not anchored (a local folder); --level numerics)")


# ------------------------------------------------------------------ a newcomer's second pass (issue 44)

def test_every_serve_line_names_vllm_and_sglang_right_for_the_source(tmp_path, capsys):
    """The report's last lines name each engine: an asymmetric source's compressed-tensors output is said to be
    refused by SGLang (with the backend SGLang does serve for it), its triton output served by both plugins;
    a symmetric source's compressed-tensors output is launched by stock SGLang; Mixtral's triton output is
    refused by SGLang (its Mixtral has no fused MoE under the plugin); inspect says the same per backend."""
    from moeconv.formats import GPTQ

    asym = make_checkpoint(tmp_path / "asym", SynthSpec(source_format=GPTQ(4, 32, sym=False)))
    sym = make_checkpoint(tmp_path / "sym", SynthSpec(source_format=GPTQ(4, 32, sym=True)))
    mixtral = make_checkpoint(tmp_path / "mixtral", SynthSpec(architecture="mixtral",
                                                              source_format=GPTQ(4, 32, sym=True)))
    code, out, _ = run_main(capsys, "convert", asym, "--backend", "compressed-tensors", "--dry-run")
    assert code == 0 and out.splitlines()[-2:] == [
        "serve: stock vLLM 0.33: vllm serve OUT",
        "serve: not with SGLang as it is: SGLang 0.5.23 refuses the expert zero points of every asymmetric "
        "compressed-tensors checkpoint (sgl-project/sglang PR #39510); for SGLang use --backend triton (moeconv's "
        "SGLang plugin)"]
    code, out, _ = run_main(capsys, "convert", asym, "--backend", "triton", "--dry-run", "--tp", "2")
    assert code == 0 and out.splitlines()[-1] == (
        "serve: SGLang 0.5.23 through moeconv's plugin: install moeconv into SGLang's environment (docs/SERVING.md; it "
        "registers the plugin), then python -m sglang.launch_server --model-path OUT --tp-size 2")
    code, out, _ = run_main(capsys, "convert", sym, "--backend", "compressed-tensors", "--dry-run")
    assert code == 0 and out.splitlines()[-1] == "serve: SGLang 0.5.23: python -m sglang.launch_server --model-path OUT"
    code, out, _ = run_main(capsys, "convert", mixtral, "--backend", "triton", "--dry-run")
    assert code == 0 and out.splitlines()[-1] == (
        "serve: not with SGLang as it is: SGLang 0.5.23 builds Mixtral's experts one linear each under this "
        "quantization; for SGLang use --backend compressed-tensors")
    code, out, _ = run_main(capsys, "inspect", asym, "--json")
    backends = json.loads(out)["backends"]
    assert backends["triton"]["sglang_serving"]["engine"] == "SGLang 0.5.23 through moeconv's plugin"
    assert backends["compressed-tensors"]["sglang_serving"]["engine"] is None
    assert backends["compressed-tensors"]["serving"]["engine"] == "stock vLLM 0.33"


def test_undecided_zero_points_are_said_up_front_and_in_the_verdict(tmp_path, monkeypatch, capsys):
    """Where the data cannot tell GPTQ v1 from v2, inspect says convert refuses until the user decides (not a
    bare "eligible"), and verify's last line carries the user's decision, as its table does."""
    from moeconv import synth as synth_module
    from moeconv.formats import GPTQ

    plain = synth_module.random_weight
    monkeypatch.setattr(synth_module, "random_weight", lambda *args: plain(*args) + 0.01)  # not centred on zero
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=False, checkpoint_format="gptq_v2"),
                                                         layers=2, experts=8, hidden=256, intermediate=128))
    code, out, _ = run_main(capsys, "inspect", source)
    flat = " ".join(out.split())
    assert code == 0 and "convert refuses until you decide" in flat and "pass --gptq-zero-format v1 or v2" in flat
    assert "--backend auto takes triton: served by vLLM 0.33 through moeconv's plugin once you decide (above)" in flat
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", "--gptq-zero-format", "v2")
    assert code == 0, err
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "-q")
    last = out.splitlines()[-1]
    assert code == 0 and last.startswith("verdict: ok (") and "; caveat: decided by the user, not the data: " \
                                                               "--gptq-zero-format gptq_v2: the data cannot tell" in last


def test_a_moeconv_output_given_as_a_source_is_named_for_what_it_is(tmp_path, capsys):
    """inspect and convert on a triton output: one line saying it is one, and its source; convert into a
    finished output: one line saying the conversion there is finished."""
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    expected = (f"error: {tmp_path / 'out'}: already a moeconv triton output (source: {source.resolve()}): "
                f"`moeconv verify {tmp_path / 'out'}` checks it; to convert again, convert its source\n")
    for command in (["inspect", tmp_path / "out"], ["convert", tmp_path / "out", "-o", tmp_path / "again"]):
        code, _, err = run_main(capsys, *command)
        assert code == 2 and err == expected, err
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")
    assert code == 2 and err == (f"error: {tmp_path / 'out'}: a finished moeconv conversion is already there "
                                 f"(`moeconv verify {tmp_path / 'out'}` checks it); choose another -o, or remove it "
                                 f"to convert again\n"), err


def test_auto_says_why_it_skipped_and_tp_says_which_sizes_fit(tmp_path, capsys):
    """--backend auto gives each skipped backend's reason in its line, once per reason; a --tp that splits
    nothing names the sizes that do, once; backend names are taken in any case, with _ for -."""
    from moeconv.formats import GPTQ

    channelwise = make_checkpoint(tmp_path / "channel", SynthSpec(source_format=GPTQ(4, -1, sym=True)))
    code, _, err = run_main(capsys, "convert", channelwise, "--backend", "auto", "--dry-run", "--json")
    assert code == 0 and err.splitlines()[0] == (
        "--backend auto takes compressed-tensors: served by stock vLLM 0.33; skipped triton: no engine serves its "
        "output: moeconv's vLLM plugin does not serve channel-wise moe_wna16 scales yet; for vLLM use --backend "
        "compressed-tensors"), err
    source = make_checkpoint(tmp_path / "src", SynthSpec())  # intermediate 64, group 32
    code, _, err = run_main(capsys, "convert", source, "--backend", "auto", "--dry-run", "--tp", "3")
    assert code == 2 and err == (
        "error: no backend takes this checkpoint: triton, compressed-tensors, humming, cpu: "
        "model.layers.0.mlp.experts: intermediate size 64 does not split over tp=3; --tp sizes that fit: 1, 2\n"), err
    code, _, err = run_main(capsys, "convert", source, "--backend", "triton", "--dry-run", "--tp", "3")
    assert code == 2 and err.endswith("does not split over tp=3; --tp sizes that fit: 1, 2\n"), err
    code, out, err = run_main(capsys, "convert", source, "--backend", "Compressed_Tensors", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["backend"] == "compressed-tensors", err
    code, out, _ = run_main(capsys, "convert", "--help")
    assert "humming: per-expert Humming schema (quant_method humming; vLLM loads it from symmetric sources only)" \
           in " ".join(out.split())


def test_the_scale_cast_is_in_the_serve_lines_the_table_and_the_verdict(tmp_path, capsys):
    """fp16 scales in a bf16 model: the note advises --dtype float16, and the serve lines carry it; verify's
    table counts the scales the cast changes, and its verdict says so."""
    from moeconv.formats import GPTQ

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=True)))
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (source / "config.json").write_text(json.dumps(config))
    code, out, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--backend", "compressed-tensors", "-q")
    assert code == 0 and "serve with --dtype float16 to keep them exact" in err
    assert out.splitlines()[-2:] == [
        f"serve: stock vLLM 0.33: vllm serve {tmp_path / 'out'} --dtype float16",
        f"serve: SGLang 0.5.23: python -m sglang.launch_server --model-path {tmp_path / 'out'} --dtype float16"]
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "-q")
    report = json.loads(run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "--json")[1])
    cast = report["engine_scale_cast"]
    assert code == 0 and 0 < cast["changed"] < cast["checked"]
    flat = " ".join(out.split())
    assert (f"scales the engine's cast changes │ {cast['changed']} of {cast['checked']} change when cast from "
            f"float16 to the model dtype bfloat16") in flat, out
    assert out.splitlines()[-1].endswith(f"; caveat: {cast['changed']} scale(s) change when the engine casts them "
                                         f"(serve with --dtype float16)")


def test_verify_lists_many_layers_in_a_few_rows_and_pipes_do_not_fold_paths(tmp_path, capsys):
    """40 MoE layers: the first 16 rows, then one row counting the rest; piped (no terminal), the table does not
    fold a path longer than 80 columns."""
    from moeconv import render

    deep = tmp_path / ("a-folder-name-long-enough-to-pass-eighty-columns-on-its-own-" * 2)
    source = make_checkpoint(deep / "src", SynthSpec(layers=40, experts=2, hidden=64, intermediate=64))
    assert run_main(capsys, "convert", source, "-o", deep / "out", "-q")[0] == 0
    code, out, _ = run_main(capsys, "verify", deep / "out", "--level", "lossless", "-q")
    assert code == 0 and str(deep / "out") in out
    rows = [line for line in out.splitlines() if "model.layers." in line]
    assert len(rows) == render.LAYER_ROWS and "... 24 more MoE layers, every one ok (--json lists each)" in out


def test_demo_says_its_folder_goes_and_what_to_do_next(tmp_path, capsys):
    from moeconv.cli import DEMO_NEXT

    code, out, err = run_main(capsys, "demo")
    assert code == 0 and "(a temporary folder, removed when the demo ends: --workdir DIR keeps it)" in err
    assert out.splitlines()[-1] == DEMO_NEXT
    assert DEMO_NEXT.startswith("next, your own checkpoint: moeconv inspect SRC, then moeconv convert SRC -o OUT")


def _packaged_tree(into):
    """The files the wheel is built from, copied (the build leaves build/ and *.egg-info where it runs)."""
    import shutil

    from helpers import ROOT

    into.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, into / name)
    shutil.copytree(ROOT / "moeconv", into / "moeconv", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def _wheel(tmp_path):
    import importlib.util
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed here: the wheel cannot be built without the network")
    tree = _packaged_tree(tmp_path / "tree")
    (tmp_path / "dist").mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "dist"), str(tree)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("moeconv-*.whl")
    return wheel


def test_the_wheel_holds_the_license_and_opens_with_what_moeconv_is(tmp_path):
    import zipfile

    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(name.rsplit("/", 1)[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    headers, _, description = metadata.partition("\n\n")
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers
    assert "Project-URL" not in headers  # there is no public home yet: none is invented
    assert description.startswith("# moeconv\n\nConvert quantized Mixture-of-Experts checkpoints (AWQ, GPTQ, "
                                  "compressed-tensors, AutoRound, NVIDIA ModelOpt\nINT4)"), description[:200]
    quick_start = description.index("## Quick start")
    assert quick_start < description.index("vllm serve") and quick_start < description.index("sglang.launch_server")


def test_the_wheel_installs_into_an_engine_environment_and_registers_its_plugins(tmp_path):
    """docs/SERVING.md: `pip install --no-deps` of the built wheel into an engine's environment keeps the
    engine's torch (here a stand-in distribution the environment already holds) and registers both plugins."""
    import subprocess
    import sys

    import pytest

    wheel = _wheel(tmp_path)
    engine = tmp_path / "engine-env"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(engine)], capture_output=True, text=True,
                          timeout=300)
    if made.returncode != 0:
        pytest.skip(f"no venv can be made here: {made.stderr.strip()[-200:]}")
    python = engine / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The engine's own torch, as pip sees an installed distribution.
    (Path(site) / "torch").mkdir()
    (Path(site) / "torch" / "__init__.py").write_text('__version__ = "2.14.0+engine"\n')
    (Path(site) / "torch-2.14.0.dist-info").mkdir()
    (Path(site) / "torch-2.14.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.0\n")
    (Path(site) / "torch-2.14.0.dist-info" / "RECORD").write_text("")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300)  # this pip, into that venv
    assert done.returncode == 0, done.stdout + done.stderr
    probe = ("import importlib.metadata as m, json, torch; print(json.dumps({'torch': torch.__version__, "
             "'vllm': [e.value for e in m.entry_points(group='vllm.general_plugins')], "
             "'sglang': [e.value for e in m.entry_points(group='sglang.srt.plugins')], "
             "'installed': sorted(d.metadata['Name'] for d in m.distributions())}))")
    alone = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # only what that venv holds
    found = json.loads(subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True,
                                      cwd=tmp_path, env=alone).stdout)
    assert found == {"torch": "2.14.0+engine", "vllm": ["moeconv.engines.vllm_plugin:register"],
                     "sglang": ["moeconv.engines.sglang_plugin:register"], "installed": ["moeconv", "torch"]}, found


def test_the_plugins_load_in_an_environment_without_blake3_or_re2():
    """SGLang 0.5.23's environment holds neither blake3 nor google-re2 (the fresh-clone run of 2026-12-04: the
    plugin's import failed and SGLang refused every triton output as "Unknown quantization method"): both
    plugins import without them, and hashing without blake3 is one line saying what to install."""
    import subprocess
    import sys

    probe = (
        "import sys; sys.modules['blake3'] = None; sys.modules['re2'] = None\n"
        "import moeconv.engines.vllm_plugin, moeconv.engines.sglang_plugin\n"
        "from moeconv.engines.vllm_plugin import integrity\n"
        "from moeconv.checkpoint.writer import BLAKE3\n"
        "from moeconv.errors import MoeconvError\n"
        "try:\n    BLAKE3.new()\nexcept MoeconvError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("moeconv.json's version-4 digests need the blake3 package, which this Python environment "
                           "lacks: pip install blake3 (it needs nothing else)\n")


def test_verify_s_default_samples_the_kernel_on_a_cpu_says_so_up_front_and_names_the_sample(tmp_path, capsys):
    """10 MoE layers on a CPU: verify's default says before it starts what it runs and how to run more, checks
    every expert bit for bit, runs the kernel on 4 layers from the first to the last, and names them in the
    verdict; --level numerics runs all 10."""
    from moeconv.cli import VERIFY_DEFAULT

    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=10, experts=2, hidden=64, intermediate=64))
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    code, out, err = run_main(capsys, "verify", tmp_path / "out")
    assert code == 0 and err.splitlines()[0] == VERIFY_DEFAULT
    assert ("on a CPU (about a second an expert) a sample of 4 layers and 4 experts of each, named in the verdict; "
            "--level numerics runs it on every layer") in VERIFY_DEFAULT
    sample = ", ".join(f"model.layers.{index}.mlp.experts" for index in (0, 3, 6, 9))
    assert out.splitlines()[-1].endswith(
        f"20 expert(s) in 10 MoE layer(s) bit-exact against the source, kernel within 0.01 on a sample of 4 of 10 "
        f"layers ({sample}; --level numerics for all); source not anchored (a local folder); verify's default "
        f"level)"), out
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "--level", "numerics", "-q")
    assert code == 0 and out.splitlines()[-1].endswith(
        "kernel within 0.01 on 10 layer(s); source not anchored (a local folder); --level numerics)"), out


def test_verify_s_default_on_a_cpu_runs_the_kernel_on_4_experts_of_each_sampled_layer(tmp_path, capsys):
    """A real-sized layer costs the interpreter about a second an expert (a 1 GB, 3-layer, 128-expert output: 367 s
    of kernel for a 4.9 s conversion, docs/BENCHMARKS.md), so the CPU default also samples experts: 4 of each
    layer's, spread from the first to the last, reached by the tokens and said in the verdict and --json; every
    expert is still checked bit for bit, and --level numerics still reaches every expert."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=2, experts=16, hidden=64, intermediate=64))
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "-q", "--json")
    report = json.loads(out)
    assert code == 0 and report["kernel_experts"] == 4
    assert [layer["experts_routed"] for layer in report["layers"]] == [4, 4]
    assert [layer["experts_checked"] for layer in report["layers"]] == [16, 16]
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "-q")
    assert code == 0 and out.splitlines()[-1].endswith(
        "32 expert(s) in 2 MoE layer(s) bit-exact against the source, kernel within 0.01 on a sample of 2 of 2 layers "
        "(model.layers.0.mlp.experts, model.layers.1.mlp.experts, 4 expert(s) of each; --level numerics for all); "
        "source not anchored (a local folder); verify's default level)"), out
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "-q", "--level", "numerics", "--json")
    assert code == 0 and [layer["experts_routed"] for layer in json.loads(out)["layers"]] == [16, 16]


def test_verify_after_the_source_moved_points_to_source_and_says_where_the_path_came_from(tmp_path, capsys):
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    source.rename(tmp_path / "moved")
    code, _, err = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "-q")
    out = tmp_path / "out"
    assert code == 2 and err == (
        f"error: {out / 'moeconv.json'}: source {source.resolve()}: no such folder (the source path recorded at "
        f"conversion; a relative path is relative to {out}); if the source moved, or this is another machine, pass "
        f"--source SRC\n"), err
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "-q", "--source", tmp_path / "moved")
    assert code == 0 and out.splitlines()[-1].startswith("verdict: ok"), out


def _stop_at(monkeypatch, module, function, call):
    """`module.function` stopped on its `call`-th call as SIGINT stops a command (main()'s handler raises
    Interrupted there); returns the arguments of each call, and the unpatch."""
    import importlib

    from moeconv.errors import Interrupted

    module = importlib.import_module(module)
    real, calls = getattr(module, function), []

    def stopped(*args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise Interrupted("SIGINT")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, function, stopped)
    return calls, lambda: monkeypatch.setattr(module, function, real)


def test_an_interrupted_conversion_counts_the_shards_it_keeps_and_the_rerun_keeps_them(tmp_path, capsys, monkeypatch):
    """Stopped as the 4th output shard starts filling, while the 3rd is still being finished on its thread:
    the 3 shards on disk are whole (the bytes of an uninterrupted run), the line says 3 are kept, and the rerun
    keeps those 3. (The journal used to miss the shard finishing when the stop came: 2 kept, 1 written again.)"""
    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=4, experts=8, hidden=256, intermediate=128))
    shard_size = ("--max-shard-size", "150KB")
    assert run_main(capsys, "convert", source, "-o", tmp_path / "reference", "-q", *shard_size)[0] == 0
    assert len(list((tmp_path / "reference").glob("*.safetensors"))) > 4
    started, unpatch = _stop_at(monkeypatch, "moeconv.conversion", "_fill_shard", 4)
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", *shard_size)
    staging = tmp_path.resolve() / ".out.moeconv-partial"
    on_disk = sorted(path.name for path in staging.glob("*.safetensors"))
    assert code == 3 and on_disk == sorted(args[1].file_name for args in started[:3]), (on_disk, err)
    for name in on_disk:
        assert (staging / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    assert err == (f"interrupted (SIGINT): 3 finished shard(s) kept in {staging}; run the same command again to "
                   f"finish the conversion from there\n")
    unpatch()
    code, out, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q", *shard_size)
    assert code == 0 and "│ resumed │ 3 finished shard(s) kept │" in " ".join(out.split()), err


def test_an_interrupted_one_shard_conversion_promises_only_what_it_keeps(tmp_path, capsys, monkeypatch):
    """A one-shard output stopped while its shard fills keeps nothing and says so, and the rerun starts over
    (resumed: no); stopped after its shard finished (writing the configs), it keeps that one, and says so."""
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    for folder, stop, kept in (("early", "_fill_shard", []),
                               ("late", "_write_metadata", ["model-00001-of-00001.safetensors"])):
        staging = tmp_path.resolve() / f".{folder}.moeconv-partial"
        _, unpatch = _stop_at(monkeypatch, "moeconv.conversion", stop, 1)
        code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / folder, "-q")
        assert code == 3 and [path.name for path in staging.glob("*.safetensors")] == kept, err
        assert err == ((f"interrupted (SIGINT): 1 finished shard(s) kept in {staging}; run the same command again "
                        f"to finish the conversion from there\n") if kept else
                       "interrupted (SIGINT): no shard had finished, so nothing is kept; run the same command again "
                       "to start over\n")
        unpatch()
        code, out, _ = run_main(capsys, "convert", source, "-o", tmp_path / folder, "-q")
        resumed = "1 finished shard(s) kept" if kept else "no"
        assert code == 0 and f"│ resumed │ {resumed} │" in " ".join(out.split()), out


def test_an_interrupted_verify_does_not_promise_a_resume(tmp_path, capsys, monkeypatch):
    """verify resumes nothing: stopped, it says that it changed nothing and that running it again starts over."""
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    _stop_at(monkeypatch, "moeconv.verification.structure", "check_tensor_digests", 1)
    code, _, err = run_main(capsys, "verify", tmp_path / "out", "-q")
    assert code == 3 and err == "interrupted (SIGINT): nothing was changed; run the command again to start over\n"


def test_a_sampled_verify_says_in_its_table_and_verdict_how_many_experts_it_left_out(tmp_path, capsys):
    """--sample 2 of 8 experts: the table's bit-exact column says "2/2 of 8" and the verdict's caveat counts the
    experts decoded against those in the output (it said "4 expert(s) ... bit-exact" and nothing of the other 12)."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(experts=8))
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "--sample", "2", "-q")
    rows = [line for line in out.splitlines() if "model.layers." in line]
    assert code == 0 and len(rows) == 2 and all("│ 2/2 of 8 " in row for row in rows), out
    assert out.splitlines()[-1].endswith(
        "4 expert(s) in 2 MoE layer(s) bit-exact against the source; source not anchored (a local folder); --level "
        "lossless); caveat: only 4 of the 16 experts decoded, a random sample (--sample); the others were not "
        "compared with the source"), out
    code, out, _ = run_main(capsys, "verify", tmp_path / "out", "--level", "lossless", "-q")
    assert code == 0 and "caveat" not in out.splitlines()[-1] and " of 8 " not in out, out


def test_level_numerics_on_a_pipe_gives_the_kernel_check_s_eta_after_its_first_layer(tmp_path, capsys):
    """--level numerics on a CPU runs seconds a layer: on a pipe (a log, CI) the kernel phase's first line comes
    as soon as the first layer is done, with the ETA of the rest, not LINE_SECONDS later."""
    import re

    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=3, experts=2, hidden=64, intermediate=64))
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    code, _, err = run_main(capsys, "verify", tmp_path / "out", "--level", "numerics")
    kernel = [line for line in err.splitlines() if line.startswith("verify: kernel check, MoE layers ")]
    assert code == 0 and kernel, err
    assert re.fullmatch(r"verify: kernel check, MoE layers 1 / 3 \(33%\), \d+ s so far, ETA \d+ s", kernel[0]), kernel
    assert kernel[-1].startswith("verify: kernel check, MoE layers 3 / 3 (100%)"), kernel


def test_inspect_s_table_names_both_engines_for_each_backend(tmp_path, capsys):
    """inspect's own table, not only its --json, says per backend what each engine does with the output."""
    source = make_checkpoint(tmp_path / "src", SynthSpec())  # asymmetric GPTQ
    code, out, err = run_main(capsys, "inspect", source)
    rows = {line.split("│")[1].strip(): " ".join(line.split("│")[2].split()) for line in out.splitlines()
            if line.startswith("│ backend ")}
    assert code == 0, err
    assert rows["backend triton (tp=1)"] == ("eligible; served by vLLM 0.33 through moeconv's plugin; served by SGLang "
                                             "0.5.23 through moeconv's plugin"), rows
    assert rows["backend compressed-tensors (tp=1)"] == (
        "eligible; served by stock vLLM 0.33; not with SGLang: SGLang 0.5.23 refuses the expert zero points of every "
        "asymmetric compressed-tensors checkpoint (sgl-project/sglang PR #39510); for SGLang use --backend triton "
        "(moeconv's SGLang plugin)"), rows


@pytest.mark.parametrize("config_key", ["mlp_only_layers", "decoder_sparse_step"])
def test_a_qwen_moe_with_dense_mlp_layers_is_not_said_to_be_served_by_sglang(tmp_path, capsys, config_key):
    """SGLang 0.5.23 builds every layer of Qwen2/3-MoE as MoE, ignoring `mlp_only_layers` and `decoder_sparse_step`
    (the fresh-clone run, docs/BENCHMARKS.md: the demo's triton output refused by the plugin with layer 0's dense
    tensors taken by no parameter, its compressed-tensors output "loaded" with them unread): every backend's SGLang
    line says so, in convert and in inspect; vLLM, which honours both keys, still serves it."""
    from moeconv.formats import GPTQ

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=True), dense_layers=1))
    if config_key == "decoder_sparse_step":  # the same model said the other way: every second layer dense
        config = json.loads((source / "config.json").read_text())
        config.update(mlp_only_layers=[], decoder_sparse_step=2)
        (source / "config.json").write_text(json.dumps(config))
    said = "mlp_only_layers [0]" if config_key == "mlp_only_layers" else "decoder_sparse_step 2"
    refusal = (f"serve: not with SGLang as it is: SGLang 0.5.23 builds every layer of qwen3_moe as MoE, ignoring its "
               f"dense MLP layers ({said}): their tensors would load into nothing, from the source as from any "
               f"output; serve it with vLLM")
    for backend in ("triton", "compressed-tensors", "humming"):
        code, out, _ = run_main(capsys, "convert", source, "--backend", backend, "--dry-run")
        assert code == 0 and out.splitlines()[-1] == refusal, (backend, out.splitlines()[-2:])
        assert out.splitlines()[-2].startswith("serve: ") and "vLLM" in out.splitlines()[-2]
    code, out, _ = run_main(capsys, "inspect", source, "--json")
    backends = json.loads(out)["backends"]
    assert all(verdict["sglang_serving"]["engine"] is None for verdict in backends.values())
    assert backends["compressed-tensors"]["serving"]["engine"] == "stock vLLM 0.33"
