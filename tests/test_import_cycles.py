"""The toolkit keeps no import circle (issue 46): every import between h3kit's own modules, at the top of a module or
inside a function (a lazy import still ties the two modules together, and hides the circle until a caller happens to
import one first), read with `ast` (nothing is imported), forms no cycle. doctor and service once imported each other
through torch_install_line; it lives in h3kit.pairing now."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in (root / "h3kit").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The h3kit modules `name` imports anywhere in its text: `from h3kit.x import y` counts as h3kit.x.y when that
    is a module, else as h3kit.x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in out if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph_of(root: Path) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_toolkit_has_no_import_cycle():
    graph = graph_of(TOOLKIT)
    assert len(graph) > 50 and graph["h3kit.service.process"], "the walk found the toolkit's modules and imports"
    assert cycles(graph) == []


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    # what the toolkit had: a top-level import one way, a function-level one back
    pkg = tmp_path / "h3kit"
    (pkg / "doctor").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "doctor" / "__init__.py").write_text("from h3kit.doctor.python_env import line\n")
    (pkg / "doctor" / "python_env.py").write_text("from h3kit import service as s\n\ndef line():\n    return 1\n")
    (pkg / "service.py").write_text("def start():\n    from h3kit import doctor\n    return doctor.line()\n")
    assert cycles(graph_of(tmp_path)) == [["h3kit.doctor", "h3kit.doctor.python_env", "h3kit.service"]]
    (pkg / "service.py").write_text("def start():\n    return 1\n")
    assert cycles(graph_of(tmp_path)) == []
