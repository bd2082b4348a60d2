"""Names from a checkpoint, an output or a path cannot paint the terminal: every user-facing command runs
attached to a pseudo-terminal (Rich styles for it) on a checkpoint whose tensor, module, file and folder
names hold escape sequences (colour, conceal, cursor-up + erase-line, an OSC 8 hyperlink, a window
title), BEL, CR, a newline, a C1 CSI, a bidi override and Rich markup. None of the payload's sequences
reaches the terminal raw; each is shown escaped (`\\x1b`, `\\n`, `\\u202e`) and the markup literally.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeconv
from moeconv.formats import CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import reseal, tensor_ranges, tree

# In tensor (and so module) names: every kind of payload, Rich markup with a link included.
NAME = ("\x1b[8m\x1b[31mRED\x1b[1A\x1b[2K\x1b]8;;https://x\x1b\\L\x1b]8;;\x1b\\\x1b]0;TITLE\x07\x07\rCR\nNL"
        "\x9b2J\u202eBIDI[link=https://x]y[/link][bold red]LOUD")
# What the terminal must show for it, written out by hand.
SHOWN_NAME = (r"\x1b[8m\x1b[31mRED\x1b[1A\x1b[2K\x1b]8;;https://x\x1b\L\x1b]8;;\x1b\\x1b]0;TITLE\x07\x07\rCR\nNL"
              r"\x9b2J\u202eBIDI[link=https://x]y[/link][bold red]LOUD")
# In file and folder names, which cannot hold "/".
PATH = "\x1b[8m\x1b[1A\x1b[2K\x1b]0;TITLE\x07\rCR\nNL\x9b2J\u202eBIDI[link=x]y[bold red]LOUD"
SHOWN_PATH = r"\x1b[8m\x1b[1A\x1b[2K\x1b]0;TITLE\x07\rCR\nNL\x9b2J\u202eBIDI[link=x]y[bold red]LOUD"
# An extra file in an output whose name would end verify's failing run with a green "ok" and hide the rest.
CONCEAL = ("\r\x1b[2K\x1b[32mverdict: ok (structure and digests; 4 expert(s) in 2 MoE layer(s) bit-exact against "
           "the source; --level structure)\x1b[8m")
SHOWN_CONCEAL = (r"\r\x1b[2K\x1b[32mverdict: ok (structure and digests; 4 expert(s) in 2 MoE layer(s) bit-exact "
                 r"against the source; --level structure)\x1b[8m")
# Sequences of the payloads that Rich's own styling never writes (it writes SGR colours and bold only).
RAW = {"conceal": "\x1b[8m", "colour": "\x1b[31mRED", "green": "\x1b[32mverdict", "cursor up": "\x1b[1A",
       "erase line": "\x1b[2K", "hyperlink": "\x1b]8;", "window title": "\x1b]0;", "BEL": "\x07",
       "carriage return": "\rCR", "C1 CSI": "\x9b", "bidi override": "\u202e"}
_STYLE = re.compile(r"\x1b\[[0-9;]*m")  # Rich's own colours and bold, taken out to read the text


def _terminal(*args, timeout: float = 240) -> tuple[int, str]:
    """`moeconv ARGS` with stdout and stderr on a pseudo-terminal 2000 columns wide (no table cell wraps):
    its exit code and every character the terminal received."""
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 2000, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "2000", "LINES": "60"}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen([sys.executable, "-m", "moeconv", *map(str, args)], stdin=child, stdout=child,
                               stderr=child, env=env, close_fds=True)
    os.close(child)
    received, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main, 1 << 16)
                except OSError:  # EIO: the command closed the terminal (it ended)
                    break
                if not chunk:
                    break
                received += chunk
        else:
            process.kill()
            pytest.fail(f"moeconv {' '.join(map(str, args))} ran past {timeout} s")
    finally:
        os.close(main)
    return process.wait(timeout=60), received.decode("utf-8", errors="replace")


def _lines(screen: str) -> list[str]:
    """The terminal's lines as they read, without Rich's styling."""
    return [line for line in _STYLE.sub("", screen).replace("\r\n", "\n").split("\n") if line.strip()]


def _assert_shown_escaped(screen: str, *shown: str) -> None:
    """Rich styled for a terminal, no sequence of a payload arrived raw, no payload line began, and each
    payload is shown in its escaped form, markup as text."""
    assert "\x1b[1m" in screen, screen  # Rich's bold: the command did render for a terminal
    leaked = [what for what, raw in RAW.items() if raw in screen]
    assert not leaked, f"raw on the terminal: {leaked}\n{screen!r}"
    lines = _lines(screen)
    assert not [line for line in lines if line.startswith(("NL", "verdict: ok"))], lines
    for text in shown:
        assert text in "\n".join(lines), f"{text!r} not shown in\n" + "\n".join(lines)


def _hostile(root: Path) -> Path:
    """A compressed-tensors checkpoint in a folder named with PATH, holding a folder named PATH, whose
    layers' tensors are named `model{NAME}.layers.N...` and whose experts' g_idx relabel whole groups
    (so inspect lists an act-order row per MoE layer, keyed by its module name)."""
    source = make_checkpoint(root / f"src{PATH}", SynthSpec(hidden=64, intermediate=64, experts=2,
                                                            source_format=CompressedTensors(bits=4, group_size=32)),
                             max_shard_size=60_000)
    weight_map = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in [n for n in tensors if n.endswith(".weight_packed") and ".experts." in n]:
            tensors[f"{name.removesuffix('.weight_packed')}.weight_g_idx"] = (1 - torch.arange(64) // 32).to(torch.int32)
        tensors = {name.replace("model.layers.", f"model{NAME}.layers."): tensor for name, tensor in tensors.items()}
        weight_map.update(dict.fromkeys(tensors, shard.name))
        save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((source / "model.safetensors.index.json").read_text())
    (source / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["actorder"] = "group"  # what makes inspect read every g_idx
    (source / "config.json").write_text(json.dumps(config))
    (source / PATH).mkdir()  # a folder: not copied, and said so
    return source


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> tuple[Path, Path]:
    """The hostile checkpoint and its triton output (converted in-process, once)."""
    root = tmp_path_factory.mktemp("terminal")
    source = _hostile(root)
    moeconv.convert(source, root / "out", backend="triton")
    return source, root / "out"


def test_inspect_shows_names_paths_and_act_order_modules_escaped(hostile):
    source, _ = hostile
    before = tree(source.parent)
    code, screen = _terminal("inspect", source)
    assert code == 0, screen
    assert tree(source.parent) == before  # the source and its output untouched, nothing written beside them
    _assert_shown_escaped(screen, f"src{SHOWN_PATH}", f"(model{SHOWN_NAME}.layers.0.mlp.experts ...)",
                          f"act-order model{SHOWN_NAME}.layers.1.mlp.experts")


def test_inspect_json_keeps_the_names_exact_and_escapes_them_as_json(hostile):
    source, _ = hostile
    before = tree(source.parent)
    code, screen = _terminal("inspect", source, "--json")
    assert code == 0, screen
    assert tree(source.parent) == before
    assert "\x1b" not in screen and "\x07" not in screen and "\u202e" not in screen, repr(screen)
    assert set(json.loads(screen)["act_order"]) == {f"model{NAME}.layers.{i}.mlp.experts" for i in range(2)}


def test_a_dry_run_shows_the_source_and_output_paths_escaped(hostile, tmp_path):
    source, _ = hostile
    before = tree(source.parent)
    code, screen = _terminal("convert", source, "-o", tmp_path / f"out{PATH}", "--dry-run")
    assert code == 0, screen
    assert tree(source.parent) == before and not any(tmp_path.iterdir())  # a dry run writes nothing
    _assert_shown_escaped(screen, f"src{SHOWN_PATH}", f"then vllm serve '{tmp_path}/out{SHOWN_PATH}'")


def test_convert_notes_and_report_show_file_and_folder_names_escaped(hostile, tmp_path):
    source, _ = hostile
    output = tmp_path / f"out{PATH}"
    before = tree(source.parent)
    code, screen = _terminal("convert", source, "-o", output, "-q")
    assert code == 0, screen
    assert (output / "moeconv.json").is_file()
    assert tree(source.parent) == before and list(tmp_path.iterdir()) == [output]  # no lock or staging left
    _assert_shown_escaped(screen, f"note: {SHOWN_PATH} not copied: ", f"{tmp_path}/out{SHOWN_PATH}",
                          f"next: moeconv verify '{tmp_path}/out{SHOWN_PATH}'")


def test_verify_tables_and_failure_lines_show_tensor_names_escaped(hostile, tmp_path):
    """A pass-through tensor named with the payload changed (and the manifest resealed): the per-layer
    table, the failure line and the error line name it escaped, and the error line is the last one."""
    _, converted = hostile
    output = Path(shutil.copytree(converted, tmp_path / "out"))
    tensor = f"model{NAME}.layers.0.input_layernorm.weight"
    shard = next(path for path in sorted(output.glob("*.safetensors")) if tensor in tensor_ranges(path.read_bytes()))
    data = bytearray(shard.read_bytes())
    data[tensor_ranges(bytes(data))[tensor][0]] ^= 0x40
    shard.write_bytes(bytes(data))
    reseal(output, shard)
    before, source = tree(tmp_path), tree(hostile[0].parent)
    code, screen = _terminal("verify", output, "--level", "lossless", "-q")
    assert code == 1, screen
    assert tree(tmp_path) == before and tree(hostile[0].parent) == source  # verify writes nothing
    shown = f"model{SHOWN_NAME}.layers.0.input_layernorm.weight"
    _assert_shown_escaped(screen, f"model{SHOWN_NAME}.layers.1.mlp.experts", f"x {shard.name}: tensor {shown} differs")
    last = _lines(screen)[-1]
    assert last.startswith(f"error: {output}: 1 check(s) failed; first: ") and shown in last, last


def test_an_extra_file_named_to_conceal_cannot_end_a_failing_verify_with_ok(hostile, tmp_path):
    """The file's name would erase the failure line, print a green "verdict: ok" and conceal what follows:
    shown escaped, the failure is the last line the terminal shows, and the exit is 1."""
    _, converted = hostile
    output = Path(shutil.copytree(converted, tmp_path / "out"))
    (output / CONCEAL).write_text("")
    before = tree(tmp_path)
    code, screen = _terminal("verify", output, "--level", "structure", "-q")
    assert code == 1, screen
    assert tree(tmp_path) == before
    failure = f"{SHOWN_CONCEAL}: in the output folder but not written by the conversion (not in moeconv.json)"
    _assert_shown_escaped(screen, f"x {failure}", "verdict: FAILED, 1 check(s) failed")
    assert _lines(screen)[-1] == f"error: {output}: 1 check(s) failed; first: {failure}", _lines(screen)


def test_a_usage_error_shows_the_typed_text_escaped(tmp_path):
    """Click's own usage errors quote what was typed (an option that does not exist): Click escapes its
    controls, the bidi override is escaped too."""
    code, screen = _terminal("inspect", tmp_path, "--x\x1b[8m\x9b2J\u202eBIDI\x07")
    assert code == 2, screen
    assert not [what for what, raw in RAW.items() if raw in screen], repr(screen)
    assert _lines(screen) == [r"error: No such option: --x\x1b[8m\x9b2J\u202eBIDI\x07 (see 'moeconv inspect --help')"]
