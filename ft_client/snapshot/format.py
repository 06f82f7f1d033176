"""The layout of an in-memory snapshot buffer, and its total reader (docs/snapshots.md).

A buffer is a memory file the rank's monitor owns. It holds one snapshot of one
rank's training state::

    [0, 4096)                      header (below), written last when a save completes
    [4096, 4096 + layout_len)      layout: msgpack of the state's tree, tensors as references
    [data_offset, + data_len)      the tensors' bytes, each at a 64-byte aligned offset

The header says who wrote it (job, rank, world size), which step, how the bytes are
laid out, and an XXH3-64 checksum over everything after the header. A save first stamps the
header `WRITING`, then writes the layout and the bytes, and stamps it `COMPLETE` with
the checksum last: a writer killed in between leaves `WRITING` (a torn write), and
the other buffer of the pair still holds the previous snapshot whole.

Everything here is pure and imports no torch: `parse_header`, `decode_layout` and
`check` take bytes someone else wrote (the monitor's memory, a peer's copy) and
return a value or raise `SnapshotFormatError`, nothing else. The layout is msgpack
with three extension types of ours (a tensor reference, a tuple, a DTensor: its local shard's
reference, global shape and stride, placements and device mesh, the meshes listed once in the
layout's ``meshes``, written only when a state holds DTensors): nothing is unpickled, and
`decode_layout` decodes it iteratively, within bounds of depth and size (another process can
write any layout and recompute the checksum, which has no key).
"""

from __future__ import annotations

import math
import mmap
import reprlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from ft_client.errors import MemorySnapshotError

MAGIC = b"ftsnap\x00\x01"
VERSION = 1
HEADER_SIZE = 4096
ALIGN = 64
MAX_LAYOUT = 256 * 2**20
"""The most layout bytes a reader decodes (a state of millions of tensors is not plausible)."""
MAX_JOB_BYTES = 64

EMPTY, WRITING, COMPLETE = 0, 1, 2
STATE_NAMES = {EMPTY: "empty", WRITING: "writing", COMPLETE: "complete"}

_EXT_TENSOR = 1
_EXT_TUPLE = 2
_EXT_DTENSOR = 3

# magic, version, state, generation, step, rank, world, layout_len, data_offset, data_len,
# saved_at (wall clock), job, checksum (XXH3-64 of [HEADER_SIZE, data_offset + data_len)),
# head_crc (crc32 of the packed fields before it)
_HEAD = struct.Struct("<8sIIQqqqQQQd64sQ")
_CRC = struct.Struct("<I")
HEAD_BYTES = _HEAD.size + _CRC.size

# dtype name -> bytes per element: the dtypes a snapshot may hold (torch's names, without "torch.")
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}


Bytes = bytes | bytearray | memoryview | mmap.mmap
"""What the readers take: a copy, or the monitor's mapped memory itself."""


class SnapshotFormatError(MemorySnapshotError, ValueError):
    """Bytes that are not a complete snapshot of this layout (why is the message)."""


@dataclass(frozen=True)
class Header:
    state: int
    generation: int
    step: int
    rank: int
    world: int
    layout_len: int
    data_offset: int
    data_len: int
    saved_at: float
    job: str
    checksum: int

    @property
    def end(self) -> int:
        """The buffer's bytes this snapshot uses."""
        return self.data_offset + self.data_len

    def pack(self) -> bytes:
        job = self.job.encode()
        if len(job) > MAX_JOB_BYTES:
            raise SnapshotFormatError(f"job id {self.job[:80]!r} is over {MAX_JOB_BYTES} bytes")
        body = _HEAD.pack(MAGIC, VERSION, self.state, self.generation, self.step, self.rank, self.world,
                          self.layout_len, self.data_offset, self.data_len, self.saved_at, job, self.checksum)
        return body + _CRC.pack(zlib.crc32(body))


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor's bytes are: its dtype's name, shape, offset into the data area, size."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor's place in the tree: an index into the layout's tensor list."""

    index: int


