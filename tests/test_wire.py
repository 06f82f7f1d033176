"""The wire protocol, bytes only: codec round trips, framing, and every way a frame can be bad."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_client import wire
from ft_client.wire import FrameDecoder, ProtocolError, decode_body, encode

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

ALL_MESSAGES: list[wire.Message] = [
    wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, 3, {"pid": 1234, "host": "n1", "restart": 0}),
    wire.Hello(wire.PROTOCOL_VERSION, wire.Role.OBSERVER, -1),
    wire.HelloOk(wire.PROTOCOL_VERSION, {"monitor_pid": 99, "timeouts": {"rank_heartbeat_timeout": 5.0}}),
    wire.Error(wire.ErrorCode.BUSY, "a rank is already connected"),
    wire.Heartbeat(),
    wire.Exiting("ValueError: bad batch"),
    wire.SectionOpen("step"),
    wire.SectionOpen("ünïcødé section ✓"),
    wire.SectionOpen("x" * wire.MAX_NAME_BYTES),
    wire.SectionClose("ckpt"),
    wire.SectionCloseAll(),
    wire.UpdateConfig({"rank_section_timeouts": {"step": 30.0, "ckpt": None}, "learned": ["section:step"]}),
    wire.ConfigOk({"rank_heartbeat_timeout": None}),
    wire.Status(),
    wire.StatusReply({"connected": False, "nested": {"a": [1, 2.5, None, True, b"raw"]}}),
    wire.Ping(),
    wire.Pong(),
    wire.Goodbye(),
    wire.Iteration(0),
    wire.Iteration(2**40),
    wire.Control("shutdown_workload_monitoring", "user asked"),
    wire.HangNotice({"rank": 1, "message": "section 'step' open for 12.3 s, timeout 10.0 s", "onset_time": 1.5}),
    wire.Ack({}),
    wire.Abort(12, "rank 1: section 'step' open for 12.3 s, timeout 10.0 s", 1),
    wire.Abort(None, "x", None),
    wire.Restarting(3),
    wire.Reentered(2, "rank 1: ValueError: bad batch", 1, "exception", {"fault": 1.5, "seen": 1.6}),
    wire.Reentered(1, "", None, "monitor", {}),
    wire.WorkerStarted(4242, 3, "/logs/attempt_0/1/error.json"),
    wire.WorkerStarted(4242, 0, None),
    wire.SectionSlot("step", 0),
    wire.SectionSlot("data", 124),
    wire.RecordDeclined("the monitor's clock differs from this process's"),
    wire.RecordRefused("iteration -7 is below -1"),
    wire.DumpRequest(3, 4.5, True),
    wire.DumpReply({"connected": True, "rank": 1, "notes": []}),
    wire.FrDump("/tmp/run/rank1-pid42-fr3.json"),
]


def frame(body: bytes) -> bytes:
    """A length prefix + ``body``, whatever the body holds."""
    return struct.pack(">I", len(body)) + body


def packed(obj: Any) -> bytes:
    return frame(msgpack.packb(obj, use_bin_type=True))


def decode_all(data: bytes) -> list[wire.Message]:
    return list(FrameDecoder().feed(data))


# ---------------------------------------------------------------------------
# Round trips


def test_every_message_type_is_covered() -> None:
    covered = {type(m) for m in ALL_MESSAGES}
    assert len(covered) == len(wire.MsgType)


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: wire.Message) -> None:
    data = encode(msg)
    (size,) = struct.unpack(">I", data[: wire.HEADER_SIZE])
    assert size == len(data) - wire.HEADER_SIZE
    assert decode_body(data[wire.HEADER_SIZE :]) == msg
    dec = FrameDecoder()
    assert list(dec.feed(data)) == [msg]
    assert dec.buffered == 0


def test_fieldless_messages_decode_to_singletons() -> None:
    for msg in (wire.HEARTBEAT, wire.SECTION_CLOSE_ALL, wire.STATUS, wire.PING, wire.PONG, wire.GOODBYE):
        assert decode_all(encode(type(msg)()))[0] is msg


def test_several_frames_in_one_feed() -> None:
    stream = b"".join(encode(m) for m in ALL_MESSAGES)
    dec = FrameDecoder()
    assert list(dec.feed(stream)) == ALL_MESSAGES
    assert dec.buffered == 0


def test_frames_split_at_every_byte_boundary() -> None:
    stream = b"".join(encode(m) for m in ALL_MESSAGES[:8])
    for cut in range(len(stream) + 1):
        dec = FrameDecoder()
        got = list(dec.feed(stream[:cut])) + list(dec.feed(stream[cut:]))
        assert got == ALL_MESSAGES[:8], cut
        assert dec.buffered == 0


def test_feeding_byte_by_byte() -> None:
    stream = b"".join(encode(m) for m in ALL_MESSAGES)
    dec = FrameDecoder()
    got: list[wire.Message] = []
    for i in range(len(stream)):
        got.extend(dec.feed(stream[i : i + 1]))
    assert got == ALL_MESSAGES
    assert dec.buffered == 0


def test_empty_feed_yields_nothing() -> None:
    dec = FrameDecoder()
    assert list(dec.feed(b"")) == []
    assert dec.buffered == 0


@given(st.lists(st.sampled_from(ALL_MESSAGES), max_size=20), st.lists(st.integers(0, 400), max_size=10))
@settings(max_examples=100, deadline=None)
def test_round_trip_any_chunking(msgs: list[wire.Message], cuts: list[int]) -> None:
    stream = b"".join(encode(m) for m in msgs)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    dec = FrameDecoder()
    got: list[wire.Message] = []
    for a, b in zip(points, points[1:]):
        got.extend(dec.feed(stream[a:b]))
    assert got == msgs
    assert dec.buffered == 0


def test_heartbeat_frame_constant() -> None:
    assert wire.HEARTBEAT_FRAME == b"\x00\x00\x00\x02\x91\x04"
    assert encode(wire.Heartbeat()) is wire.HEARTBEAT_FRAME
    assert encode(wire.HEARTBEAT) is wire.HEARTBEAT_FRAME
    assert decode_all(wire.HEARTBEAT_FRAME) == [wire.HEARTBEAT]


def test_section_frame_helpers_match_encode() -> None:
    assert wire.section_open_frame("step") == encode(wire.SectionOpen("step"))
    assert wire.section_close_frame("step") == encode(wire.SectionClose("step"))


# ---------------------------------------------------------------------------
# Encoding refusals


@pytest.mark.parametrize("name", ["", "x" * (wire.MAX_NAME_BYTES + 1), "é" * (wire.MAX_NAME_BYTES // 2 + 1)])
def test_encode_refuses_bad_section_names(name: str) -> None:
    with pytest.raises(ProtocolError, match=r"^section name must be 1\.\.256 bytes of UTF-8, got \d+ bytes$"):
        encode(wire.SectionOpen(name))
    with pytest.raises(ProtocolError, match=r"^section name must be 1\.\.256 bytes of UTF-8, got \d+ bytes$"):
        wire.section_close_frame(name)


def test_encode_refuses_non_string_section_name() -> None:
    with pytest.raises(ProtocolError, match=r"^section name must be a string, got int$"):
        wire.section_open_frame(5)  # type: ignore[arg-type]


def test_encode_refuses_oversized_message() -> None:
    big = wire.StatusReply({"blob": b"x" * wire.MAX_FRAME})
    with pytest.raises(ProtocolError, match=r"^message of \d+ bytes exceeds the frame cap of 65536 bytes$"):
        encode(big)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError, match=r"^not a wire message: "):
        encode("hello")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Malformed input


@given(st.binary(max_size=2048))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    dec = FrameDecoder()
    try:
        msgs = list(dec.feed(data))
    except ProtocolError:
        return
    assert all(isinstance(m, tuple(type(x) for x in ALL_MESSAGES)) for m in msgs)


@given(st.lists(st.binary(max_size=64), max_size=16))
@settings(max_examples=200, deadline=None)
def test_arbitrary_chunks_raise_only_protocol_error(chunks: list[bytes]) -> None:
    dec = FrameDecoder()
    try:
        for chunk in chunks:
            list(dec.feed(chunk))
    except ProtocolError:
        pass


@given(st.binary(min_size=1, max_size=512))
@settings(max_examples=300, deadline=None)
def test_arbitrary_body_in_a_valid_frame_raises_only_protocol_error(body: bytes) -> None:
    try:
        decode_all(frame(body))
    except ProtocolError:
        pass


def test_truncated_frame_stays_buffered_without_error() -> None:
    data = encode(wire.SectionOpen("step"))
    dec = FrameDecoder()
    assert list(dec.feed(data[:2])) == []  # half a header
    assert dec.buffered == 2
    assert list(dec.feed(data[2:-1])) == []  # header, most of the body
    assert dec.buffered == len(data) - 1
    assert list(dec.feed(data[-1:])) == [wire.SectionOpen("step")]
    assert dec.buffered == 0


def test_complete_frames_before_a_truncated_one_are_delivered() -> None:
    data = wire.HEARTBEAT_FRAME + encode(wire.SectionOpen("step"))[:-2]
    dec = FrameDecoder()
    assert list(dec.feed(data)) == [wire.HEARTBEAT]
    assert dec.buffered == len(data) - len(wire.HEARTBEAT_FRAME)


def test_oversized_length_rejected_from_the_header_alone() -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match=r"^frame length 65537 outside 1\.\.65536$"):
        list(dec.feed(struct.pack(">I", wire.MAX_FRAME + 1)))


def test_huge_length_rejected_from_the_header_alone() -> None:
    with pytest.raises(ProtocolError, match=r"^frame length 4294967295 outside 1\.\.65536$"):
        decode_all(b"\xff\xff\xff\xff")


def test_max_frame_length_is_accepted_and_waits_for_the_body() -> None:
    dec = FrameDecoder()
    assert list(dec.feed(struct.pack(">I", wire.MAX_FRAME))) == []
    assert dec.buffered == wire.HEADER_SIZE


def test_zero_length_rejected() -> None:
    with pytest.raises(ProtocolError, match=r"^frame length 0 outside 1\.\.65536$"):
        decode_all(b"\x00\x00\x00\x00")


def test_bad_frame_after_good_ones_delivers_the_good_ones_first() -> None:
    dec = FrameDecoder()
    it = dec.feed(wire.HEARTBEAT_FRAME + b"\x00\x00\x00\x00")
    assert next(it) is wire.HEARTBEAT
    with pytest.raises(ProtocolError, match=r"^frame length 0 outside"):
        next(it)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x04",  # array of 2, one element present
        b"\x91\x04\x00",  # trailing data after the array
        b"\xdc\xff\xff",  # array16 of 65535 elements, none present
    ],
    ids=["reserved-byte", "short-array", "extra-data", "huge-array-header"],
)
def test_garbage_msgpack(body: bytes) -> None:
    with pytest.raises(ProtocolError, match=r"^body is not valid msgpack: \w+: "):
        decode_all(frame(body))


def test_non_string_map_key_rejected() -> None:
    body = packed([wire.MsgType.HELLO, 1, "rank", 0, {1: 2}])
    with pytest.raises(ProtocolError, match=r"^body is not valid msgpack: ValueError: .*strict_map_key"):
        decode_all(body)


@pytest.mark.parametrize(
    ("obj", "kind"),
    [({"type": 4}, "dict"), (4, "int"), ([], "list"), ("heartbeat", "str"), (None, "NoneType"), (b"\x04", "bytes")],
)
def test_body_must_be_a_non_empty_array(obj: Any, kind: str) -> None:
    with pytest.raises(ProtocolError, match=rf"^body must be a non-empty array, got {kind}$"):
        decode_all(packed(obj))


@pytest.mark.parametrize(("tag", "shown"), [(0, "0"), (99, "99"), (-1, "-1"), (4.0, "4.0"), (True, "True"),
                                            ("HEARTBEAT", "'HEARTBEAT'"), (None, "None"), (2**64 - 1, str(2**64 - 1))])
def test_unknown_type_tag(tag: Any, shown: str) -> None:
    with pytest.raises(ProtocolError, match=rf"^unknown message type {shown}$"):
        decode_all(packed([tag]))


@pytest.mark.parametrize(
    ("obj", "pattern"),
    [
        ([4, 0], r"^HEARTBEAT takes 0 field\(s\), got 1$"),
        ([5], r"^SECTION_OPEN takes 1 field\(s\), got 0$"),
        ([5, "a", "b"], r"^SECTION_OPEN takes 1 field\(s\), got 2$"),
        ([1, 1, "rank", 0], r"^HELLO takes 4 field\(s\), got 3$"),
        ([16, "x"], r"^CONTROL takes 2 field\(s\), got 1$"),
    ],
)
def test_wrong_field_count(obj: list[Any], pattern: str) -> None:
    with pytest.raises(ProtocolError, match=pattern):
        decode_all(packed(obj))


@pytest.mark.parametrize(
    ("obj", "pattern"),
    [
        ([1, "1", "rank", 0, {}], r"^version must be an integer, got str$"),
        ([1, True, "rank", 0, {}], r"^version must be an integer, got bool$"),
        ([1, 1, 7, 0, {}], r"^role must be a string, got int$"),
        ([1, 1, "rank", False, {}], r"^rank must be an integer, got bool$"),
        ([1, 1, "rank", 0.0, {}], r"^rank must be an integer, got float$"),
        ([1, 1, "rank", 0, []], r"^info must be a map, got list$"),
        ([2, 1, None], r"^session must be a map, got NoneType$"),
        ([3, 1, "m"], r"^error code must be a string, got int$"),
        ([3, "c", b"m"], r"^error message must be a string, got bytes$"),
        ([5, 5], r"^section name must be a string, got int$"),
        ([6, b"step"], r"^section name must be a string, got bytes$"),
        ([8, [1]], r"^timeouts must be a map, got list$"),
        ([9, "x"], r"^timeouts must be a map, got str$"),
        ([11, 0], r"^status must be a map, got int$"),
        ([15, True], r"^iteration must be an integer, got bool$"),
        ([15, 1.5], r"^iteration must be an integer, got float$"),
        ([16, None, "r"], r"^action must be a string, got NoneType$"),
        ([16, "a", 0], r"^reason must be a string, got int$"),
        ([25, 1, -1.0, True], r"^timeout must be a finite number of seconds >= 0, got -1.0$"),
        ([25, 1, float("nan"), True], r"^timeout must be a finite number of seconds >= 0, got nan$"),
        ([25, 1, 2.0, 1], r"^flight_recorder must be true or false, got int$"),
        ([26, []], r"^snapshot must be a map, got list$"),
        ([27, None], r"^path must be a string, got NoneType$"),
    ],
)
def test_wrong_field_types(obj: list[Any], pattern: str) -> None:
    with pytest.raises(ProtocolError, match=pattern):
        decode_all(packed(obj))


def test_section_name_empty() -> None:
    with pytest.raises(ProtocolError, match=r"^section name must be 1\.\.256 bytes of UTF-8, got 0 bytes$"):
        decode_all(packed([wire.MsgType.SECTION_OPEN, ""]))


def test_section_name_too_long_in_bytes() -> None:
    name = "€" * 86  # 258 bytes in UTF-8, only 86 characters
    with pytest.raises(ProtocolError, match=r"^section name must be 1\.\.256 bytes of UTF-8, got 258 bytes$"):
        decode_all(packed([wire.MsgType.SECTION_CLOSE, name]))


def test_section_name_of_exactly_max_bytes_is_accepted() -> None:
    name = "€" * 85 + "a"  # 256 bytes
    assert decode_all(packed([wire.MsgType.SECTION_OPEN, name])) == [wire.SectionOpen(name)]


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"st\xc3", b"\xed\xa0\x80"], ids=["ff-fe", "cut-sequence", "surrogate"])
def test_section_name_not_utf8(raw: bytes) -> None:
    # fixarray(2), positive fixint 5 (SECTION_OPEN), fixstr of len(raw) holding invalid UTF-8
    body = bytes([0x92, 0x05, 0xA0 | len(raw)]) + raw
    with pytest.raises(ProtocolError, match=r"^body is not valid msgpack: UnicodeDecodeError: "):
        decode_all(frame(body))


# ---------------------------------------------------------------------------
# No pickle, no extension types


CALLED: list[str] = []


def _side_effect(tag: str) -> None:
    CALLED.append(tag)


class _Payload:
    """Unpickling this calls _side_effect: the decoder must never do that."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_side_effect, ("unpickled",))


