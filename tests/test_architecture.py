"""docs/ARCHITECTURE.md's floor table is true: every module of the package is placed on a floor, and no
import (at module level, inside a function, or for annotations) points to a higher floor."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moeconv"


def _floors() -> dict[str, int]:
    """Room (`plan.py`, `checkpoint/`) -> floor, from the table's rows."""
    floors = {}
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        match = re.match(r"\| (\d) \| ([^|]+) \|", line)
        if match:
            floors.update({room: int(match[1]) for room in re.findall(r"`([^`]+)`", match[2])})
    return floors


def _room(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return f"{relative.parts[0]}/" if len(relative.parts) > 1 else relative.name


def _module_path(name: str) -> Path | None:
    """The file of module `moeconv.a.b` (a package's __init__.py), or None when it is not a module."""
    base = PACKAGE.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(path: Path) -> set[Path]:
    """The package's modules `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name if _module_path(name) else node.module for name in names]
        found |= {module for name in names if name.startswith("moeconv.") and (module := _module_path(name))}
    return found


def test_the_table_places_every_module():
    floors = _floors()
    unplaced = sorted({_room(path) for path in PACKAGE.rglob("*.py")} - set(floors))
    assert unplaced == []


def test_no_import_points_up():
    floors = _floors()
    upward = [f"{path.relative_to(ROOT)} (floor {floors[_room(path)]}) imports {target.relative_to(ROOT)} "
              f"(floor {floors[_room(target)]})"
              for path in sorted(PACKAGE.rglob("*.py")) for target in sorted(_imported(path))
              if floors.get(_room(target), -1) > floors.get(_room(path), 99)]
    assert upward == []