@dataclass(frozen=True)
class MeshSpec:
    """A DTensor's device mesh as saved: device type, shape, global ranks (row-major), dimension names."""

    device_type: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    names: tuple[str, ...] | None = None


Placement = tuple[Any, ...]
"""One mesh dimension's placement: ``("R",)`` replicate, ``("S", dim)`` shard the tensor's
``dim``, ``("P", reduce_op)`` partial (torch's Replicate, Shard, Partial)."""
PARTIAL_OPS = frozenset({"sum", "avg", "min", "max", "product", "band", "bor", "bxor"})
MAX_MESH_DIMS = 16


@dataclass(frozen=True)
class DTensorRef:
    """A DTensor's place in the tree: its local shard (an index into the tensor list, a plain
    tensor there) and what makes it a DTensor again: its global shape and stride, one placement
    per mesh dimension, its mesh."""

    index: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh: MeshSpec


def aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def parse_header(raw: Bytes) -> Header:
    """The header at the start of ``raw``; SnapshotFormatError for anything that is not one."""
    if len(raw) < HEAD_BYTES:
        raise SnapshotFormatError(f"{len(raw)} bytes are too few for a snapshot header ({HEAD_BYTES})")
    body = bytes(raw[:_HEAD.size])
    (crc,) = _CRC.unpack_from(raw, _HEAD.size)
    magic, version, state, generation, step, rank, world, layout_len, data_offset, data_len, saved_at, job, \
        checksum = _HEAD.unpack(body)
    if magic != MAGIC:
        if magic == bytes(8):
            raise SnapshotFormatError("empty: nothing was ever saved in it")
        raise SnapshotFormatError(f"not a snapshot (magic {magic!r})")
    if version != VERSION:
        raise SnapshotFormatError(f"layout version {version}; this client reads version {VERSION}")
    if zlib.crc32(body) != crc:
        raise SnapshotFormatError("its header's checksum does not match: the header is corrupt")
    if state not in STATE_NAMES:
        raise SnapshotFormatError(f"unknown state {state}")
    if not (0 <= rank and 0 < world and rank < world) and state != EMPTY:
        raise SnapshotFormatError(f"rank {rank} of a world of {world}")
    if layout_len > MAX_LAYOUT or data_offset < HEADER_SIZE + layout_len or data_offset % ALIGN:
        raise SnapshotFormatError(f"a layout of {layout_len} bytes and data at {data_offset} do not fit together")
    if not math.isfinite(saved_at):
        raise SnapshotFormatError("its save time is not a number")
    try:
        job_text = job.rstrip(b"\x00").decode()
    except UnicodeDecodeError as e:
        raise SnapshotFormatError("its job id is not UTF-8") from e
    return Header(state=state, generation=generation, step=step, rank=rank, world=world, layout_len=layout_len,
                  data_offset=data_offset, data_len=data_len, saved_at=saved_at, job=job_text, checksum=checksum)


def describe(raw: Bytes) -> dict[str, Any]:
    """What a header says, for status lines: never raises. ``state`` is one of empty, writing,
    complete, invalid (with ``why``)."""
    try:
        h = parse_header(raw)
    except SnapshotFormatError as e:
        if str(e).startswith("empty"):
            return {"state": "empty", "step": None, "rank": None, "generation": None}
        return {"state": "invalid", "step": None, "rank": None, "generation": None, "why": str(e)}
    return {"state": STATE_NAMES[h.state], "step": h.step, "rank": h.rank, "generation": h.generation,
            "bytes": h.end, "job": h.job}


def checksum(data: Bytes) -> int:
    """XXH3-64 of ``data`` (xxhash releases the GIL while it hashes: the training thread runs on)."""
    return int(xxhash.xxh3_64_intdigest(data))


def body_checksum(buf: Bytes, header: Header) -> int:
    """XXH3-64 of the layout and the data (what COMPLETE's ``checksum`` covers)."""
    view = memoryview(buf)[HEADER_SIZE:header.end]
    try:
        return checksum(view)
    finally:
        view.release()


