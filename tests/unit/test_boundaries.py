"""The dependency rules: kvtier never imports vLLM or torch; the connector uses kvtier's public
surface only, never its tiers or server internals."""

from __future__ import annotations

import ast
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
