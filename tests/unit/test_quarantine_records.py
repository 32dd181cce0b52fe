"""Quarantines kept as records: read back as they were written, and an unreadable record still
quarantines its namespace rather than stopping the tiers from starting."""

from __future__ import annotations

from kvtier.tiering.quarantine import RECORD_PREFIX, Quarantines


class Records:
    def __init__(self) -> None:
        self.kept: dict[bytes, bytes] = {}

    def records(self) -> dict[bytes, bytes]:
        return dict(self.kept)

    def write_record(self, key: bytes, value: bytes | None) -> None:
        if value is None:
            self.kept.pop(key, None)
        else:
            self.kept[key] = value


def test_kept_quarantines_are_read_back_and_a_lift_is_kept_too() -> None:
    kept = Records()
    first = Quarantines(kept)
    assert first.add(b"n" * 16, "a target chunk differs by 1.41", "replica dp1, engine e-7")
    assert first.add(b"m" * 16, "a draft chunk differs by 1.40")
    assert first.lift(b"m" * 16)
    again = Quarantines(kept)
    assert again.namespaces == {b"n" * 16}
    [held] = again.listed()
    assert held.reason == "a target chunk differs by 1.41"
    assert held.source == "replica dp1, engine e-7"  # who found it, kept too
    assert held.since_unix_s == first.listed()[0].since_unix_s


def test_an_unreadable_record_still_quarantines_its_namespace() -> None:
    kept = Records()
    kept.kept[RECORD_PREFIX + b"n" * 16] = b"{not json"
    kept.kept[RECORD_PREFIX + b"m" * 16] = b'{"reason": "fine"}'  # no time
    kept.kept[b"other/record"] = b"\xff"  # not a quarantine: ignored
    quarantines = Quarantines(kept)
    assert quarantines.namespaces == {b"n" * 16, b"m" * 16}
    assert all("unreadable" in q.reason for q in quarantines.listed())
    assert quarantines.lift(b"n" * 16)
    assert RECORD_PREFIX + b"n" * 16 not in kept.kept


class FullDisk(Records):
    def write_record(self, key: bytes, value: bytes | None) -> None:
        raise OSError(28, "No space left on device")


def test_a_quarantine_that_cannot_be_kept_still_holds() -> None:
    quarantines = Quarantines(FullDisk())
    assert quarantines.add(b"n" * 16, "a target chunk differs by 1.41")
    assert quarantines.holds(b"n" * 16)
    assert quarantines.lift(b"n" * 16)
    assert not quarantines.holds(b"n" * 16)