def check(buf: Bytes, *, job: str, rank: int) -> Header:
    """The header of a complete, intact snapshot of ``job``'s ``rank`` in ``buf``, or
    SnapshotFormatError saying why this buffer cannot be restored from."""
    h = parse_header(buf)
    if h.state == EMPTY:
        raise SnapshotFormatError("empty: nothing was ever saved in it")
    if h.state == WRITING:
        raise SnapshotFormatError(f"a torn write: its writer stopped while saving step {h.step} "
                                  f"(generation {h.generation})")
    if h.job != job:
        raise SnapshotFormatError(f"it holds job {h.job!r}'s snapshot, not job {job!r}'s")
    if h.rank != rank:
        raise SnapshotFormatError(f"it holds rank {h.rank}'s snapshot, not rank {rank}'s")
    if h.end > len(buf):
        raise SnapshotFormatError(f"it claims {h.end} bytes, the buffer has {len(buf)}")
    got = body_checksum(buf, h)
    if got != h.checksum:
        raise SnapshotFormatError(f"checksum mismatch (step {h.step}: {got:016x}, header says {h.checksum:016x}): "
                                  "its bytes changed after the save")
    return h


# -- the layout ------------------------------------------------------------------------------
def encode_layout(tree: Any, tensors: Sequence[TensorSpec]) -> bytes:
    """msgpack of ``{"tree": tree, "tensors": [...]}``, and ``"meshes": [...]`` after them when the
    tree holds DTensorRef; ``tree`` holds TensorRef where tensors were, and only plain values
    besides (the caller checked them). A tree without DTensors gives the bytes it always gave."""
    meshes: dict[MeshSpec, int] = {}
    by_id: dict[int, int] = {}  # a mesh's ranks hashed once per MeshSpec object, not once per DTensor

    def default(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(obj.index))
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(list(obj), default=default, strict_types=True))
        if isinstance(obj, DTensorRef):
            m = by_id.get(id(obj.mesh))
            if m is None:
                m = by_id[id(obj.mesh)] = meshes.setdefault(obj.mesh, len(meshes))
            return msgpack.ExtType(_EXT_DTENSOR, msgpack.packb(
                [obj.index, list(obj.shape), list(obj.stride), [list(p) for p in obj.placements], m]))
        raise SnapshotFormatError(f"a {type(obj).__name__} cannot be put in a snapshot's layout")

    specs = [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in tensors]
    packed_tree = msgpack.packb(tree, default=default, strict_types=True)
    # the map by hand, its values packed already: {"tree": ..., "tensors": ...[, "meshes": ...]}
    parts = [b"\x83" if meshes else b"\x82", msgpack.packb("tree"), packed_tree, msgpack.packb("tensors"),
             msgpack.packb(specs)]
    if meshes:
        parts += [msgpack.packb("meshes"), msgpack.packb(
            [[m.device_type, list(m.shape), list(m.ranks), None if m.names is None else list(m.names)]
             for m in meshes])]
    return b"".join(parts)


MAX_TUPLE_DEPTH = 100
"""Tuples nested deeper than this refuse the layout."""
MAX_TREE_DEPTH = 100
"""A tree nested deeper than this refuses the layout (`tree.flatten` refuses to save one)."""
TUPLE_BYTES_FACTOR = 8
TUPLE_BYTES_SLACK = 1 << 20
"""A tuple's bytes are decoded again inside each tuple around it: all tuples' bytes together may
be at most TUPLE_BYTES_FACTOR times the layout's length plus TUPLE_BYTES_SLACK (room for small
tuples nested deep), so that a layout cannot make the decoder do quadratic work."""
_TENSOR_REF_BYTES = 9  # the longest msgpack int
_LEAVES = frozenset({type(None), bool, int, float, str, bytes})


