"""The layout rules of docs/architecture.md, checked on the source with ``ast``.

Every import of every module of ``tracedb`` (and of ``api/``, shipped as ``tracedb.api``)
counts: top-level, function-local and under ``TYPE_CHECKING`` alike. The rules:

- no cycle among modules;
- no underscore-prefixed name taken from another module, by ``from m import _name`` or as
  ``m._name`` on an imported module (underscore-prefixed modules such as ``_kernels`` are
  internal to tracedb and may be imported inside it; their underscore names may not);
- imports point down the layers of :data:`LAYERS`: a module imports its own package and
  lower layers only (the shells on top may also import each other, without a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"tracedb": REPO / "tracedb", "tracedb.api": REPO / "api", "tracedb.schema": REPO / "schema"}

LAYERS: list[list[str]] = [
    [
        "tracedb.errors",
        "tracedb.records",
        "tracedb.sqltext",
        "tracedb.jit",
        "tracedb.jitcache",
        "tracedb.schema",
        "tracedb.sample",
    ],
    ["tracedb.graph", "tracedb.tables", "tracedb.migrations"],
    ["tracedb.runtime"],
    ["tracedb.handle"],
    ["tracedb.credit_sets"],
    ["tracedb.ingest", "tracedb.views"],
    ["tracedb.writeback", "tracedb.readback", "tracedb.storage", "tracedb.export", "tracedb.batches"],
    ["tracedb.credit"],
    ["tracedb.cec"],
    ["tracedb.database"],
    ["tracedb"],
    ["tracedb.lake"],
    ["tracedb.cli", "tracedb.cec.cli", "tracedb.api", "tracedb.client", "tracedb.__main__"],
]
"""Bottom first. A module belongs to the longest group name that prefixes its own
(``tracedb`` alone is the package's ``__init__``, the names a user types)."""


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts or (package == "tracedb" and path.parent != root and _outside(path)):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _outside(path: Path) -> bool:
    """A file under tracedb/ that no package holds (none should exist)."""
    return not (path.parent / "__init__.py").exists()


MODULES = _modules()


def _group(module: str) -> str:
    names = [g for layer in LAYERS for g in layer if module == g or (g != "tracedb" and module.startswith(g + "."))]
    assert names, f"{module} is in no layer of LAYERS (add it there and to docs/architecture.md)"
    return max(names, key=len)


def _layer(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> tuple[set[str], list[str]]:
    """(modules of ours it imports, underscore names it takes from other modules)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    edges: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> one of our modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    edges.add(alias.name)
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "tracedb"
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source not in MODULES:
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in MODULES:
                    edges.add(target)
                    aliases[alias.asname or alias.name] = target
                else:
                    edges.add(source)
                    if alias.name.startswith("_"):
                        private.append(f"from {source} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = aliases[node.value.id]
                if f"{owner}.{node.attr}" not in MODULES:
                    private.append(f"{node.value.id}.{node.attr} (of {owner})")
    edges.discard(module)
    return edges, private


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        _layer(_group(module))


def test_no_import_cycle() -> None:
    """Tarjan's strongly connected components over every import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v][0]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_underscore_name_from_another_module() -> None:
    found = {m: private for m, (_, private) in GRAPH.items() if private}
    assert not found, found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    group = _group(module)
    layer = _layer(group)
    top = layer == len(LAYERS) - 1
    for target in sorted(GRAPH[module][0]):
        other = _group(target)
        if other == group:
            continue
        assert _layer(other) < layer or (top and _layer(other) == layer), (
            f"{module} (layer {layer}, {group}) imports {target} (layer {_layer(other)}, {other})"
        )


def test_the_walker_sees_every_kind_of_import() -> None:
    """The rules above would pass vacuously if the walker missed imports: it finds the
    function-local and TYPE_CHECKING imports known to exist."""
    edges = {m: e for m, (e, _) in GRAPH.items()}
    assert "tracedb.ingest.scanned" in edges["tracedb.ingest.run"]  # function-local
    assert "tracedb.ingest.scanned" in edges["tracedb.ingest.rows"]  # under TYPE_CHECKING
    assert "tracedb.views._kernels" in edges["tracedb.views.nodes"]  # an underscore module, allowed
    assert "tracedb.database" in edges["tracedb.api.backend"]  # api/ as tracedb.api, relative imports resolved
    assert "tracedb.api.cache" in edges["tracedb.api.backend"]
