"""The snapshot format's DTensor entries (ft_client.snapshot.format) and the pure pieces of
their rebuild (ft_client.snapshot.tree): no torch.distributed here.

A DTensor is saved as its local shard (an ordinary tensor of the layout's list) and an entry of
extension type 3 in the tree: [tensor index, global shape, global stride, placements, mesh
index], the meshes listed once in the layout's ``meshes``. Those bytes are untrusted like the
rest of the layout: whatever they are, `decode_layout` gives a consistent DTensorRef or
SnapshotFormatError, and a state without DTensors is encoded as it always was."""

from __future__ import annotations

import importlib
import itertools
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_client.snapshot import format as fmt
from ft_client.snapshot import tree
from ft_client.snapshot.format import DTensorRef, MeshSpec, SnapshotFormatError, TensorRef, TensorSpec

WORLD = MeshSpec("cpu", (2,), (0, 1))
HSDP = MeshSpec("cuda", (2, 2), (0, 1, 2, 3), ("replicate", "shard"))


def _old_encode(t: Any, tensors: list[TensorSpec]) -> bytes:
    """encode_layout as it was before DTensors (the bytes every existing snapshot holds)."""
    def default(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return msgpack.ExtType(fmt._EXT_TENSOR, msgpack.packb(obj.index))
        if isinstance(obj, tuple):
            return msgpack.ExtType(fmt._EXT_TUPLE, msgpack.packb(list(obj), default=default, strict_types=True))
        raise TypeError(obj)

    specs = [[s.dtype, list(s.shape), s.offset, s.nbytes] for s in tensors]
    packed: bytes = msgpack.packb({"tree": t, "tensors": specs}, default=default, strict_types=True)
    return packed


def test_a_state_without_dtensors_is_encoded_as_it_always_was() -> None:
    specs = [TensorSpec("float32", (2, 3), 0, 24), TensorSpec("int64", (), 64, 8)]
    t = {"w": TensorRef(0), "opt": {0: {"step": TensorRef(1), "betas": (0.9, 0.99)}}, "names": ["a", (1, (2,))]}
    assert fmt.encode_layout(t, specs) == _old_encode(t, specs)
    assert fmt.decode_layout(_old_encode(t, specs), 128) == (t, specs)


def _specs() -> list[TensorSpec]:
    # the local shards: rank 0's of a [7, 5] sharded on dim 0 of 2 (4 rows), a replicated [3],
    # a [5, 1] sharded on dim 1 of 2 then replicated, and an empty shard (rank 1's of [1, 7])
    return [TensorSpec("float32", (4, 5), 0, 80), TensorSpec("bfloat16", (3,), 128, 6),
            TensorSpec("float32", (5, 1), 192, 20), TensorSpec("float32", (0, 7), 256, 0)]


def _refs() -> dict[str, Any]:
    return {"w": DTensorRef(0, (7, 5), (5, 1), (("S", 0),), WORLD),
            "r": DTensorRef(1, (3,), (1,), (("R",),), WORLD),
            "h": [DTensorRef(2, (5, 2), (2, 1), (("R",), ("S", 1)), HSDP),
                  (DTensorRef(0, (4, 5), (5, 1), (("P", "sum"),), WORLD), TensorRef(0))],
            "e": DTensorRef(3, (1, 7), (7, 1), (("S", 0),), WORLD)}


def test_dtensor_entries_round_trip_with_each_mesh_listed_once() -> None:
    raw = fmt.encode_layout(_refs(), _specs())
    t, specs = fmt.decode_layout(raw, 512)
    assert t == _refs() and specs == _specs()
    assert t["w"].mesh is t["r"].mesh  # one MeshSpec per mesh entry
    doc = msgpack.unpackb(raw, ext_hook=lambda code, data: (code, data), strict_map_key=False)
    assert list(doc) == ["tree", "tensors", "meshes"] and doc["meshes"] == [
        ["cpu", [2], [0, 1], None], ["cuda", [2, 2], [0, 1, 2, 3], ["replicate", "shard"]]]
    assert doc["tree"]["w"] == (fmt._EXT_DTENSOR, msgpack.packb([0, [7, 5], [5, 1], [["S", 0]], 0]))


def _layout(entry: Any, meshes: Any = (["cpu", [2], [0, 1], None],), tensors: Any = None, **extra: Any) -> bytes:
    """A layout by hand: one DTensor entry (its payload as given) over ``_specs()``'s tensors."""
    specs = [[s.dtype, list(s.shape), s.offset, s.nbytes] for s in _specs()] if tensors is None else tensors
    doc = {"tree": {"x": msgpack.ExtType(fmt._EXT_DTENSOR, msgpack.packb(entry))}, "tensors": specs,
           **({"meshes": list(meshes) if isinstance(meshes, tuple) else meshes} if meshes is not None else {}), **extra}
    packed: bytes = msgpack.packb(doc)
    return packed


GOOD = [0, [7, 5], [5, 1], [["S", 0]], 0]


@pytest.mark.parametrize("raw, why", [
    (_layout(GOOD[:4]), "is not \\[tensor, shape, stride, placements, mesh\\]"),
    (_layout({"a": 1}), "is not \\[tensor"),
    (_layout([9, *GOOD[1:]]), "a DTensor of tensor 9 of 4"),
    (_layout([-1, *GOOD[1:]]), "a DTensor of tensor -1"),
    (_layout([*GOOD[:4], 1]), "a DTensor on mesh 1 of 1"),
    (_layout(GOOD, meshes=None), "a DTensor on mesh 0 of 0"),  # no meshes: every DTensor entry is refused
    (_layout([0, [7, -5], [5, 1], [["S", 0]], 0]), "a DTensor shape \\[7, -5\\]"),
    (_layout([0, [7, 2**64 - 1], [5, 1], [["S", 0]], 0]), "a DTensor shape"),
    (_layout([0, [7, 5], [5], [["S", 0]], 0]), "stride \\[5\\] and a local tensor"),
    (_layout([0, [7, 5], [0, 0], [["S", 0]], 0]), "stride \\[0, 0\\] and a local tensor .* no overlap, no gap"),
    (_layout([0, [7, 5], [1, 4], [["S", 0]], 0]), "stride \\[1, 4\\]"),  # forged strides: overlapping, wider
    (_layout([0, [7, 5], [2**62, 1], [["S", 0]], 0]), f"stride \\[{2**62}, 1\\]"),
    (_layout([0, [7, 5], [5, 2], [["S", 0]], 0]), "stride \\[5, 2\\]"),  # a gap: past the storage's end
    (_layout([0, [7, 5], [1, 7], [["S", 0]], 0]), None),  # a transposed tensor's (dense): accepted
    (_layout([0, [7, 5, 1], [5, 1, 1], [["S", 0]], 0]), "and a local tensor of shape \\[4, 5\\]"),
    (_layout([0, [7, 5], [5, 1], [["S", 0], ["R"]], 0]), "not one per dimension of its 1-dimensional mesh"),
    (_layout([0, [7, 5], [5, 1], [["S", 2]], 0]), "a DTensor placement \\['S', 2\\]"),
    (_layout([0, [7, 5], [5, 1], [["S", -1]], 0]), "a DTensor placement"),
    (_layout([0, [7, 5], [5, 1], [["P", "mean"]], 0]), "a DTensor placement \\['P', 'mean'\\]"),
    (_layout([0, [7, 5], [5, 1], [["_StridedShard", 0, 2]], 0]), "a DTensor placement"),
    (_layout([0, [7, 5], [5, 1], "S0", 0]), "not one per dimension"),
    (_layout([0, [3, 5], [5, 1], [["S", 0]], 0]), "a local tensor of shape \\[4, 5\\] for a DTensor of shape \\[3, 5\\]"),
    (_layout([0, [7, 6], [6, 1], [["S", 0]], 0]), "for a DTensor of shape \\[7, 6\\]"),  # an unsharded dim differs
    (_layout([0, [4, 5], [5, 1], [["R"]], 0]), None),  # replicated: the shard is the whole tensor (accepted)
    (_layout(GOOD, meshes=[["cpu", [2], [0, 0], None]]), "are not its distinct ranks"),
    (_layout(GOOD, meshes=[["cpu", [3], [0, 1], None]]), "are not its distinct ranks"),
    (_layout(GOOD, meshes=[["cpu", [2], [0, -1], None]]), "are not its distinct ranks"),
    (_layout(GOOD, meshes=[["cpu", [2], [0, 2**31], None]]), "are not its distinct ranks"),
    (_layout(GOOD, meshes=[["cpu", [0], [], None]]), "a mesh shape \\[0\\]"),
    (_layout(GOOD, meshes=[["cpu", [1] * 17, [0], None]]), "a mesh shape"),
    (_layout(GOOD, meshes=[["", [2], [0, 1], None]]), "a mesh of device type ''"),
    (_layout(GOOD, meshes=[["cpu", [2], [0, 1], ["a", "b"]]]), "one str per dimension"),
    (_layout(GOOD, meshes=[["cpu", [2], [0, 1]]]), "is not \\[device, shape, ranks, names\\]"),
    (_layout(GOOD, meshes="cpu"), "not a map of tree and tensors"),
    (_layout(GOOD, other=1), "not a map of tree and tensors"),
])
def test_odd_dtensor_entries_are_refused_with_their_reason(raw: bytes, why: str | None) -> None:
    if why is None:
        t, _ = fmt.decode_layout(raw, 512)
        assert type(t["x"]) is DTensorRef
        return
    with pytest.raises(SnapshotFormatError, match=why):
        fmt.decode_layout(raw, 512)


def test_a_stride_is_accepted_exactly_when_it_addresses_each_element_of_its_shape_once() -> None:
    """`dense` against its definition: the offsets sum(i * stride) over all indexes are 0 .. numel - 1."""
    checked = 0
    for ndim in (1, 2, 3):
        for shape in itertools.product((0, 1, 2, 3), repeat=ndim):
            for stride in itertools.product((0, 1, 2, 3, 4, 6, 9, 12), repeat=ndim):
                offsets = sorted(sum(i * s for i, s in zip(index, stride))
                                 for index in itertools.product(*(range(n) for n in shape)))
                assert fmt.dense(shape, stride) == (offsets == list(range(len(offsets)))), (shape, stride)
                checked += 1
    assert checked > 30000


_ints = st.one_of(st.integers(-3, 9), st.integers(-(2**63), 2**64 - 1))
_sizes = st.lists(_ints, max_size=4)
_placement = st.one_of(st.just(["R"]), st.builds(lambda d: ["S", d], _ints),
                       st.builds(lambda op: ["P", op], st.sampled_from(["sum", "avg", "mean", ""])),
                       st.lists(st.one_of(_ints, st.text(max_size=2)), max_size=3))
_entry = st.one_of(st.builds(lambda *a: list(a), _ints, _sizes, _sizes, st.lists(_placement, max_size=3), _ints),
                   st.lists(st.one_of(_ints, _sizes, st.none(), st.text(max_size=3)), max_size=6))
_mesh = st.one_of(st.builds(lambda *a: list(a), st.sampled_from(["cpu", "cuda", ""]), _sizes, _sizes,
                            st.one_of(st.none(), st.lists(st.text(max_size=2), max_size=3))),
                  st.lists(_ints, max_size=5))


@given(entry=_entry, meshes=st.lists(_mesh, max_size=3), rank=st.integers(0, 4))
@settings(max_examples=400, deadline=None)
def test_any_dtensor_entry_gives_a_consistent_dtensor_or_a_refusal(entry: Any, meshes: list[Any], rank: int) -> None:
    raw = _layout(entry, meshes)
    try:
        t, specs = fmt.decode_layout(raw, 512)
    except SnapshotFormatError:
        return
    ref = t["x"]
    assert type(ref) is DTensorRef and 0 <= ref.index < len(specs)
    assert len(ref.placements) == len(ref.mesh.shape) and len(ref.stride) == len(ref.shape)
    assert len(ref.mesh.ranks) == len(set(ref.mesh.ranks))
    local = specs[ref.index].shape
    assert len(local) == len(ref.shape) and all(a <= b for a, b in zip(local, ref.shape))
    try:  # the rank's own check: the shard it holds, or a refusal
        tree.check_shards(t, specs, rank)
    except SnapshotFormatError:
        return
    assert tree.local_shape(ref, rank) == local


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_a_valid_dtensor_layout_with_bytes_changed_gives_a_layout_or_a_refusal(data: st.DataObject) -> None:
    raw = bytearray(fmt.encode_layout(_refs(), _specs()))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        fmt.decode_layout(bytes(raw[:data.draw(st.integers(0, len(raw)))]), 512)
    except SnapshotFormatError:
        pass


# -- the shard a rank holds (pure), against torch's own computation -----------------------------------
def _torch_local_shape(ref: DTensorRef, coord: tuple[int, ...]) -> tuple[int, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # takes plain data

    placed = [Shard(p[1]) if p[0] == "S" else Partial(p[1]) if p[0] == "P" else Replicate() for p in ref.placements]
    shape, _ = _compute_local_shape_and_global_offset(ref.shape, ref.mesh.shape, list(coord), placed)
    return tuple(int(n) for n in shape)


@pytest.mark.skipif(not hasattr(importlib.import_module("torch.distributed.tensor._utils"),
                                 "_compute_local_shape_and_global_offset"),
                    reason="torch's _compute_local_shape_and_global_offset, which takes plain data, is there from 2.7")
def test_the_shard_of_each_rank_is_the_one_torch_cuts() -> None:
    meshes = [MeshSpec("cpu", (n,), tuple(range(n))) for n in (1, 2, 3, 4)] + \
             [MeshSpec("cpu", s, tuple(range(s[0] * s[1]))) for s in ((2, 2), (2, 3), (3, 2))]
    checked = 0
    for mesh in meshes:
        kinds = [("R",), ("P", "sum"), ("S", 0), ("S", 1)]
        for placements in itertools.product(kinds, repeat=len(mesh.shape)):
            for shape in itertools.product((0, 1, 2, 5, 7, 8), (1, 3, 4)):
                ref = DTensorRef(0, shape, (shape[1], 1), placements, mesh)
                for rank in mesh.ranks:
                    coord = tree.coordinate(mesh, rank)
                    assert coord is not None
                    assert tree.local_shape(ref, rank) == _torch_local_shape(ref, coord), (ref, rank)
                    checked += 1
    assert checked > 3000
    assert tree.local_shape(DTensorRef(0, (7,), (1,), (("S", 0),), WORLD), 5) is None  # not in the mesh
    assert tree.coordinate(HSDP, 2) == (1, 0) and tree.coordinate(MeshSpec("c", (2, 3), (5, 4, 3, 2, 1, 0)), 2) == (1, 0)


def test_a_shard_that_is_not_the_ranks_own_is_refused() -> None:
    t, specs = fmt.decode_layout(fmt.encode_layout({"w": _refs()["w"]}, _specs()), 512)
    tree.check_shards(t, specs, 0)  # rank 0 holds rows 0-3 of 7: 4 rows
    with pytest.raises(SnapshotFormatError, match=r"state\['w'\]: rank 1's shard of a DTensor of shape \[7, 5\] "
                                                  r"placed \(\('S', 0\),\) is \[3, 5\], not \[4, 5\]"):
        tree.check_shards(t, specs, 1)
    with pytest.raises(SnapshotFormatError, match=r"rank 2's DTensor on a mesh of ranks \[0, 1\] without it"):
        tree.check_shards(t, specs, 2)
    empty = {"h": [(_refs()["e"],)]}  # rank 1's empty shard of a [1, 7]: refused for rank 0, who holds the row
    t, specs = fmt.decode_layout(fmt.encode_layout(empty, _specs()), 512)
    tree.check_shards(t, specs, 1)
    with pytest.raises(SnapshotFormatError, match=r"state\['h'\]\[0\]\[0\]: rank 0's shard .* is \[1, 7\], not \[0, 7\]"):
        tree.check_shards(t, specs, 0)
