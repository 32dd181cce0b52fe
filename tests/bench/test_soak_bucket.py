"""The soak's judge of bucket bytes: a node's bytes are the objects whose last PUT was its own,
so a name one node deleted and another wrote again counts once, for the other."""

from __future__ import annotations

from benchmarks.soak_bucket import Ledger


def test_a_name_written_again_by_another_node_counts_for_that_node_only() -> None:
    ledger = Ledger("bucket")
    ledger.put("node0", "a/obj", 100)
    ledger.delete("node0", ["a/obj"])  # evicted by its budget
    ledger.put("node1", "a/obj", 100)  # the same first chunk, uploaded again by another node
    ledger.put("node0", "a/mine", 50)
    check = ledger.check({"a/obj": 100, "a/mine": 50}, {"node0": 0, "node1": 0}, ledger.mark())
    assert check.bytes_above_budget == {"node0": 50, "node1": 100}
    assert check.foreign_deleted == 0
