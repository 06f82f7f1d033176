"""ft_client.snapshot.format.decode_layout against hostile bytes (issue 38).

A layout is bytes another process can write (its checksum has no key): whatever they are,
`decode_layout` gives a valid layout or SnapshotFormatError, quickly, without recursing on the
C stack (tuples 200 deep once killed the restoring process with SIGSEGV). Inputs nested deep are
built in loops here, so that building them does not recurse either. The restore that falls back
to the other buffer is tested in test_snapshot.py.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_client.snapshot import format as fmt
from ft_client.snapshot.format import SnapshotFormatError, TensorRef, TensorSpec

DATA_LEN = 1 << 20
LEAVES = (type(None), bool, int, float, str, bytes)


# -- msgpack by hand -----------------------------------------------------------------------------
def _ext(code: int, payload: bytes) -> bytes:
    """An ext32 of ``payload`` (msgpack reads the long form of a short ext too)."""
    return b"\xc9" + struct.pack(">Ib", len(payload), code) + payload


def _array(n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n)


def _map(n: int) -> bytes:
    return b"\xdf" + struct.pack(">I", n)


def _layout(tree: bytes, tensors: bytes = b"\x90") -> bytes:
    """``{"tree": tree, "tensors": tensors}`` of already encoded values."""
    return _map(2) + b"\xa4tree" + tree + b"\xa7tensors" + tensors


HUGE = {  # headers claiming 2^32 - 1 bytes or items, the most a msgpack length says
    "str": b"\xdb\xff\xff\xff\xff",
    "bin": b"\xc6\xff\xff\xff\xff",
    "array": b"\xdd\xff\xff\xff\xff",
    "map": b"\xdf\xff\xff\xff\xff",
    "ext": b"\xc9\xff\xff\xff\xff\x02",
}

_LEVEL: dict[str, Callable[[int], bytes]] = {  # one level of nesting around an encoded value of ``n`` bytes: its bytes before the value
    "list": lambda n: b"\x91",
    "map": lambda n: b"\x81\xa1k",
    "tuple": lambda n: b"\xc9" + struct.pack(">Ib", n + 1, fmt._EXT_TUPLE) + b"\x91",  # a tuple of one item
}


def _nested(kinds: list[str], depth: int, inner: bytes = b"\xc0") -> bytes:
    """``inner`` inside ``depth`` levels (kinds taken in turn, outermost first), built in a loop:
    each level's header is computed from the size inside it, then all are joined."""
    size, heads = len(inner), []
    for i in range(depth):
        head = _LEVEL[kinds[(depth - 1 - i) % len(kinds)]](size)
        heads.append(head)
        size += len(head)
    return b"".join(reversed(heads)) + inner


