"""A state's tree and its tensors (docs/snapshots.md, "save").

`flatten` turns what `save` is given (dicts, lists, tuples, plain values, tensors, DTensors,
objects with ``state_dict()``) into a tree of plain values with a `TensorRef` where each tensor
was (a `DTensorRef` where a DTensor was: its local shard is the tensor saved, beside what makes
it a DTensor again), and the list of those tensors, or refuses it by path; `lay_out` gives each
tensor its place in a buffer's data area; `view` shows a tensor's bytes in the monitor's memory
to torch without a copy; `rebuild` puts tensors back into a tree, and `DTensors` makes the
DTensors again, on the device meshes of the state given to restore or on meshes made as
recorded. torch is imported when they run.
"""

from __future__ import annotations

import mmap
import reprlib
import sys
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from ft_client.errors import MemorySnapshotError
from ft_client.snapshot import format as fmt
from ft_client.snapshot.format import DTensorRef, MeshSpec, Placement, SnapshotFormatError, TensorRef, TensorSpec

if TYPE_CHECKING:
    import torch

_PLAIN = (str, bytes, float, type(None), bool)
_MESHES: weakref.WeakKeyDictionary[Any, MeshSpec] = weakref.WeakKeyDictionary()
"""A device mesh's MeshSpec, made once per mesh (its ranks are read from a tensor)."""


def _dtensor_type() -> Any:
    """torch's DTensor class when torch.distributed.tensor is imported (no DTensor exists before), else None."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def flatten(obj: Any, path: str, tensors: list[torch.Tensor], depth: int = 0,
            found: dict[str, Any] | None = None) -> Any:
    """``obj`` with each tensor replaced by a TensorRef (appended to ``tensors``), each DTensor by a
    DTensorRef (its local shard appended; the DTensor itself put in ``found`` by path when given);
    Stateful objects (``state_dict()``) by their state; anything else a snapshot cannot hold refused
    by path."""
    import torch

    if depth > 100:
        raise MemorySnapshotError(f"{path} is nested over 100 deep")
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        ref = _dtensor_ref(obj, path, len(tensors))
        tensors.append(_dense(obj.to_local(), path))
        if found is not None:
            found[path] = obj
        return ref
    if isinstance(obj, torch.Tensor):
        tensors.append(_dense(obj, path))
        return TensorRef(len(tensors) - 1)
    if type(obj) is int:
        if not -(2**63) <= obj <= 2**64 - 1:
            raise MemorySnapshotError(f"{path} = {obj} does not fit 64 bits")
        return obj
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise MemorySnapshotError(f"{path} has a key {k!r} of type {type(k).__name__}: keys are str or int")
            out[k] = flatten(v, f"{path}[{k!r}]", tensors, depth + 1, found)
        return out
    if isinstance(obj, list):
        return [flatten(v, f"{path}[{i}]", tensors, depth + 1, found) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(flatten(v, f"{path}[{i}]", tensors, depth + 1, found) for i, v in enumerate(obj))
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):  # torch.distributed.checkpoint's Stateful: a module, an optimizer, ...
        return flatten(state_dict(), path, tensors, depth + 1, found)
    if isinstance(obj, int):  # an int subclass (IntEnum, ...) is saved as its value
        return flatten(int(obj), path, tensors, depth, found)
    raise MemorySnapshotError(f"{path} is a {type(obj).__qualname__}: a snapshot holds tensors, DTensors, "
                              "state_dict()-able objects and plain values (None, bool, int, float, str, bytes, "
                              "lists, tuples, dicts)")


def _dense(t: torch.Tensor, path: str) -> torch.Tensor:
    import torch

    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise MemorySnapshotError(f"{path} is a {t.layout} tensor: snapshots hold dense tensors")
    if str(t.dtype).removeprefix("torch.") not in fmt.ITEMSIZE:
        raise MemorySnapshotError(f"{path} is a tensor of {t.dtype}, which snapshots do not hold")
    return t.detach()


def mesh_spec(mesh: Any) -> MeshSpec:
    """A torch DeviceMesh as a snapshot records it."""
    try:
        got = _MESHES.get(mesh)
    except TypeError:  # not weakly referable: made each time
        got = None
    if got is None:
        names = mesh.mesh_dim_names
        got = MeshSpec(str(mesh.device_type), tuple(int(n) for n in mesh.mesh.shape),
                       tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                       None if names is None else tuple(str(n) for n in names))
        try:
            _MESHES[mesh] = got
        except TypeError:
            pass
    return got


def placements(dt: Any, path: str) -> tuple[Placement, ...]:
    """A DTensor's placements as a snapshot records them; refused by path unless Replicate, Shard or Partial."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[Placement] = []
    for p in dt.placements:
        if type(p) is Replicate:
            out.append(("R",))
        elif type(p) is Shard:
            out.append(("S", p.dim % dt.ndim if dt.ndim else p.dim))
        elif type(p) is Partial and p.reduce_op in fmt.PARTIAL_OPS:
            out.append(("P", p.reduce_op))
        else:
            raise MemorySnapshotError(f"{path} is a DTensor placed {p!r}: snapshots hold DTensors placed Replicate, "
                                      "Shard or Partial")
    return tuple(out)


