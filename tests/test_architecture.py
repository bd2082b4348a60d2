"""docs/ARCHITECTURE.md's floor table is the measured shape of the package: every room (a module, or a
subpackage) is placed on the floor one above the highest room it imports (at module level, inside a function,
or for annotations), floor 0 for a room that imports none, so no import points up or sideways."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moeconv"


def _floors() -> dict[str, int]:
    """Room (`plan.py`, `checkpoint/`) -> floor, from the table's rows."""
    floors = {}
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        match = re.match(r"\| (\d+) \| ([^|]+) \|", line)
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


def import_graph() -> dict[str, set[str]]:
    """Room -> the other rooms it imports."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        room = _room(path)
        graph.setdefault(room, set()).update(_room(target) for target in _imported(path) if _room(target) != room)
    return graph


def measured_floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Room -> the length of the longest chain of imports below it (rooms import no cycle: a cycle raises)."""
    @functools.lru_cache(maxsize=None)
    def floor(room: str, below: frozenset = frozenset()) -> int:
        assert room not in below, f"import cycle through {room}: {sorted(below)}"
        return max((floor(target, below | {room}) + 1 for target in graph[room]), default=0)

    return {room: floor(room) for room in graph}


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


def test_the_table_floors_are_the_measured_ones():
    """A room placed higher than its imports need, or lower, makes the table lie about the shape."""
    table, measured = _floors(), measured_floors(import_graph())
    wrong = [f"{room}: table {table.get(room)}, measured {floor}" for room, floor in sorted(measured.items())
             if table.get(room) != floor]
    assert wrong == []
