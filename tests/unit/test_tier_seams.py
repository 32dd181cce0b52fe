"""The tiers ask the parts they hold: `CpuTier` its `ArenaSlots` (``self.slots``), `LmdbTier` its
`LmdbStore` (``self.store``), through the methods and properties each part declares, and never
assigns, deletes or mutates what the part holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier.tiers.cpu_slots import ArenaSlots
from kvtier.tiers.lmdb_store import LmdbStore

TIERS = Path(__file__).resolve().parents[2] / "kvtier" / "tiers"
# a part's public attributes set in its __init__: the arena and its replicas' usage (read for
# capacities, quotas and owners' names), the environment and its budget
DECLARED_FIELDS = {
    ArenaSlots: {"memory", "slot_count", "usage"},
    LmdbStore: {"env", "budget", "space", "set_aside"},
}


def _uses(module: str, part: str) -> list[tuple[int, str, bool]]:
    """(line, attribute, written) for each ``self.<part>.<attribute>`` in ``module``."""
    tree = ast.parse((TIERS / module).read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        inner = node.value if isinstance(node, ast.Attribute) else None
        if not (
            isinstance(inner, ast.Attribute)
            and inner.attr == part
            and isinstance(inner.value, ast.Name)
            and inner.value.id == "self"
        ):
            continue
        assert isinstance(node, ast.Attribute)
        parent = parents[node]
        written = (
            not isinstance(node.ctx, ast.Load)
            or (isinstance(parent, ast.Subscript) and not isinstance(parent.ctx, ast.Load))
            or (isinstance(parent, ast.AugAssign) and parent.target is node)
        )
        uses.append((node.lineno, node.attr, written))
    return uses


@pytest.mark.parametrize(
    ("module", "part", "cls"),
    [("cpu.py", "slots", ArenaSlots), ("lmdb_tier.py", "store", LmdbStore)],
)
def test_a_tier_reaches_its_part_only_through_what_the_part_declares(
    module: str, part: str, cls: type
) -> None:
    declared = {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    declared |= DECLARED_FIELDS[cls] | {"__contains__"}
    uses = _uses(module, part)
    assert uses, f"{module} never uses self.{part}"
    written = [(line, name) for line, name, w in uses if w]
    assert not written, f"{module} writes its {part}' fields: {written}"
    undeclared = sorted({(line, name) for line, name, _ in uses if name not in declared})
    assert not undeclared, f"{module} reads what {cls.__name__} does not declare: {undeclared}"