class _Ext:
    """An extension value as msgpack hands it to the hook, kept undecoded: `_resolve` decodes
    it afterwards, from its own loop (a hook that decoded it would nest unpackb on the C stack)."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code = code
        self.data = data

    def __repr__(self) -> str:
        return f"<extension type {self.code} of {len(self.data)} bytes>"


def _unpack(data: bytes | memoryview) -> Any:
    """One msgpack value, extension values left as `_Ext`; SnapshotFormatError for anything else.
    An array or map may claim at most as many items, a str, bin or ext as many bytes, as ``data``
    has bytes (said here, not left to msgpack's defaults): a value is at least one byte, so the
    values built are at most the bytes decoded."""
    n = len(data)
    try:
        return msgpack.unpackb(data, ext_hook=_Ext, strict_map_key=False, raw=False, max_str_len=n,
                               max_bin_len=n, max_array_len=n, max_map_len=n // 2, max_ext_len=n)
    except Exception as e:  # msgpack raises many types for bad bytes: all of them mean "not a layout"
        raise SnapshotFormatError(f"its layout does not decode ({type(e).__name__}: {str(e)[:200]})") from e


def decode_layout(raw: bytes | memoryview, data_len: int) -> tuple[Any, list[TensorSpec]]:
    """The tree (TensorRef where tensors were, DTensorRef where DTensors were) and the tensors'
    places; SnapshotFormatError for any bytes that are not a consistent layout, and nothing else.
    (Whether a DTensor's shard is the one its rank holds: `tree.check_shards`, with the header's rank.)

    Iterative: msgpack decodes one level, with tuples and tensor references left as their
    bytes, and `_resolve`'s loop decodes those (no unpackb runs inside another). Bounded:
    tuples nest at most MAX_TUPLE_DEPTH deep and the tree MAX_TREE_DEPTH deep, and the bytes
    decoded again inside tuples total at most TUPLE_BYTES_FACTOR x ``len(raw)`` +
    TUPLE_BYTES_SLACK, so the values built are at most as many as the bytes decoded."""
    if len(raw) > MAX_LAYOUT:
        raise SnapshotFormatError(f"a layout of {len(raw)} bytes (at most {MAX_LAYOUT})")
    try:
        doc = _unpack(raw)
        if not isinstance(doc, dict) or set(doc) not in ({"tree", "tensors"}, {"tree", "tensors", "meshes"}) \
                or not isinstance(doc["tensors"], list) or not isinstance(doc.get("meshes", []), list):
            raise SnapshotFormatError("its layout is not a map of tree and tensors (and meshes)")
        specs = [_spec(item, data_len) for item in doc["tensors"]]
        meshes = [_mesh(item) for item in doc.get("meshes", [])]
        dt = _DTensors(specs, meshes)
        tree = _resolve(doc["tree"], dt, TUPLE_BYTES_FACTOR * len(raw) + TUPLE_BYTES_SLACK)
    except SnapshotFormatError:
        raise
    except Exception as e:  # a reader is total: whatever else the bytes provoke refuses them too
        raise SnapshotFormatError(f"its layout does not decode ({type(e).__name__}: {str(e)[:200]})") from e
    return tree, specs


def _resolve(tree: Any, dt: _DTensors, budget: int) -> Any:
    """``tree`` with its `_Ext` values decoded (TensorRef, tuple, DTensorRef), checked: keys str or
    int, plain leaves, references below the number of tensors, DTensors by `_DTensors`, the depths,
    at most ``budget`` bytes of tuples.

    A loop over a stack of (container, its depth, tuples around it): a tuple's bytes are
    decoded into a list, which takes the tuple's place and is walked in turn; the lists
    become tuples at the end, innermost first (a tuple is built after its items)."""
    root: list[Any] = [tree]
    stack: list[tuple[list[Any] | dict[Any, Any], int, int]] = [(root, -1, 0)]
    tuples: list[tuple[list[Any] | dict[Any, Any], Any, list[Any]]] = []
    spent = 0
    while stack:
        container, depth, outer = stack.pop()
        if container and depth + 1 > MAX_TREE_DEPTH:
            raise SnapshotFormatError(f"a tree nested over {MAX_TREE_DEPTH} deep")
        if type(container) is dict:
            for k in container:
                if type(k) is not str and type(k) is not int:
                    raise SnapshotFormatError(f"a map key {reprlib.repr(k)} (keys are str or int)")
        slots = container.items() if type(container) is dict else enumerate(container)
        for slot, v in slots:
            t = type(v)
            if t is list or t is dict:
                stack.append((v, depth + 1, outer))
            elif t is _Ext:
                if v.code == _EXT_TENSOR:
                    container[slot] = _tensor_ref(v.data, len(dt.specs))
                elif v.code == _EXT_DTENSOR:
                    container[slot] = dt.ref(v.data)
                elif v.code == _EXT_TUPLE:
                    if outer >= MAX_TUPLE_DEPTH:  # decoded recursively, ~200 killed the process (SIGSEGV)
                        raise SnapshotFormatError(f"tuples nested over {MAX_TUPLE_DEPTH} deep")
                    spent += len(v.data)
                    if spent > budget:
                        raise SnapshotFormatError(f"its tuples hold {spent} bytes or more, decoded again inside "
                                                  f"each other (at most {budget} for this layout)")
                    items = _unpack(v.data)
                    if type(items) is not list:
                        raise SnapshotFormatError("a tuple that is not a list")
                    container[slot] = items  # the bytes go now: only the undecoded ones are held
                    tuples.append((container, slot, items))
                    stack.append((items, depth + 1, outer + 1))
                else:
                    raise SnapshotFormatError(f"an unknown extension type {v.code}")
            elif t not in _LEAVES:  # a msgpack Timestamp (extension type -1 never reaches the hook)
                raise SnapshotFormatError(f"a {t.__name__} in the tree (extension type -1, which layouts do not use)")
    for container, slot, items in reversed(tuples):
        container[slot] = tuple(items)
    return root[0]


def _tensor_ref(data: bytes, count: int) -> TensorRef:
    index: Any = None
    if len(data) <= _TENSOR_REF_BYTES:
        try:
            index = msgpack.unpackb(data, ext_hook=_Ext)
        except Exception:
            index = None
    if type(index) is not int or index < 0:
        raise SnapshotFormatError(f"a tensor reference {reprlib.repr(index if index is not None else data)} "
                                  "that is not an index")
    if index >= count:
        raise SnapshotFormatError(f"a reference to tensor {index} of {count}")
    return TensorRef(index)


def _spec(item: object, data_len: int) -> TensorSpec:
    if not (isinstance(item, list) and len(item) == 4):
        raise SnapshotFormatError(f"a tensor entry {reprlib.repr(item)} is not [dtype, shape, offset, size]")
    dtype, shape, offset, nbytes = item
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise SnapshotFormatError(f"a tensor of dtype {reprlib.repr(dtype)}, which snapshots do not hold")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 64:
        raise SnapshotFormatError(f"a tensor shape {reprlib.repr(shape)} that is not a list of sizes")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
            or offset + nbytes > data_len or offset % ALIGN:
        raise SnapshotFormatError(f"a tensor at {reprlib.repr(offset)} of {reprlib.repr(nbytes)} bytes outside "
                                  f"the {data_len} data bytes")
    if math.prod(shape) * ITEMSIZE[dtype] != nbytes:
        raise SnapshotFormatError(f"a {dtype} tensor of shape {shape} in {nbytes} bytes")
    return TensorSpec(dtype, tuple(shape), offset, nbytes)


def _sizes(v: object, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 64 or not all(type(d) is int and 0 <= d < 2**63 for d in v):
        raise SnapshotFormatError(f"a DTensor {what} {reprlib.repr(v)} that is not a list of sizes")
    return tuple(v)


def dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays out ``shape`` with no overlap or gap, as torch's is_non_overlapping_and_dense."""
    dims = sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1)  # innermost first; size 1: any stride
    return 0 in shape or all(st == math.prod(sz for _, sz in dims[:i]) for i, (st, _) in enumerate(dims))


