"""The package's shape, checked: no module-level import cycle inside meld (a cycle is what kept an operator
from its custom op), and no folder that common tooling takes for build output."""
import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "meld"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """meld modules `path` imports at module level (function-level imports break cycles on purpose)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(x for x in (base, node.module) if x) if node.level else node.module or ""
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.split(".")[0] == "meld"}


def test_no_module_level_import_cycle():
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for dep in _imports(path, name):
            if dep in modules and dep != name:
                g.add_edge(name, dep)
    # A package's __init__ importing its own modules, which import names of the package, is no cycle.
    g.remove_nodes_from([m for m, p in modules.items() if p.name == "__init__.py"])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"module-level import cycles: {cycles}"


def test_no_folder_named_like_build_output():
    assert not [p for p in ROOT.rglob("*") if p.is_dir() and p.name in {"dist", "build"}]