def _dtensor_ref(dt: Any, path: str, index: int) -> DTensorRef:
    mesh = mesh_spec(dt.device_mesh)
    if dt.device_mesh.get_coordinate() is None:
        raise MemorySnapshotError(f"{path} is a DTensor on a device mesh this rank is not in")
    if not fmt.dense(dt.shape, dt.stride()):  # restore would refuse its layout (and make its shard contiguous)
        raise MemorySnapshotError(f"{path} is a DTensor of shape {list(dt.shape)} and stride {list(dt.stride())}: "
                                  "snapshots hold DTensors laid out with no overlap or gap (contiguous or permuted)")
    return DTensorRef(index, tuple(dt.shape), tuple(dt.stride()), placements(dt, path), mesh)


def lay_out(tensors: list[torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Each tensor's place in the data area (in order, each aligned), and the area's length."""
    specs, data_len = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape), data_len, nbytes))
        data_len = fmt.aligned(data_len + nbytes)
    return specs, data_len


def rebuild(tree: Any, tensors: list[Any], dtensors: DTensors | None = None, path: str = "state") -> Any:
    """``tree`` with its tensors put back (its DTensors made by ``dtensors``, by path as `flatten` names them)."""
    if isinstance(tree, TensorRef):
        return tensors[tree.index]
    if isinstance(tree, DTensorRef):
        if dtensors is None:
            raise MemorySnapshotError(f"{path} is a DTensor, and nothing to make it with")
        return dtensors.make(tree, tensors[tree.index], path)
    if isinstance(tree, dict):
        return {k: rebuild(v, tensors, dtensors, f"{path}[{k!r}]") for k, v in tree.items()}
    if isinstance(tree, list):
        return [rebuild(v, tensors, dtensors, f"{path}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        return tuple(rebuild(v, tensors, dtensors, f"{path}[{i}]") for i, v in enumerate(tree))
    return tree


def dtensor_refs(tree: Any, path: str = "state") -> list[tuple[str, DTensorRef]]:
    """Every DTensorRef of a decoded tree with its path (as `flatten` names it)."""
    out: list[tuple[str, DTensorRef]] = []
    stack = [(tree, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, DTensorRef):
            out.append((where, node))
        elif isinstance(node, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    out.reverse()
    return out


def coordinate(mesh: MeshSpec, rank: int) -> tuple[int, ...] | None:
    """``rank``'s index along each dimension of ``mesh``; None when it is not in it."""
    if rank not in mesh.ranks:
        return None
    flat, out = mesh.ranks.index(rank), []
    for n in reversed(mesh.shape):
        flat, i = divmod(flat, n)
        out.append(i)
    return tuple(reversed(out))


def local_shape(ref: DTensorRef, rank: int) -> tuple[int, ...] | None:
    """The shape of ``rank``'s shard of ``ref`` as torch cuts it (each Shard placement, mesh dimension
    by mesh dimension, as torch.chunk: pieces of ceil(n / k), the last ones shorter or empty); None
    when ``rank`` is not in its mesh (pure, no torch)."""
    coord = coordinate(ref.mesh, rank)
    if coord is None:
        return None
    shape = list(ref.shape)
    for p, n, c in zip(ref.placements, ref.mesh.shape, coord):
        if p[0] == "S":
            size, full = shape[p[1]], -(-shape[p[1]] // n)
            shape[p[1]] = max(0, min(size, full * c + full) - full * c)
    return tuple(shape)


def check_shards(tree: Any, specs: list[TensorSpec], rank: int) -> None:
    """SnapshotFormatError unless every DTensor of a decoded layout holds the shard that ``rank`` (its
    header's) holds: a layout is untrusted bytes, and DTensor.from_local does not check."""
    coords: dict[int, tuple[int, ...] | None] = {}
    for path, ref in dtensor_refs(tree):
        if id(ref.mesh) not in coords:
            coords[id(ref.mesh)] = coordinate(ref.mesh, rank)
        if coords[id(ref.mesh)] is None:
            raise SnapshotFormatError(f"{path}: rank {rank}'s DTensor on a mesh of ranks "
                                      f"{reprlib.repr(list(ref.mesh.ranks))} without it")
        want, got = local_shape(ref, rank), specs[ref.index].shape
        if want != got:
            raise SnapshotFormatError(f"{path}: rank {rank}'s shard of a DTensor of shape {list(ref.shape)} placed "
                                      f"{ref.placements} is {list(want or ())}, not {list(got)}")


def check_like(tree: Any, specs: list[TensorSpec], like: dict[str, Any]) -> None:
    """SnapshotFormatError unless every DTensor of a decoded layout that ``like`` (the state given to
    restore, its DTensors by path) has at the same path was saved as that DTensor is: global shape
    and stride, placements, device mesh and the rank's shard (the model's, not the layout's word)."""
    for path, ref in dtensor_refs(tree):
        t = like.get(path)
        if t is None:
            continue
        local = tuple(t.to_local().shape)
        has = DTensorRef(ref.index, tuple(t.shape), tuple(t.stride()), placements(t, path), mesh_spec(t.device_mesh))
        if has != ref or local != specs[ref.index].shape:
            raise SnapshotFormatError(f"{path} was saved as {_describe(ref, specs[ref.index].shape)}; the "
                                      f"state given to restore has {_describe(has, local)}")


def _describe(ref: DTensorRef, local: tuple[int, ...]) -> str:
    mesh = ref.mesh
    return (f"a DTensor of shape {list(ref.shape)} and stride {list(ref.stride)} placed {ref.placements} on a "
            f"{mesh.device_type} mesh of shape {list(mesh.shape)} (ranks {reprlib.repr(list(mesh.ranks))}), "
            f"its shard {list(local)}")


class DTensors:
    """How a restored tree's DTensors are made again, decided before the ranks confirm (a mismatch
    refuses the restore on every rank): on the mesh of the DTensor at the same path in ``like`` (the
    state given to restore), which must have the saved shape, stride, placements, mesh and shard; else on a
    mesh of ``like`` equal to the one recorded; else on a mesh made as recorded (`build`, a collective
    when torch makes process groups for it: the ranks first agree on `token`). A DTensor's shard goes
    to the device of ``like``'s DTensor there, or of one on its mesh, else to ``map_location``."""

    def __init__(self, tree: Any, specs: list[TensorSpec], like: dict[str, Any], *, world: int,
                 map_location: Any) -> None:
        import torch

        self._where: dict[str, tuple[Any, Any]] = {}  # path -> (DeviceMesh or MeshSpec to make, shard's device)
        on_mesh: dict[MeshSpec, tuple[Any, Any]] = {}
        for t in like.values():
            on_mesh.setdefault(mesh_spec(t.device_mesh), (t.device_mesh, t.to_local().device))
        other = None if map_location in (None, "cpu") else torch.device(map_location)
        self.to_build: dict[MeshSpec, Any] = {}
        self.locals: set[int] = set()
        check_like(tree, specs, like)
        for path, ref in dtensor_refs(tree):
            self.locals.add(ref.index)
            t = like.get(path)
            if t is not None:
                self._where[path] = (t.device_mesh, t.to_local().device)
            elif ref.mesh in on_mesh:
                self._where[path] = on_mesh[ref.mesh]
            else:
                if max(ref.mesh.ranks) >= world:
                    raise MemorySnapshotError(f"{path} was saved on a mesh of ranks "
                                              f"{reprlib.repr(list(ref.mesh.ranks))}; the job has {world} rank(s)")
                self.to_build.setdefault(ref.mesh, None)
                self._where[path] = (ref.mesh, other)
        dist = sys.modules.get("torch.distributed")
        if self.to_build and (dist is None or not dist.is_initialized()):
            raise MemorySnapshotError("the snapshot holds DTensors: restoring them needs torch.distributed "
                                      "initialized (init_process_group first)")

    @property
    def token(self) -> int:
        """What every rank must agree on before `build` (0: nothing to make; else the meshes' hash)."""
        if not self.to_build:
            return 0
        keys = sorted((m.device_type, m.shape, m.ranks, m.names or ()) for m in self.to_build)
        return int(xxhash.xxh3_64_intdigest(repr(keys).encode())) >> 2 | 1

    def build(self) -> None:
        """Make the meshes recorded that ``like`` did not have, in one order on every rank (torch may
        make process groups for them: every rank calls it, after agreeing on `token`)."""
        if not self.to_build:
            return
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        for m in sorted(self.to_build, key=lambda m: (m.device_type, m.shape, m.ranks, m.names or ())):
            ranks = torch.tensor(m.ranks, dtype=torch.int).view(m.shape)
            self.to_build[m] = DeviceMesh(m.device_type, ranks, mesh_dim_names=m.names)

    def make(self, ref: DTensorRef, local: torch.Tensor, path: str) -> Any:
        import torch
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        mesh, device = self._where[path]
        if isinstance(mesh, MeshSpec):
            mesh = self.to_build[mesh]
        if device is not None and local.device != device:
            local = local.to(device)
        placed = [Shard(p[1]) if p[0] == "S" else Partial(p[1]) if p[0] == "P" else Replicate()
                  for p in ref.placements]
        return DTensor.from_local(local, mesh, placed, run_check=False, shape=torch.Size(ref.shape), stride=ref.stride)


def view(mm: mmap.mmap, offset: int, spec: TensorSpec) -> torch.Tensor:
    """A tensor over ``spec``'s bytes of the mapping (no copy)."""
    import torch

    dtype = getattr(torch, spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=spec.nbytes, offset=offset + spec.offset)
    return flat.view(dtype).view(spec.shape)
