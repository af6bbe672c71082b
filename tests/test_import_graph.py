"""No import circle inside mcore_rl, and its rooms import only rooms below them.

Reads the source with ``ast`` (nothing of mcore_rl is imported, so it takes milliseconds). Every
import statement counts, at module level and inside functions: an import moved into a function
hides a circle, it does not break it. Only imports under ``if TYPE_CHECKING:`` are left out (they
never run). ``from pkg import name`` points at ``pkg.name`` where that is a module, else at ``pkg``.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "mcore_rl"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# The rooms, bottom first (README "Design"): a room imports only rooms of lower rows, never one
# beside it in its own row. Every module of mcore_rl belongs to one room.
LAYERS = (
    ("mcore_rl.errors",),
    ("mcore_rl.platform", "mcore_rl.fileio", "mcore_rl.config_loader"),
    ("mcore_rl.parallel",),
    ("mcore_rl.mapping",),
    ("mcore_rl.lora",),
    ("mcore_rl.models",),
    ("mcore_rl.rl", "mcore_rl.checkpoint"),
    ("mcore_rl.rollout", "mcore_rl.conversion"),
    ("mcore_rl.job", "mcore_rl.integrations", "mcore_rl.entry"),
)


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Maps each module's dotted name (a package's ``__init__`` under the package's name) to its file."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all depths, less the bodies of ``if TYPE_CHECKING:``."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from X import ...`` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the mcore_rl modules it imports (only names that are modules of the package)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = _base_of(node, name, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
        edges[name] = {t for t in targets if t in modules}
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; all sizes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _describe(component: list[str], edges: dict[str, set[str]]) -> str:
    members = set(component)
    inner = [f"{a} -> {b}" for a in component for b in sorted(edges[a] & members)]
    return f"circle of {len(component)}: " + ", ".join(component) + "\n    " + "\n    ".join(inner)


def test_no_import_circle():
    edges = import_edges(module_files())
    assert len(edges) > 100 and "mcore_rl.models.builder" in edges  # the walk found the package
    selves = sorted(m for m, targets in edges.items() if m in targets)
    circles = [c for c in strongly_connected(edges) if len(c) > 1]
    assert not selves, f"modules importing themselves: {selves}"
    assert not circles, "import circles in mcore_rl (move what both sides need to a module " \
        "below them):\n" + "\n".join(_describe(c, edges) for c in circles)


def _room(module: str) -> tuple[int, str] | None:
    """(row in LAYERS, room) of a module, None where no room holds it."""
    for row, rooms in enumerate(LAYERS):
        for room in rooms:
            if module == room or module.startswith(room + "."):
                return row, room
    return None


def test_rooms_import_only_rooms_below_them():
    edges = import_edges(module_files())
    homeless = sorted(m for m in edges if _room(m) is None and m != PACKAGE)
    assert not homeless, f"modules in no room of LAYERS (place them in the layering): {homeless}"
    upward = []
    for module, targets in sorted(edges.items()):
        if module == PACKAGE:
            continue
        row, room = _room(module)
        for target in sorted(targets):
            t_row, t_room = _room(target)
            if t_room != room and t_row >= row:
                upward.append(f"{module} -> {target} ({room} must not import {t_room}: "
                              f"{'beside it' if t_row == row else 'above it'})")
    assert not upward, "imports not pointing downward:\n" + "\n".join(upward)


def test_the_walk_sees_hidden_and_relative_imports(tmp_path):
    """The walk itself: a function-level import closes a circle, a TYPE_CHECKING one does not,
    relative and ``from pkg import submodule`` imports resolve."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import low\n")
    (pkg / "sub" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n"
        "def f():\n    from ..mid import g\n")
    (pkg / "mid.py").write_text("from pkg.sub import low\ng = 1\n")
    (pkg / "top.py").write_text("import pkg.mid\n")
    edges = import_edges(module_files(pkg, "pkg"))
    assert edges == {"pkg": set(), "pkg.sub": {"pkg.sub.low"}, "pkg.sub.low": {"pkg.mid"},
                     "pkg.mid": {"pkg.sub.low"}, "pkg.top": {"pkg.mid"}}
    assert [c for c in strongly_connected(edges) if len(c) > 1] == [["pkg.mid", "pkg.sub.low"]]