# -- what may come out -------------------------------------------------------------------------------
def _decoded(raw: bytes, data_len: int = DATA_LEN) -> tuple[Any, list[TensorSpec]] | None:
    """decode_layout's layout, checked valid, or None for its refusal: nothing else may come out."""
    try:
        tree, specs = fmt.decode_layout(raw, data_len)
    except SnapshotFormatError:
        return None
    assert type(specs) is list and all(type(s) is TensorSpec and s.offset + s.nbytes <= data_len for s in specs)
    stack: list[tuple[Any, int]] = [(tree, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        assert depth <= fmt.MAX_TREE_DEPTH
        if type(node) is dict:
            assert all(type(k) in (str, int) for k in node)
            stack.extend((v, depth + 1) for v in node.values())
        elif type(node) in (list, tuple):
            stack.extend((v, depth + 1) for v in node)
        elif type(node) is TensorRef:
            assert type(node.index) is int and 0 <= node.index < len(specs)
        else:
            assert type(node) in LEAVES, node
    # each value takes a byte at least, of the layout or of a tuple decoded again
    assert nodes <= len(raw) * (1 + fmt.TUPLE_BYTES_FACTOR) + fmt.TUPLE_BYTES_SLACK
    return tree, specs


def _refused(raw: bytes, why: str | None = None) -> str:
    with pytest.raises(SnapshotFormatError, match=why) as e:
        fmt.decode_layout(raw, DATA_LEN)
    return str(e.value)


# -- hostile msgpack ---------------------------------------------------------------------------------
_codes = st.one_of(st.sampled_from([fmt._EXT_TENSOR, fmt._EXT_TUPLE, -1, 0, 3, 42]), st.integers(-128, 127))
_plain = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                   st.text(max_size=6), st.binary(max_size=6))
_good_leaf = st.one_of(_plain.map(msgpack.packb),
                       st.integers(0, 1).map(lambda i: _ext(fmt._EXT_TENSOR, msgpack.packb(i))))
_odd_leaf = st.one_of(
    st.builds(_ext, _codes, st.binary(max_size=12)),  # any extension type, odd payloads
    st.builds(_ext, st.just(fmt._EXT_TENSOR), st.one_of(  # tensor references: past the end, negative, not ints
        st.integers(-(2**63), 2**64 - 1).map(msgpack.packb), st.binary(max_size=12), _plain.map(msgpack.packb))),
    st.sampled_from(list(HUGE.values())),
    st.just(msgpack.packb(msgpack.Timestamp(1, 2))),  # extension type -1: msgpack decodes it past the hook
)
_leaf = st.one_of(*[_good_leaf.map(bytes)] * 4, _odd_leaf.map(bytes))  # mostly well formed: odd ones sit deep


def _containers(children: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    good_keys = st.one_of(st.text(max_size=4), st.integers(-5, 5)).map(msgpack.packb)
    array = st.lists(children, max_size=4).map(lambda xs: _array(len(xs)) + b"".join(xs))
    good = st.one_of(
        array,
        st.lists(st.tuples(good_keys, children), max_size=3).map(
            lambda kvs: _map(len(kvs)) + b"".join(k + v for k, v in kvs)),
        array.map(lambda b: _ext(fmt._EXT_TUPLE, b)),  # a tuple: its items inside its ext
    )
    odd = st.one_of(
        st.lists(st.tuples(st.one_of(good_keys, children), children), max_size=3).map(
            lambda kvs: _map(len(kvs)) + b"".join(k + v for k, v in kvs)),  # keys of any type: lists, exts, ...
        children.map(lambda b: _ext(fmt._EXT_TUPLE, b)),  # a tuple whose payload is any value
        st.builds(_ext, _codes, children),  # any extension type over msgpack
        st.builds(lambda b, n: b[:-n], children, st.integers(1, 8)),  # cut short
        st.builds(lambda b, n: b + b"\xc0" * n, children, st.integers(1, 3)),  # extra bytes after it
    )
    return st.one_of(*[good.map(bytes)] * 6, odd.map(bytes))  # (mapped: one_of would flatten their branches)


_values = st.recursive(_leaf, _containers, max_leaves=24)
_specs = msgpack.packb([["float32", [2, 3], 0, 24], ["uint8", [], 64, 1]])


@given(tree=_values, tensors=st.one_of(st.just(_specs), _values))
@settings(max_examples=300, deadline=None)
def test_nested_extension_types_give_a_layout_or_a_refusal(tree: bytes, tensors: bytes) -> None:
    _decoded(_layout(tree, _specs))
    _decoded(_layout(tree, tensors))
    _decoded(tree)


@given(st.binary(max_size=400))
@settings(max_examples=400, deadline=None)
def test_random_bytes_give_a_layout_or_a_refusal(raw: bytes) -> None:
    _decoded(raw)
    _decoded(_layout(raw))


@given(kind=st.sampled_from(sorted(HUGE)), where=st.sampled_from(["layout", "tree", "tuple", "tuple in tuple",
                                                                   "tensor", "key", "tensors", "spec"]),
       tail=st.binary(max_size=24))
@settings(max_examples=300, deadline=None)
def test_a_length_of_2_to_the_32_is_refused_wherever_it_is(kind: str, where: str, tail: bytes) -> None:
    huge = HUGE[kind] + tail
    raw = {
        "layout": huge,
        "tree": _layout(_array(2) + b"\xc0" + huge),
        "tuple": _layout(_ext(fmt._EXT_TUPLE, _array(1) + huge)),
        "tuple in tuple": _layout(_array(1) + _ext(fmt._EXT_TUPLE, b"\x91" + _ext(fmt._EXT_TUPLE, b"\x92\xc0" + huge))),
        "tensor": _layout(_ext(fmt._EXT_TENSOR, huge)),
        "key": _layout(b"\x81" + huge + b"\xc0"),
        "tensors": _layout(b"\xc0", huge),
        "spec": _layout(b"\xc0", b"\x91\x94\xa7float32" + huge),
    }[where]
    _refused(raw)


@pytest.mark.parametrize("depth", [300, 10_000])
@pytest.mark.parametrize("kinds, where", [
    (["tuple"], "tree"), (["list"], "tree"), (["map"], "tree"), (["tuple", "list"], "tree"),
    (["map", "tuple"], "tree"), (["tuple", "map", "list"], "tree"), (["list"], "tensors"), (["tuple"], "tensors"),
    (["list", "map"], "layout"), (["tuple"], "tensor"),
])
def test_nesting_300_or_10000_deep_is_refused_quickly(kinds: list[str], where: str, depth: int) -> None:
    nested = _nested(kinds, depth)
    raw = {"tree": _layout(nested), "tensors": _layout(b"\xc0", b"\x91" + nested), "layout": nested,
           "tensor": _layout(_ext(fmt._EXT_TENSOR, nested))}[where]
    t0 = time.perf_counter()
    why = _refused(raw, "deep|does not decode|tuples hold|not \\[dtype|not an index|not a map")
    assert time.perf_counter() - t0 < 1.0, why


def test_tuples_and_trees_as_deep_as_the_limits_decode_one_level_more_is_refused() -> None:
    deepest: Any = (TensorRef(0),)
    for _ in range(fmt.MAX_TUPLE_DEPTH - 1):
        deepest = (deepest,)
    spec = [TensorSpec("float32", (1,), 0, 4)]
    tree, _ = fmt.decode_layout(fmt.encode_layout(deepest, spec), 64)  # 100 tuples, a reference 100 deep
    assert tree == deepest
    _refused(fmt.encode_layout((deepest,), spec), f"tuples nested over {fmt.MAX_TUPLE_DEPTH} deep")
    lists = _layout(_nested(["list"], fmt.MAX_TREE_DEPTH))
    assert fmt.decode_layout(lists, 0)[0] is not None
    _refused(_layout(_nested(["list"], fmt.MAX_TREE_DEPTH + 1)), f"a tree nested over {fmt.MAX_TREE_DEPTH} deep")
    _refused(_layout(_nested(["map", "list"], fmt.MAX_TREE_DEPTH + 1, b"\x90")), "a tree nested over")


def test_tuples_cannot_make_the_decoder_decode_their_bytes_over_and_over() -> None:
    # 99 tuples around 256 KiB: each level decodes again all that is inside it (25 MiB in all)
    inner = msgpack.packb(bytes(256 << 10))
    raw = _layout(_nested(["tuple"], 99, inner))
    t0 = time.perf_counter()
    why = _refused(raw, "its tuples hold")
    assert time.perf_counter() - t0 < 0.5, why
    # a few tuples around much: kept (each byte is decoded again at most TUPLE_BYTES_FACTOR times on average)
    few = _layout(_nested(["tuple"], 3, msgpack.packb(bytes(4 << 20))))
    assert fmt.decode_layout(few, 0)[0] == (((bytes(4 << 20),),),)


@pytest.mark.parametrize("tree, why", [
    (msgpack.packb({1.5: 1}), "a map key 1.5"),
    (msgpack.packb({None: 1}), "a map key None"),
    (msgpack.packb({b"k": 1}), "a map key b'k'"),
    (b"\x81" + _ext(fmt._EXT_TUPLE, b"\x90") + b"\xc0", "a map key <extension type 2"),
    (b"\x81" + _ext(fmt._EXT_TENSOR, b"\x00") + b"\xc0", "a map key <extension type 1"),
    (b"\x81\x91\x01\xc0", "does not decode \\(TypeError"),  # a list as a key: unhashable
    (_ext(fmt._EXT_TUPLE, b"\x91" + _ext(42, b"")), "an unknown extension type 42"),
    (_ext(fmt._EXT_TUPLE, b"\x91" + _ext(fmt._EXT_TUPLE, b"\x05")), "a tuple that is not a list"),
    (_ext(fmt._EXT_TUPLE, b"\x90\xc0"), "does not decode \\(ExtraData"),
    (_ext(fmt._EXT_TENSOR, _ext(fmt._EXT_TENSOR, b"\x00")), "a tensor reference .* that is not an index"),
    (_ext(fmt._EXT_TENSOR, msgpack.packb(-1)), "a tensor reference -1 that is not an index"),
    (_ext(fmt._EXT_TENSOR, msgpack.packb(2**64 - 1)), "a reference to tensor 18446744073709551615 of 2"),
    (_ext(fmt._EXT_TENSOR, b"\xcf" + bytes(8) + b"\x00"), "that is not an index"),  # more than an int's bytes
    (_ext(fmt._EXT_TENSOR, b""), "that is not an index"),
    (msgpack.packb(msgpack.Timestamp(1, 2)), "a Timestamp in the tree"),
    (_ext(-1, b"\x00"), "does not decode"),  # a timestamp of a length msgpack refuses
])
def test_odd_layouts_are_refused_with_their_reason(tree: bytes, why: str) -> None:
    _refused(_layout(tree, _specs), why)


def test_a_tensor_entry_nested_deep_is_refused_not_a_recursion_error() -> None:
    # its message once came from str() of the entry: 1000 lists deep raised RecursionError
    why = _refused(_layout(b"\xc0", b"\x91" + _nested(["list"], 1000)), "is not \\[dtype")
    assert len(why) < 200


# -- the format itself round-trips ------------------------------------------------------------------
def _reference_decode(raw: bytes) -> Any:
    """The decoder before issue 38 (recursive, through the hook), for trees shallow enough for it."""
    def ext(code: int, data: bytes) -> Any:
        if code == fmt._EXT_TENSOR:
            return TensorRef(msgpack.unpackb(data))
        assert code == fmt._EXT_TUPLE
        return tuple(msgpack.unpackb(data, ext_hook=ext, strict_map_key=False, raw=False))
    return msgpack.unpackb(raw, ext_hook=ext, strict_map_key=False, raw=False)


def _same(a: Any, b: Any) -> None:
    """Equal, and of the same types all the way down (a tuple stays a tuple, True stays True)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b))
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _trees(count: int) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                       st.text(max_size=8), st.binary(max_size=8), st.integers(0, count - 1).map(TensorRef))
    return st.recursive(leaves, lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-(2**63), 2**64 - 1)), kids, max_size=4)),
        max_leaves=30)


@given(data=st.data(), count=st.integers(1, 5))
@settings(max_examples=150, deadline=None)
def test_trees_with_tuples_round_trip(data: st.DataObject, count: int) -> None:
    tree = data.draw(_trees(count))
    specs = [TensorSpec("uint8", (i,), 64 * i, i) for i in range(count)]
    raw = fmt.encode_layout(tree, specs)
    got_tree, got_specs = fmt.decode_layout(raw, 64 * count)
    _same(tree, got_tree)
    assert got_specs == specs
    _same(_reference_decode(raw)["tree"], got_tree)  # as the recursive decoder read it: the format is unchanged