@pytest.mark.parametrize("code", [0, 1, 42, 127, -2, -128])
def test_extension_types_are_refused(code: int) -> None:
    data = b"\x80\x04payload"
    ext = b"\xc7" + bytes([len(data)]) + struct.pack(">b", code) + data  # ext 8, built by hand
    bodies = (
        ext,
        b"\x92\x05" + ext,  # [SECTION_OPEN, ext]
        b"\x95\x01\x01\xa4rank\x00\x81\xa1x\x91" + ext,  # [HELLO, 1, "rank", 0, {"x": [ext]}]
    )
    for body in bodies:
        with pytest.raises(ProtocolError, match=rf"^msgpack extension type {code} is not allowed$"):
            decode_all(frame(body))
    if code >= 0:  # the same through msgpack's own packer
        assert msgpack.packb([wire.MsgType.SECTION_OPEN, msgpack.ExtType(code, data)]) == b"\x92\x05" + ext


def test_timestamp_extension_becomes_a_plain_float() -> None:
    obj = [wire.MsgType.STATUS_REPLY, {"t": msgpack.Timestamp(1, 500_000_000)}]
    (msg,) = decode_all(packed(obj))
    assert msg == wire.StatusReply({"t": 1.5})
    assert type(msg.status["t"]) is float  # type: ignore[union-attr]


def test_pickle_bytes_are_not_unpickled() -> None:
    import pickle

    payload = pickle.dumps(_Payload())
    CALLED.clear()
    with pytest.raises(ProtocolError):
        decode_all(frame(payload))
    # inside a valid message, pickle bytes are just bytes
    (msg,) = decode_all(packed([wire.MsgType.STATUS_REPLY, {"p": payload}]))
    assert msg == wire.StatusReply({"p": payload})
    assert CALLED == []


@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
))
@settings(max_examples=200, deadline=None)
def test_decoded_values_are_plain_data(value: Any) -> None:
    (msg,) = decode_all(packed([wire.MsgType.STATUS_REPLY, {"v": value}]))
    assert msg == wire.StatusReply({"v": value})


def test_read_frame_blocking() -> None:
    data = bytearray(encode(wire.Control("stop", "why")) + b"\x00\x00\x00\x00")

    def recv_exact(n: int) -> bytes:
        chunk = bytes(data[:n])
        del data[:n]
        return chunk

    assert wire.read_frame_blocking(recv_exact) == wire.Control("stop", "why")
    with pytest.raises(ProtocolError, match=r"^frame length 0 outside 1\.\.65536$"):
        wire.read_frame_blocking(recv_exact)
