"""Bad input: one line naming the file and tensor, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeconv import cli
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.synth import SynthSpec, make_checkpoint


def run_main(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["moeconv", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.fixture
def source(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "src", SynthSpec(), max_shard_size=100_000)


def _edit_config(source: Path, **changes) -> None:
    config = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if key == "quantization_config":
            config[key].update(value)
        else:
            config[key] = value
    (source / "config.json").write_text(json.dumps(config))


def _drop_tensor(source: Path, name: str) -> Path:
    file_name = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(source / file_name)
    del tensors[name]
    save_file(tensors, source / file_name)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    return source / file_name


def _permute_g_idx(source: Path, name: str) -> None:
    entry = open_checkpoint(source).tensors[name]
    values = torch.arange(entry.shape[0], dtype=torch.int32) % (entry.shape[0] // 32)  # act-order: interleaved groups
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(values.numpy().tobytes())


EXPERT = "model.layers.1.mlp.experts.2"


@pytest.mark.parametrize("break_it, expected", [
    (lambda s: (s / "model-00002-of-00004.safetensors").unlink(), "model-00002-of-00004.safetensors: shard is missing"),
    (lambda s: _edit_config(s, moe_intermediate_size=32),
     "which makes a 64x128 (out x in) linear, but config.json makes the gate projection 32x128"),
    (lambda s: _edit_config(s, quantization_config={"bits": 3}), "GPTQ with 3 bits is not supported"),
    (lambda s: _edit_config(s, model_type="dbrx"), "unsupported architecture 'dbrx'; supported: deepseek_v2"),
    (lambda s: _edit_config(s, num_experts=6), "has experts 0..3 (4), but config.json says 6"),
    (lambda s: _drop_tensor(s, f"{EXPERT}.up_proj.qzeros"), "tensor model.layers.1.mlp.experts.2.<up>.qzeros is missing"),
    (lambda s: _permute_g_idx(s, f"{EXPERT}.gate_proj.g_idx"),
     f"{EXPERT}.gate_proj.g_idx: g_idx is an act-order permutation (desc_act) of the gate projection's inputs"),
    (lambda s: (s / "config.json").write_text("{not json"), "config.json: not valid JSON"),
], ids=["missing-shard", "shape-vs-config", "bits", "architecture", "expert-count", "missing-tensor", "act-order",
        "bad-json"])
def test_bad_input_is_one_line_exit_2_nothing_written(monkeypatch, capsys, tmp_path, source, break_it, expected):
    break_it(source)
    before = sorted(p.name for p in source.iterdir())
    code, out, err = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "out", "--quiet")
    assert code == 2
    assert expected in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no staging folder left behind
    assert sorted(p.name for p in source.iterdir()) == before


def test_output_folder_not_empty(monkeypatch, capsys, tmp_path, source):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, _, err = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "out")
    assert code == 2
    assert "out: output folder exists and is not empty" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_brackets_in_paths_are_printed_as_they_are(monkeypatch, capsys, tmp_path, source):
    """Rich markup must not eat "[v2]" (or "[ray]" in an install hint) from an error or a report."""
    (tmp_path / "out[v2]").mkdir()
    (tmp_path / "out[v2]" / "keep.txt").write_text("mine")
    code, _, err = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "out[v2]")
    assert code == 2 and "out[v2]: output folder exists and is not empty" in err, err
    code, out, _ = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "model[bold]", "-q")
    assert code == 0 and "model[bold]" in out.replace("\n", "").replace(" ", "").replace("│", "")


def test_unknown_backend_lists_the_choices(monkeypatch, capsys, tmp_path, source):
    code, _, err = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "out", "--backend", "marlin")
    assert code == 2
    assert "backend 'marlin' is not available; expected one of triton, humming, cpu, compressed-tensors or auto" in err


def test_not_a_quantized_checkpoint(monkeypatch, capsys, tmp_path, source):
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (source / "config.json").write_text(json.dumps(config))
    (source / "quantize_config.json").unlink()
    code, _, err = run_main(monkeypatch, capsys, "inspect", source)
    assert code == 2 and "not a quantized checkpoint" in err


def test_usage_error_exit_2_via_real_subprocess(tmp_path):
    exe = Path(sys.executable).with_name("moeconv")
    done = subprocess.run([str(exe), "convert", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    done = subprocess.run([str(exe), "inspect", str(tmp_path / "nope")], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path / 'nope'}: not a folder, and not a Hugging Face id like org/model"


def test_help_and_version_do_not_import_torch():
    """`moeconv --help` and `--version` answer without importing torch (the lazy package face)."""
    probe = ("import sys\nfrom moeconv.cli import main\nsys.argv = ['moeconv', '{flag}']\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch loaded:', 'torch' in sys.modules)")
    for flag in ("--help", "--version"):
        done = subprocess.run([sys.executable, "-c", probe.format(flag=flag)], capture_output=True, text=True,
                              timeout=60)
        assert "torch loaded: False" in done.stdout, done.stdout + done.stderr
    from moeconv._version import __version__

    done = subprocess.run([sys.executable, "-c", probe.format(flag="--version")], capture_output=True, text=True)
    assert f"moeconv {__version__}" in done.stdout


def test_package_attributes_are_the_api_functions_after_submodule_imports():
    import importlib
    import pkgutil
    import types

    import moeconv

    modules = {info.name for info in pkgutil.iter_modules(moeconv.__path__)}
    assert not modules & set(moeconv.__all__), "a module named after an API function would shadow it"
    for name in ("conversion", "verification", "inspection", "plan"):
        assert isinstance(importlib.import_module(f"moeconv.{name}"), types.ModuleType)
        assert isinstance(getattr(moeconv, name), types.ModuleType)
    assert callable(moeconv.convert) and moeconv.convert.__module__ == "moeconv.api"
    assert moeconv.verify.__module__ == "moeconv.api" and moeconv.inspect.__module__ == "moeconv.api"


def test_convert_says_which_engine_serves_an_asymmetric_gptq_source(monkeypatch, tmp_path, capsys):
    """vLLM 0.33 loads no asymmetric GPTQ linear: a triton output writes the dense ones in compressed-tensors
    (served through the plugin, measured in make test-engines); a cpu output is served by no engine."""
    from moeconv.formats import GPTQ

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=False), hidden=64, intermediate=64))
    code, out, _ = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "out", "--backend", "triton", "-q")
    assert code == 0 and out.splitlines()[-2:] == [
        f"serve: vLLM 0.33 through moeconv's plugin: install moeconv into vLLM's environment (docs/SERVING.md; it "
        f"registers the plugin), then vllm serve {tmp_path / 'out'}",
        f"serve: SGLang 0.5.23 through moeconv's plugin: install moeconv into SGLang's environment (docs/SERVING.md; it "
        f"registers the plugin), then python -m sglang.launch_server --model-path {tmp_path / 'out'}"]
    code, out, _ = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "ct", "--backend", "compressed-tensors",
                            "-q")
    assert code == 0 and out.splitlines()[-2:] == [
        f"serve: stock vLLM 0.33: vllm serve {tmp_path / 'ct'}",
        "serve: not with SGLang as it is: SGLang 0.5.23 refuses the expert zero points of every asymmetric "
        "compressed-tensors checkpoint (sgl-project/sglang PR #39510); for SGLang use --backend triton (moeconv's "
        "SGLang plugin)"]


@pytest.mark.parametrize("args, expected", [
    (["convert", "SRC", "--tp", "0"],
     "error: Invalid value for '--tp': 0 is not in the range x>=1. (see 'moeconv convert --help')"),
    (["convert", "SRC"], "error: Invalid value for '-o' / '--output': an output folder is required (or --dry-run) "
                         "(see 'moeconv convert --help')"),
    (["verify"], "error: Missing argument 'OUT'. (see 'moeconv verify --help')"),
    (["nonsense"], "error: No such command 'nonsense'. (see 'moeconv --help')"),
], ids=["tp-0", "no-output", "no-argument", "no-command"])
def test_usage_errors_are_one_line(monkeypatch, capsys, tmp_path, args, expected):
    code, out, err = run_main(monkeypatch, capsys, *[str(tmp_path) if a == "SRC" else a for a in args])
    assert (code, out, err) == (2, "", expected + "\n")


def test_help_is_plain_text_with_the_readme_names(monkeypatch, capsys):
    """No Rich markup (it ate "[ray]"), no Typer type labels (<bool>, <str>), no sentence cut short."""
    code, out, _ = run_main(monkeypatch, capsys, "convert", "--help")
    assert code == 0 and out.startswith("Usage: moeconv convert [OPTIONS] SRC\n")
    assert "pip install 'moeconv[ray]'" in " ".join(out.split())
    assert not re.search(r"<[a-z]", out) and "{" not in out and "│" not in out
    assert "--backend NAME" in out and "-o, --output OUT" in out and "--tp N" in out
    code, out, _ = run_main(monkeypatch, capsys)  # `moeconv` alone: the help, exit 0
    assert code == 0 and out.startswith("Usage: moeconv [OPTIONS] COMMAND")
    commands = out.split("Commands:\n")[1].splitlines()
    assert [line.split()[0] for line in commands] == ["inspect", "convert", "verify", "demo"]
    assert not [line for line in commands if line.endswith("...")]


def test_a_mistyped_two_part_folder_says_no_such_folder(monkeypatch, capsys, tmp_path):
    """`err/nope` is a relative path as much as a Hub id: the message names both readings."""
    (tmp_path / "err").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(monkeypatch, capsys, "inspect", "err/nope", "--local-files-only")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: err/nope: no such folder in err/, and not a model in the local Hugging Face cache (")
    assert err.rstrip().endswith("and it could not be downloaded (no network, HF_HUB_OFFLINE=1 or --local-files-only)")


def test_the_removed_gpu_device_is_refused_in_one_line_saying_why(source, tmp_path, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "out", "--device", "cuda", "-q")
    assert code == 2 and out == ""
    assert err.strip() == ("error: --device cuda: removed: transforming on the GPU measured 3.4x to 3.7x slower than "
                           "the CPU workers on a 16-core H200 host and held 10.5 GB of host memory "
                           "(docs/BENCHMARKS.md); convert runs on the CPU, leave the option out")
    assert not (tmp_path / "out").exists()
    code, help_text, _ = run_main(monkeypatch, capsys, "convert", "--help")
    assert code == 0 and "--workers" in help_text and "--device" not in help_text
    code, _, err = run_main(monkeypatch, capsys, "convert", source, "-o", tmp_path / "cpu", "--device", "cpu", "-q")
    assert code == 0 and (tmp_path / "cpu" / "moeconv.json").is_file(), err


def test_the_api_refuses_a_url_that_lost_a_slash(source, tmp_path, monkeypatch):
    import moeconv

    monkeypatch.chdir(tmp_path)
    with pytest.raises(MoeconvError, match=r"^OUT s3:/b/out: an object store URL that lost a slash"):
        moeconv.convert(source, Path("s3://b/out"))  # a URL that went through Path, one slash lost
    with pytest.raises(MoeconvError, match=r"^OUT s3:/b/out: an object store URL that lost a slash"):
        moeconv.verify(Path("s3://b/out"))
    assert not (tmp_path / "s3:").exists()
    assert not (tmp_path / "out").exists()
