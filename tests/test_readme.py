"""The README as a newcomer reads it (issue 44): short, every link lands, the quick start ends at a served
model on each engine with the commands moeconv itself prints, and `make clean` undoes what the Makefile made."""

from __future__ import annotations

import re

import pytest

from helpers import ROOT, run_main
from moeconv.synth import SynthSpec, make_checkpoint

README = (ROOT / "README.md").read_text()


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_short_and_names_the_two_commands_and_every_source_format():
    assert len(README.splitlines()) <= 150
    first = " ".join(README.split("\n\n")[1].split())
    for name in ("AWQ", "GPTQ", "compressed-tensors", "AutoRound", "ModelOpt"):
        assert name in first, first
    commands = re.search(r"## Two commands\n\n```bash\n(.*?)```", README, re.S).group(1)
    assert [line.split()[:2] for line in commands.splitlines()] == [["make", "demo"], ["make", "test"]]


def test_every_link_in_the_readme_lands_on_a_file_and_heading():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        assert (ROOT / path).is_file(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {_slug(heading) for heading in headings}, link


def _serving_table() -> dict[str, tuple[str, str]]:
    """The quick start's serving table: backend -> (the vLLM cell, the SGLang cell)."""
    rows = re.findall(r"^\| `([\w-]+)` \| (.*?) \| (.*?) \|$", README, re.M)
    return {backend: (vllm, sglang) for backend, vllm, sglang in rows}


def test_the_quick_start_ends_at_vllm_serve_and_sglang_launch_server():
    quick_start = README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start") + 1)]
    assert "moeconv inspect" in quick_start and "moeconv convert" in quick_start and "moeconv verify" in quick_start
    cells = " ".join(cell for pair in _serving_table().values() for cell in pair)
    assert "vllm serve out" in cells and "python -m sglang.launch_server --model-path out" in cells


@pytest.mark.parametrize("backend", ["triton", "compressed-tensors", "humming", "cpu"])
def test_the_readme_serve_commands_are_the_ones_convert_prints(tmp_path, capsys, backend):
    """Each cell of the serving table holds the command `convert` prints for a symmetric GPTQ source at the
    quick start's --tp 2 (its `out` for convert's OUT), or says that engine does not load the output."""
    from moeconv.formats import GPTQ

    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=GPTQ(4, 32, sym=True)))
    code, out, err = run_main(capsys, "convert", source, "--backend", backend, "--dry-run", "--tp", "2")
    assert code == 0, err
    printed = [line for line in out.splitlines() if line.startswith("serve: ")]
    assert len(printed) == 2, out
    for cell, line in zip(_serving_table()[backend], printed):
        commands = re.findall(r"`([^`]+)`", cell)
        if not commands:  # the engine does not load it: convert says so too
            assert line.startswith("serve: not with "), (cell, line)
            continue
        assert commands[0].startswith(("vllm serve", "python -m sglang")), cell
        assert line.endswith(commands[0].replace(" out", " OUT", 1)), (cell, line)


def test_make_clean_removes_every_environment_the_makefile_and_its_scripts_make():
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+) :?= (\S+)$", makefile, re.M))
    made = set(re.findall(r"-m venv (\S+)", makefile))
    made |= {re.search(r'VENV="\$\{PACKERS_VENV:-([^}]+)\}"', (ROOT / "scripts" / "install-packers.sh").read_text())[1]}
    clean = re.search(r"^clean:\n\trm -rf (.*)$", makefile, re.M).group(1).split()
    removed = {variables.get(word[2:-1], word) if word.startswith("$(") else word for word in clean}
    made = {variables.get(word[2:-1], word) if word.startswith("$(") else word for word in made}
    assert made == {".venv", ".venv-packers", ".venv-engines", ".venv-sglang"} and made <= removed, (made, removed)
