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
import re
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
        "tracedb.synthetic",
        "tracedb.publish",
        "tracedb.policy",
        "tracedb.lazy",
    ],
    ["tracedb.codec"],
    ["tracedb.graph", "tracedb.tables", "tracedb.migrations", "tracedb.sqlcheck", "tracedb.sqlvalues"],
    ["tracedb.runtime"],
    ["tracedb.handle"],
    ["tracedb.dbfile"],
    ["tracedb.credit_sets", "tracedb.selection"],
    ["tracedb.ingest", "tracedb.views"],
    [
        "tracedb.writeback",
        "tracedb.policy_labels",
        "tracedb.readback",
        "tracedb.storage",
        "tracedb.export",
        "tracedb.batches",
        "tracedb.offpolicy",
    ],
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


# --------------------------------------------------------------------------- the registry

CREDIT_INIT = REPO / "tracedb" / "credit" / "__init__.py"


def _registry() -> list[tuple[str, str, str]]:
    """(algorithm, module, function) of every target the credit registry names as a
    ``"module:function"`` string (imported lazily at run time, so the import walker above
    cannot see it)."""
    out = []
    for node in ast.walk(ast.parse(CREDIT_INIT.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Algorithm":
            name = node.args[0].value  # type: ignore[attr-defined]
            targets = [node.args[1]] + [k.value for k in node.keywords if k.arg == "per_node"]
            for target in targets:
                assert isinstance(target, ast.Constant) and isinstance(target.value, str), ast.dump(target)
                module, _, function = target.value.partition(":")
                out.append((name, f"tracedb.credit.{module}", function))
    return out


REGISTRY = _registry()
GRAPH["tracedb.credit"][0].update(module for _, module, _ in REGISTRY if module in MODULES)


def test_every_registered_algorithm_resolves_like_an_import() -> None:
    """Each registry entry names a module of tracedb.credit defining that function at its
    top level; the entries count as imports of ``tracedb.credit`` (cycles and layers above
    see them)."""
    assert len({name for name, _, _ in REGISTRY}) >= 11
    for name, module, function in REGISTRY:
        assert module in MODULES, f"algorithm {name!r}: no module {module}"
        tree = ast.parse(MODULES[module].read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"algorithm {name!r}: {module} defines no function {function!r}"
        assert module in GRAPH["tracedb.credit"][0]


# --------------------------------------------------------------------------- the selection

FACADES = {
    "tracedb.database": "Database",
    "tracedb.lake.lake": "Lake",
    "tracedb.client": None,  # module-level functions
}
"""Where users type a selection as keyword arguments; each builds one Selection."""
SELECTING = {"group", "complete_groups", "through"}
"""A facade method taking any of these selects (``trace_ids`` alone is a write's target,
``tags`` alone an ingest's tags, ``after`` alone a wait's watermark)."""
SHELLS = ("tracedb.cli", "tracedb.api.routes")


def _selection_fields() -> list[str]:
    tree = ast.parse(MODULES["tracedb.selection"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Selection")
    return [
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and "ClassVar" not in ast.unparse(n)
    ]


FIELDS = _selection_fields()


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


def _functions(module: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(MODULES[module].read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_the_selection_fields_are_read_from_the_class() -> None:
    import tracedb.selection

    assert FIELDS == list(tracedb.selection.Selection.FIELDS)
    assert {"trace_ids", "after", "complete_groups", "through", "tags"} <= set(FIELDS)


def test_below_the_facades_a_selection_is_one_value() -> None:
    """No function outside the facades and the shells takes ``complete_groups`` or
    ``through``: below them, functions take a ``Selection``."""
    found = []
    for module in MODULES:
        if module in FACADES or module.startswith(SHELLS):
            continue
        for fn in _functions(module):
            spelled = {"complete_groups", "through"} & set(_params(fn))
            if spelled:
                found.append(f"{module}.{fn.name}({', '.join(sorted(spelled))})")
    assert not found, f"take a Selection instead: {found}"


def test_every_facade_method_that_selects_takes_every_field() -> None:
    checked = []
    for module, cls in FACADES.items():
        tree = ast.parse(MODULES[module].read_text())
        if cls is None:
            body = tree.body
        else:
            body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        for fn in body:
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                continue
            params = _params(fn)
            if SELECTING & set(params):
                missing = [f for f in FIELDS if f not in params]
                assert not missing, f"{module}.{fn.name} selects but lacks {missing}"
                checked.append(f"{module}.{fn.name}")
    assert len(checked) >= 12, checked  # branches, traces, export, micro_batches, ... on each facade


SELECTION_SQL = (
    "PARTITION BY group_id ORDER BY seq",
    "trace_id IN (SELECT trace_id FROM trace_tags WHERE name = ? AND ",
    "SELECT trace_id, n_tokens FROM traces WHERE",
)
"""Fragments of the selection's SQL: the group-completion window, the tag filters, the resolver."""


def test_the_selection_sql_lives_in_selection_py() -> None:
    found = []
    for module, path in MODULES.items():
        if module == "tracedb.selection":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [f"{module}: {f!r}" for f in SELECTION_SQL if f in node.value]
    text = MODULES["tracedb.selection"].read_text()
    assert all(f in text for f in SELECTION_SQL)
    assert not found, found


# --------------------------------------------------------------------------- the docs

DOCS = REPO / "docs" / "architecture.md"


def _documented_layers() -> list[list[str]]:
    """The package column of docs/architecture.md's layer table, as module names (what a
    parenthesis adds is a remark, not a package)."""
    rows = []
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        names = []
        for raw in re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[1])):
            name = raw.strip().rstrip("/").removesuffix(".py").replace("/", ".")
            names.append(name if name == "tracedb" or name.startswith("tracedb.") else f"tracedb.{name}")
        rows.append(names)
    return rows


def test_the_layers_are_the_table_in_the_docs() -> None:
    documented = _documented_layers()
    assert [sorted(set(r)) for r in documented] == [sorted(layer) for layer in LAYERS], (
        "LAYERS and the table in docs/architecture.md disagree"
    )


def test_the_shells_never_reach_a_databases_handle() -> None:
    """cli/ and api/ call the facade (``db.sql``, ``db.follow``, ...), never ``db.handle``;
    only api/backend.py builds the server's handles."""
    found = []
    for module, path in MODULES.items():
        if not module.startswith(("tracedb.cli", "tracedb.api", "tracedb.cec.cli")) or module == "tracedb.api.backend":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "handle":
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
