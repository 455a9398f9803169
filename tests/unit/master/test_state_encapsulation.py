"""`MasterState` has a public face (issue 18): the master's other modules call its documented methods,
never its private members, and the modules it builds on never import it back at run time.

Parsed with `ast`, not imported: a violation is found whether or not the code path runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MASTER = Path(__file__).resolve().parents[3] / "master"

# The owner: MasterState (state.py) and the mixins it is made of, ObjectTables (object_tables.py),
# SegmentTable (segment_table.py) and RangeBook (range_book.py), whose `self` is a MasterState.
OWNER_MODULES = {"state.py", "object_tables.py", "segment_table.py", "range_book.py"}
OWNER_CLASSES = {"MasterState", "ObjectTables", "SegmentTable", "RangeBook"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_members(sources: dict[str, str]) -> set[str]:
    """Private methods and attributes (`self._x = ...`) of the owner classes."""
    members: set[str] = set()
    for source in sources.values():
        for cls in ast.walk(ast.parse(source)):
            if not isinstance(cls, ast.ClassDef) or cls.name not in OWNER_CLASSES:
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(node.name):
                    members.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":
                        members.add(node.attr)
    return members


def private_uses(module: str, source: str, members: set[str]) -> list[str]:
    """`X._name` with `_name` an owner's private member and X anything but `self`/`cls`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in members:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def _master_sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(MASTER.glob("*.py"))}


def test_no_module_touches_master_state_private_members():
    sources = _master_sources()
    members = private_members({m: s for m, s in sources.items() if m in OWNER_MODULES})
    assert {"_objects", "_disk_only", "_pending", "_delete", "_pop"} <= members  # the guard sees the tables
    others = {module: source for module, source in sources.items() if module not in OWNER_MODULES}
    offenders = [use for module, source in others.items() for use in private_uses(module, source, members)]
    assert offenders == [], "use MasterState's public methods (docs/architecture.md, the master's tables)"


@pytest.mark.parametrize(
    "snippet",
    ["state._objects.values()", "self.state._lookup(name)", "x = state._pending", "state._objects[name] = r"],
)
def test_guard_catches_private_access(snippet):
    members = private_members({"state.py": (MASTER / "state.py").read_text()}) | {"_lookup"}
    assert private_uses("other.py", snippet, members)


def test_guard_lets_a_class_use_its_own_privates():
    members = private_members({"state.py": (MASTER / "state.py").read_text()})
    assert private_uses("other.py", "class T:\n    def f(self):\n        return self._objects", members) == []


def _imports_at_run_time(source: str) -> set[str]:
    """Modules imported anywhere (module level or inside functions) except under `if TYPE_CHECKING:`."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_modules_state_builds_on_never_import_it_back_at_run_time():
    """The modules state.py imports (transitively, within kvtier.master) take MasterState as a
    parameter: a type-only import is fine, a run-time one is the back-import of a friend."""
    sources = _master_sources()
    imports = {m: _imports_at_run_time(s) for m, s in sources.items()}
    below: set[str] = set()
    todo = ["state.py"]
    while todo:
        for name in imports[todo.pop()]:
            if name.startswith("kvtier.master."):
                module = name.removeprefix("kvtier.master.") + ".py"
                if module in sources and module not in below and module != "state.py":
                    below.add(module)
                    todo.append(module)
    assert {"tiering.py", "placement.py", "drain.py", "recovery.py", "backpressure.py", "corrupt.py"} <= below
    assert sorted(m for m in below if "kvtier.master.state" in imports[m]) == []


def _defined_privates(source: str) -> set[str]:
    """Private names a module defines: functions, methods, classes, attributes it assigns."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if _is_private(name)}


def test_no_master_module_reaches_into_another_modules_privates():
    """The same rule for every other owner (Tiering, MasterHandlers, ...): a module uses only its
    own private names; another module's are reached through its public methods."""
    offenders = []
    for module, source in _master_sources().items():
        own = _defined_privates(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    offenders.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []
