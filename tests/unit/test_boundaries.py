"""The dependency rules: the layer order inside kvtier and the connector, no circle between
modules nor between packages, no module past 500 lines (the benchmarks' and the shared
fixtures' too); kvtier never imports vLLM or torch; the connector uses kvtier's public surface
only, reaches vLLM through one module and names no module as kvtier does; the client modules
never load the server, the tier manager or a tier; the benchmarks import each other as a
package, never by editing sys.path."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "kvtier", ROOT / "connectors" / "kvtier_vllm", ROOT / "kvtier_speculators")
GENERATED = "kvtier.api"  # protoc's stubs
MAX_LINES = 500

# The benchmarks and what they share with the tests. Both are run from the repository's root
# (``python -m benchmarks.<name>``, pytest), so each imports the other's modules by their full
# names; the fixtures sit below the benchmarks, and kvtier and the connector import neither.
BENCH_SOURCES = (ROOT / "benchmarks", ROOT / "tests" / "fixtures")
# what the benchmarks may take from tests/: the shared fixtures, and the e2e tests' fix for vLLM's
# CPU build, which the GPU check's end-to-end part runs on too
SHARED_WITH_BENCHMARKS = ("tests.fixtures", "tests.e2e.cpu_patches")

# The arena file's own layout, which a client maps to reach the chunks, and the reader of lmdb's
# file for loads leased there: no tier behind either.
ARENA = ("kvtier.tiers.arena", "kvtier.tiers.arena_index", "kvtier.tiers.lmdb_reader")

# What the connector may use of kvtier: its public surface.
KVTIER_SURFACE = ("kvtier.core", "kvtier.client", "kvtier.rpc", "kvtier.hidden.reader")

# Which package may import which, bottom layer first; a package always imports itself. The
# clients (rpc, client, hidden, the connector) sit beside the tier manager, not above it: they
# reach the tiers through kvtierd or a manager handed to them, and map only the arena's file (and
# read lmdb's).
ALLOWED: dict[str, tuple[str, ...]] = {
    "kvtier": (),  # the package itself: its docstring and version
    "kvtier.api": (),
    "kvtier.core": ("kvtier.api",),
    "kvtier.tiers": ("kvtier.core",),
    "kvtier.fleet": ("kvtier.core",),  # what routers are told: encodings and the publisher
    "kvtier.tiering": ("kvtier.core", "kvtier.tiers", "kvtier.fleet"),
    "kvtier.observability": ("kvtier.core", "kvtier.tiers", "kvtier.tiering"),
    "kvtier.rpc": ("kvtier.core", "kvtier.api", *ARENA),
    "kvtier.client": ("kvtier.core", "kvtier.tiering", *ARENA),
    "kvtier.hidden": ("kvtier.core", "kvtier.client", "kvtier.tiering", *ARENA),
    "kvtier.server": (
        "kvtier.core",
        "kvtier.api",
        "kvtier.tiers",
        "kvtier.tiering",
        "kvtier.observability",
    ),
    "kvtier.bench": ("kvtier.core",),
    "kvtier.cli": ("kvtier",),  # the top: everything
    # Speculators' hidden-states backend: the clients and the hidden-state reader and export
    # (listing a pool's manifests), never the connector
    "kvtier_speculators": (*KVTIER_SURFACE, "kvtier.hidden", "kvtier.tiers.lmdb_env"),
    "kvtier_vllm": KVTIER_SURFACE,  # the two modules vLLM loads: every package below
    "kvtier_vllm.shared": KVTIER_SURFACE,  # what both connectors use, knowing neither
    "kvtier_vllm.encoder": (*KVTIER_SURFACE, "kvtier_vllm.shared"),
    # the pools' plans and chunk shapes, which the KV connector, the draft pool and the hidden
    # tail all read
    "kvtier_vllm.layout": (*KVTIER_SURFACE, "kvtier_vllm.shared"),
    "kvtier_vllm.drafts": (*KVTIER_SURFACE, "kvtier_vllm.shared", "kvtier_vllm.layout"),
    "kvtier_vllm.hidden_capture": (*KVTIER_SURFACE, "kvtier_vllm.shared", "kvtier_vllm.layout"),
    "kvtier_vllm.kv": (
        *KVTIER_SURFACE,
        "kvtier_vllm.shared",
        "kvtier_vllm.layout",
        "kvtier_vllm.drafts",
        "kvtier_vllm.hidden_capture",
    ),
}
# The KV connector's sides run in different processes and meet only in what kvtier_vllm.kv holds.
KV_SIDES = ("kvtier_vllm.kv.scheduler_side", "kvtier_vllm.kv.worker_side")
# vLLM's differences between versions are written once, here: both connectors reach vLLM through it.
VLLM_COMPAT = "kvtier_vllm.shared.vllm_compat"


def _within(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def _module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "connectors"):
        rel = path.relative_to(ROOT / "connectors")
    else:
        rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_path(module: str) -> Path | None:
    top = ROOT / "connectors" if module.split(".")[0] == "kvtier_vllm" else ROOT
    base = top.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _modules() -> Iterator[tuple[str, Path]]:
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            name = _module_name(path)
            if not _within(name, (GENERATED,)):
                yield name, path


def _bench_modules() -> Iterator[tuple[str, Path]]:
    for source in BENCH_SOURCES:
        for path in sorted(source.rglob("*.py")):
            yield _module_name(path), path


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, *, when_loaded: bool = False) -> set[str]:
    """Every module ``path`` imports, at any depth (in functions, under ``if TYPE_CHECKING``);
    with ``when_loaded``, only what loading it imports: less functions' own imports and
    ``if TYPE_CHECKING``. ``from a import b`` names ``a.b`` where that is a module of the tree."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if when_loaded and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if when_loaded and _type_checking(node):
            assert isinstance(node, ast.If)
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            for alias in node.names:
                if _module_path(f"{node.module}.{alias.name}") is not None:
                    found.add(f"{node.module}.{alias.name}")
        todo.extend(ast.iter_child_nodes(node))
    return found


def _ours(module: str) -> bool:
    return (
        module.split(".")[0] in {"kvtier", "kvtier_vllm", "kvtier_speculators"}
        and _module_path(module) is not None
    )


def _package(module: str) -> str:
    """The layer a module belongs to: the longest key of ALLOWED it falls within."""
    layers = [layer for layer in ALLOWED if _within(module, (layer,))]
    assert layers, f"{module} is in no layer: add its package to ALLOWED"
    return max(layers, key=len)


def test_every_package_has_a_docstring_saying_what_it_owns() -> None:
    bare = [
        name
        for name, path in _modules()
        if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not bare


def test_imports_follow_the_layer_order() -> None:
    against = {}
    for name, path in _modules():
        own = _package(name)
        for imported in sorted(_imports(path)):
            if not _ours(imported) or imported == "kvtier":
                continue
            if not _within(imported, (own, *ALLOWED[own])):
                against.setdefault(name, []).append(imported)
    assert not against, f"imports against the layer order (module: imported): {against}"


def test_no_module_is_in_a_circle() -> None:
    graph = {
        name: {m for m in _imports(path) if _ours(m) and m != name and not m.endswith("__init__")}
        for name, path in _modules()
    }
    # a package's __init__ is imported on the way to its modules: edges to packages with an
    # empty (docstring-only) __init__ carry no code and close no circle
    packages = {name for name, path in _modules() if path.name == "__init__.py"}
    for name in graph:
        graph[name] = {m for m in graph[name] if m not in packages or _imports(_module_path(m))}  # type: ignore[arg-type]

    circles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "modules that import each other: " + "; ".join(
        " -> ".join(c) for c in circles
    )


def _package_of(module: str) -> tuple[str, ...]:
    path = _module_path(module)
    assert path is not None, module
    parts = tuple(module.split("."))
    return parts if path.name == "__init__.py" else parts[:-1]


def _package_edges() -> dict[str, dict[str, str]]:
    """Which package imports which, with a module import that shows it. Packages are compared
    where they part: an import from ``a.b.x`` of ``a.c.d.y`` is ``a.b`` -> ``a.c``, and one
    of ``a.y`` is ``a.b`` -> ``a``'s own modules (named ``a``)."""
    edges: dict[str, dict[str, str]] = {}
    for name, path in _modules():
        importer = _package_of(name)
        for imported in _imports(path):
            if not _ours(imported) or imported == name or _within(imported, (GENERATED,)):
                continue
            target = _module_path(imported)
            assert target is not None
            if target.name == "__init__.py" and not _imports(target):
                continue  # an empty package's __init__ carries no code
            owner = _package_of(imported)
            common = 0
            while common < min(len(importer), len(owner)) and importer[common] == owner[common]:
                common += 1
            # the package below the common one each is in; the common one's own modules: itself
            ours, theirs = importer[: common + 1], owner[: common + 1]
            if ours != theirs:
                edges.setdefault(".".join(ours), {}).setdefault(
                    ".".join(theirs), f"{name} imports {imported}"
                )
    return edges


def test_no_package_is_in_a_circle() -> None:
    # a package whose modules import another's that imports it back is one package in two
    # places: what both need belongs in a package below both
    edges = _package_edges()
    circles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                ring = [*stack[stack.index(nxt) :], nxt]
                circles.append("; ".join(f"{a} -> {b} ({edges[a][b]})" for a, b in pairwise(ring)))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, "packages that import each other: " + " | ".join(circles)


def test_no_module_is_past_500_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for _, path in (*_modules(), *_bench_modules())
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these along a seam with a name: {long}"


def test_kvtier_imports_neither_vllm_nor_torch() -> None:
    bad = {
        name: sorted(n for n in _imports(path) if n.split(".")[0] in {"vllm", "torch"})
        for name, path in _modules()
        if name.split(".")[0] == "kvtier"
    }
    assert not {p: n for p, n in bad.items() if n}


def test_the_kv_connectors_sides_import_nothing_of_each_other() -> None:
    crossing = {
        name: sorted(m for m in _imports(path) if _within(m, KV_SIDES) and not _within(m, (own,)))
        for name, path in _modules()
        for own in KV_SIDES
        if _within(name, (own,))
    }
    assert not {name: found for name, found in crossing.items() if found}


def test_only_the_compatibility_module_imports_vllm() -> None:
    vllm = {
        name: sorted(m for m in _imports(path) if m.split(".")[0] == "vllm")
        for name, path in _modules()
        if name.split(".")[0] == "kvtier_vllm"
    }
    assert vllm.pop(VLLM_COMPAT, None), "the compatibility module moved: point VLLM_COMPAT at it"
    assert not {name: found for name, found in vllm.items() if found}


def test_no_connector_module_shares_a_name_with_a_kvtier_module() -> None:
    kvtier = {path.stem for name, path in _modules() if name.split(".")[0] == "kvtier"}
    homonyms = sorted(
        name
        for name, path in _modules()
        if name.split(".")[0] == "kvtier_vllm" and path.stem != "__init__" and path.stem in kvtier
    )
    assert not homonyms


def test_the_connector_reaches_the_tiers_through_the_client() -> None:
    connector = [_imports(path) for name, path in _modules() if name.startswith("kvtier_vllm")]
    assert any("kvtier.client" in names for names in connector)


# what a process that only calls kvtier (an engine) must never load
SERVER_SIDE = ("kvtier.server", "kvtier.tiering", "kvtier.observability", "kvtier.tiers")
CLIENT_MODULES = ("kvtier.rpc", "kvtier.client", "kvtier.core.protocol", "kvtier.core.codec")


def _forbidden_for_clients(module: str) -> bool:
    return _within(module, SERVER_SIDE) and module not in (*ARENA, "kvtier.tiers")


def test_client_modules_never_import_the_server_manager_or_tiers() -> None:
    # static: everything loading the client modules imports, followed to the end
    seen: dict[str, str] = {}
    todo = [(m, "") for m in CLIENT_MODULES]
    while todo:
        module, via = todo.pop()
        if module in seen or _within(module, (GENERATED,)):
            continue
        seen[module] = via
        path = _module_path(module)
        assert path is not None, module
        todo.extend((m, module) for m in _imports(path, when_loaded=True) if _ours(m))
    bad = {m: via for m, via in seen.items() if _forbidden_for_clients(m)}
    assert not bad, f"imported by client modules (module: importer): {bad}"


def test_importing_the_grpc_client_loads_no_server_manager_or_tier() -> None:
    code = (
        "import sys\nimport kvtier.rpc, kvtier.client\n"
        "print('\\n'.join(m for m in sys.modules if m.startswith('kvtier')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "kvtier.rpc" in loaded
    assert "kvtier.core.protocol" in loaded
    assert not [m for m in loaded if _forbidden_for_clients(m)]


# -- abstract classes stand for real variants -----------------------------------------------------

# An abstract class with one concrete subclass is one class spread over two files: the parts it
# calls through abstract hooks belong in an object the class holds. Each exception names why.
ONE_VARIANT_ALLOWED: dict[str, str] = {}


@dataclass
class _ClassInfo:
    bases: list[str]
    """Qualified names, as far as the module's own definitions and imports resolve them."""
    abstract: set[str]
    """Methods decorated ``abstractmethod`` here."""
    defined: set[str]


def _scan_classes(package: Path) -> dict[str, _ClassInfo]:
    """Every top-level class under ``package``, by qualified name, from the source alone."""
    found: dict[str, _ClassInfo] = {}
    imported: dict[str, dict[str, str]] = {}  # module -> local name -> qualified name
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        tree = ast.parse(path.read_text())
        names = imported.setdefault(module, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names[alias.asname or alias.name] = alias.name
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names[node.name] = f"{module}.{node.name}"
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for base in node.bases:
                text = ast.unparse(base).split("[")[0]  # Generic[T] -> Generic
                head, _, rest = text.partition(".")
                qualified = names.get(head, head)
                bases.append(f"{qualified}.{rest}" if rest else qualified)
            abstract, defined = set(), set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    defined.add(item.name)
                    if any("abstractmethod" in ast.unparse(d) for d in item.decorator_list):
                        abstract.add(item.name)
                elif isinstance(item, ast.Assign | ast.AnnAssign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    defined.update(t.id for t in targets if isinstance(t, ast.Name))
            found[f"{module}.{node.name}"] = _ClassInfo(bases, abstract, defined - abstract)

    def real(name: str, depth: int = 0) -> str:
        """Follow re-exports (``from a import B`` in a module a class is not defined in)."""
        if name in found or depth > 8:
            return name
        module, _, local = name.rpartition(".")
        target = imported.get(module, {}).get(local)
        return name if target is None or target == name else real(target, depth + 1)

    for info in found.values():
        info.bases = [real(base) for base in info.bases]
    return found


def _unimplemented(name: str, classes: dict[str, _ClassInfo]) -> set[str]:
    info = classes.get(name)
    if info is None:
        return set()
    inherited = set().union(*(_unimplemented(base, classes) for base in info.bases))
    return info.abstract | (inherited - info.defined)


def _one_variant_abstract_classes(package: Path) -> dict[str, list[str]]:
    """Abstract classes (not Protocols) under ``package`` with fewer than two concrete
    subclasses there, with those they have."""
    classes = _scan_classes(package)

    def ancestors(name: str) -> set[str]:
        bases = classes[name].bases if name in classes else []
        return set(bases).union(*(ancestors(base) for base in bases))

    concrete = {name for name in classes if not _unimplemented(name, classes)}
    lacking = {}
    for name, info in classes.items():
        protocol = any(base.split(".")[-1] == "Protocol" for base in info.bases)
        if protocol or name in concrete:
            continue
        variants = sorted(c for c in concrete if name in ancestors(c))
        if len(variants) < 2:
            lacking[name] = variants
    return lacking


@pytest.mark.parametrize("package", SOURCES, ids=lambda source: source.name)
def test_abstract_classes_have_two_variants_or_are_protocols(package: Path) -> None:
    lacking = _one_variant_abstract_classes(package)
    unexcused = {name: v for name, v in lacking.items() if name not in ONE_VARIANT_ALLOWED}
    assert not unexcused, (
        "abstract classes with fewer than two concrete subclasses: hold the part as an object "
        f"of its own (or make it a typing.Protocol): {unexcused}"
    )


def _edits_sys_path(path: Path) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_benchmarks_and_fixtures_never_edit_sys_path() -> None:
    editing = [str(path.relative_to(ROOT)) for _, path in _bench_modules() if _edits_sys_path(path)]
    assert not editing, f"import by the module's full name instead: {editing}"


def test_benchmarks_import_each_other_by_their_full_names() -> None:
    # a bare ``import common`` finds benchmarks/common.py only when run as a script from there
    siblings = {path.stem for source in BENCH_SOURCES for path in source.glob("*.py")}
    bare = {
        name: sorted(m for m in _imports(path) if m.split(".")[0] in siblings)
        for name, path in _bench_modules()
    }
    assert not {n: m for n, m in bare.items() if m}, bare


def test_fixtures_import_no_benchmark_and_benchmarks_only_the_shared_tests() -> None:
    against: dict[str, list[str]] = {}
    for name, path in _bench_modules():
        for imported in sorted(_imports(path)):
            top = imported.split(".")[0]
            fixture = _within(name, ("tests.fixtures",))
            if (top == "benchmarks" and fixture) or (
                top == "tests" and not _within(imported, SHARED_WITH_BENCHMARKS)
            ):
                against.setdefault(name, []).append(imported)
    assert not against, f"imports against the benchmarks' layers: {against}"


def test_kvtier_and_the_connector_import_neither_benchmarks_nor_tests() -> None:
    bad = {
        name: sorted(m for m in _imports(path) if m.split(".")[0] in {"benchmarks", "tests"})
        for name, path in _modules()
    }
    assert not {n: m for n, m in bad.items() if m}