def _mesh(item: object) -> MeshSpec:
    """A device mesh of the layout's ``meshes``: [device type, shape, ranks (row-major), names or nil]."""
    if not (isinstance(item, list) and len(item) == 4):
        raise SnapshotFormatError(f"a mesh entry {reprlib.repr(item)} is not [device, shape, ranks, names]")
    device, shape, ranks, names = item
    if not isinstance(device, str) or not 0 < len(device) <= 64:
        raise SnapshotFormatError(f"a mesh of device type {reprlib.repr(device)}")
    if not isinstance(shape, list) or not 0 < len(shape) <= MAX_MESH_DIMS \
            or not all(type(n) is int and n > 0 for n in shape):
        raise SnapshotFormatError(f"a mesh shape {reprlib.repr(shape)} that is not a list of sizes")
    if not isinstance(ranks, list) or not all(type(r) is int and 0 <= r < 2**31 for r in ranks) \
            or len(set(ranks)) != len(ranks) or math.prod(shape) != len(ranks):
        raise SnapshotFormatError(f"a mesh of shape {shape} whose ranks {reprlib.repr(ranks)} are not its "
                                  "distinct ranks")
    if names is not None and not (isinstance(names, list) and len(names) == len(shape)
                                  and all(isinstance(n, str) for n in names)):
        raise SnapshotFormatError(f"mesh dimension names {reprlib.repr(names)} that are not one str per dimension")
    return MeshSpec(device, tuple(shape), tuple(ranks), None if names is None else tuple(names))


