from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.api.v1 import tier_pb2
from kvtier.core import wire

refs = st.lists(
    st.builds(
        tier_pb2.SlotRef,
        key=st.binary(min_size=17, max_size=48),
        slot=st.integers(0, 2**40),
        offset=st.integers(0, 2**50),
        nbytes=st.integers(0, 2**30),
        generation=st.integers(0, 2**63),
    ),
    max_size=5,
)


@given(st.text(max_size=40), st.integers(17, 48), st.integers(0, 300), refs)
def test_hand_encoded_requests_parse_as_the_generated_classes(
    session: str, key_bytes: int, count: int, slot_refs: list[tier_pb2.SlotRef]
) -> None:
    packed = bytes(range(256)) * (key_bytes * count // 256 + 1)
    packed = packed[: key_bytes * count]
    raw = wire.key_request(session, key_bytes, packed, [r.SerializeToString() for r in slot_refs])
    reserve = tier_pb2.ReserveRequest.FromString(raw)
    expected = tier_pb2.ReserveRequest(session_id=session, commit=slot_refs)
    if packed:
        expected.keys.CopyFrom(tier_pb2.KeyBatch(key_bytes=key_bytes, packed=packed))
    assert reserve == expected
    lookup = tier_pb2.LookupRequest.FromString(wire.key_request(session, key_bytes, packed))
    assert lookup.keys.packed == packed
    assert lookup.session_id == session
    assert not lookup.lease
    refs = [r.SerializeToString() for r in slot_refs]
    flags = (tier_pb2.LookupRequest.LEASE_FIELD_NUMBER, tier_pb2.LookupRequest.AGAIN_FIELD_NUMBER)
    leasing = wire.key_request(session, key_bytes, packed, refs, flags=flags)
    expected_lookup = tier_pb2.LookupRequest(
        session_id=session, release=slot_refs, lease=True, again=True
    )
    if packed:
        expected_lookup.keys.CopyFrom(tier_pb2.KeyBatch(key_bytes=key_bytes, packed=packed))
    assert tier_pb2.LookupRequest.FromString(leasing) == expected_lookup


def test_varint_matches_protobuf() -> None:
    assert wire.varint(0) == b"\x00"
    for value in (1, 127, 128, 300, 2**21, 2**32 - 1):
        msg = tier_pb2.KeyBatch(key_bytes=value)  # field 1: one tag byte, then the varint
        assert msg.SerializeToString()[1:] == wire.varint(value)
