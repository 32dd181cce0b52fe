"""The dependency rules: kvtier never imports vLLM or torch; the connector uses kvtier's public
surface only, never its tiers or server internals; the client modules never load the server, the
manager or a tier."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(package: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        if "api" in path.relative_to(package).parts:
            continue  # generated stubs
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_kvtier_imports_neither_vllm_nor_torch() -> None:
    bad = {
        path: sorted(n for n in names if n.split(".")[0] in {"vllm", "torch"})
        for path, names in _imports(ROOT / "kvtier").items()
    }
    assert not {p: n for p, n in bad.items() if n}


def test_connector_uses_only_kvtiers_public_surface() -> None:
    internal = ("kvtier.tiers", "kvtier.server", "kvtier.api")
    bad = {
        path: sorted(n for n in names if n.startswith(internal))
        for path, names in _imports(ROOT / "connectors" / "kvtier_vllm").items()
    }
    assert not {p: n for p, n in bad.items() if n}
    assert any("kvtier.client" in names for names in _imports(ROOT / "connectors").values())


CLIENT_MODULES = ("kvtier.rpc", "kvtier.client", "kvtier.protocol", "kvtier.codec")
# the arena file's own layout, which a client maps to reach the chunks: no tier
ARENA_MODULES = ("kvtier.tiers", "kvtier.tiers.arena", "kvtier.tiers.arena_index")


def _forbidden_for_clients(module: str) -> bool:
    if module in ARENA_MODULES:
        return False
    return any(
        module == root or module.startswith(root + ".")
        for root in ("kvtier.server", "kvtier.manager", "kvtier.tiers")
    )


def _module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _type_checking(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(path: Path) -> set[str]:
    """kvtier modules ``path`` imports when run, at any depth, less ``if TYPE_CHECKING``."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return {m for m in found if m.split(".")[0] == "kvtier" and _module_path(m) is not None}


def test_client_modules_never_import_the_server_manager_or_tiers() -> None:
    # static: everything the client modules import, followed to the end
    seen: dict[str, str] = {}
    todo = [(m, "") for m in CLIENT_MODULES]
    while todo:
        module, via = todo.pop()
        if module in seen or module.startswith("kvtier.api"):  # generated stubs
            continue
        seen[module] = via
        path = _module_path(module)
        assert path is not None, module
        todo.extend((m, module) for m in _runtime_imports(path))
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
    assert "kvtier.protocol" in loaded
    assert not [m for m in loaded if _forbidden_for_clients(m)]