class _DTensors:
    """Decodes and checks a layout's DTensor entries: [local tensor index, global shape, global stride,
    placements (one per mesh dimension: ["R"], ["S", dim] or ["P", reduce op]), mesh index]; the local
    tensor has the global shape's dimensions, each as large (unsharded) or at most as large (sharded)."""

    def __init__(self, specs: list[TensorSpec], meshes: list[MeshSpec]) -> None:
        self.specs, self.meshes = specs, meshes

    def ref(self, data: bytes) -> DTensorRef:
        item = _unpack(data)
        if not (isinstance(item, list) and len(item) == 5):
            raise SnapshotFormatError(f"a DTensor entry {reprlib.repr(item)} is not "
                                      "[tensor, shape, stride, placements, mesh]")
        index, shape, stride, placements, m = item
        if type(index) is not int or not 0 <= index < len(self.specs):
            raise SnapshotFormatError(f"a DTensor of tensor {reprlib.repr(index)} of {len(self.specs)}")
        if type(m) is not int or not 0 <= m < len(self.meshes):
            raise SnapshotFormatError(f"a DTensor on mesh {reprlib.repr(m)} of {len(self.meshes)}")
        mesh, spec = self.meshes[m], self.specs[index]
        shape, stride = _sizes(shape, "shape"), _sizes(stride, "stride")
        if len(stride) != len(shape) or len(spec.shape) != len(shape) or not dense(shape, stride):
            raise SnapshotFormatError(f"a DTensor of shape {list(shape)}, stride {list(stride)} and a local tensor of "
                                      f"shape {list(spec.shape)} (one stride a dimension, no overlap, no gap)")
        if not isinstance(placements, list) or len(placements) != len(mesh.shape):
            raise SnapshotFormatError(f"DTensor placements {reprlib.repr(placements)} that are not one per "
                                      f"dimension of its {len(mesh.shape)}-dimensional mesh")
        ps = tuple(_placement(p, len(shape)) for p in placements)
        sharded = {p[1] for p in ps if p[0] == "S"}
        if any(local > size if d in sharded else local != size
               for d, (local, size) in enumerate(zip(spec.shape, shape))):
            raise SnapshotFormatError(f"a local tensor of shape {list(spec.shape)} for a DTensor of shape "
                                      f"{list(shape)} placed {ps}")
        return DTensorRef(index, shape, stride, ps, mesh)


def _placement(p: object, ndim: int) -> Placement:
    if p == ["R"]:
        return ("R",)
    if isinstance(p, list) and len(p) == 2 and p[0] == "S" and type(p[1]) is int and 0 <= p[1] < ndim:
        return ("S", p[1])
    if isinstance(p, list) and len(p) == 2 and p[0] == "P" and isinstance(p[1], str) and p[1] in PARTIAL_OPS:
        return ("P", p[1])
    raise SnapshotFormatError(f"a DTensor placement {reprlib.repr(p)} (snapshots hold Replicate, "
                              f"Shard of a dimension below {ndim} and Partial)")
