"""ft_client.snapshot with DTensors: saved as their local shards, restored as DTensors equal to
the saved ones (shard values, placements, global shape and stride, an equal device mesh).

In this process, on a gloo group of one rank (a DTensor needs a process group) and the fake
monitor of test_snapshot.py; then two ranks under torchrun (FSDP2 on a 1-D mesh, HSDP on a 2-D
one, DTensors on meshes of part of the ranks), where the meshes made as recorded are made with
process groups every rank must make together. The whole path under ft-launcher, with a rank
killed: test_fsdp2_snapshot.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from ft_client import torch_features
from ft_client.errors import MemorySnapshotError
from ft_client.snapshot import Snapshotter
from ft_client.snapshot import format as fmt
from ft_client.snapshot.format import HEADER_SIZE, Header
from tests.procs import ROOT, free_port, slack
from tests.test_snapshot import FakeMonitor


@pytest.fixture(scope="module")
def _one_rank() -> Iterator[None]:
    """A gloo group of one rank for the module's tests (a DTensor needs a process group). One for
    them all: torch keeps the last group a DTensor was made on alive (its gloo threads and
    descriptors) after it is destroyed, until another replaces it, which a test's leak check
    would count as that test's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def group(_one_rank: None, tmp_path: Path) -> Iterator[FakeMonitor]:
    """The group of one rank, and a fake monitor for the test."""
    m = FakeMonitor(str(tmp_path / "mon.sock"))
    try:
        yield m
    finally:
        m.close()


def same(a: Any, b: Any, path: str = "state") -> None:
    """``b`` equals ``a``: DTensors with equal shards, placements, shape, stride and mesh."""
    if isinstance(a, DTensor):
        assert isinstance(b, DTensor), path
        assert (a.placements, a.shape, a.stride(), a.dtype) == (b.placements, b.shape, b.stride(), b.dtype), path
        assert a.device_mesh == b.device_mesh and torch.equal(a.to_local(), b.to_local()), path
    elif isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _dtensors() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1,))
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    return {"w": distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)]),
            "t": distribute_tensor(torch.randn(5, 3).t(), mesh, [Shard(1)]),  # not contiguous: its stride is kept
            "r": distribute_tensor(torch.arange(4, dtype=torch.bfloat16), mesh, [Replicate()]),
            "p": DTensor.from_local(torch.ones(2, 2, dtype=torch.int64), mesh, [Partial("max")]),
            "hsdp": distribute_tensor(torch.randn(3, 4), mesh2, [Replicate(), Shard(0)]),
            "plain": torch.arange(3), "step": 4, "names": ("a", ["b"])}


def test_dtensors_are_saved_as_their_shards_and_restored_equal(group: FakeMonitor) -> None:
    state = _dtensors()
    s = Snapshotter(socket_path=group.path, job="j")
    assert s.save(4, state)
    s.wait()
    assert s.memory.own is not None
    newest = s.memory.own.newest(job="j")
    assert newest is not None
    # a shard's bytes, not a pickled DTensor: the layout lists each mesh once, each DTensor's shard a plain tensor
    assert newest[1].data_len < 1024
    for like in (None, state, {"w": torch.zeros(1)}):  # meshes made as recorded; like's; a like without DTensors
        step, got = Snapshotter(socket_path=group.path, job="j").restore(like=like)  # type: ignore[misc]
        assert step == 4
        same(state, got)
        assert got["t"].stride() == (1, 3) and got["t"].to_local().is_contiguous()
        assert (got["w"].device_mesh is state["w"].device_mesh) == (like is state)


def test_a_state_to_restore_into_of_another_shape_refuses_the_restore_with_the_path(group: FakeMonitor) -> None:
    mesh = init_device_mesh("cpu", (1,))
    s = Snapshotter(socket_path=group.path, job="j")
    s.save(1, {"m": {"w": distribute_tensor(torch.ones(7, 5), mesh, [Shard(0)])}})
    lines: list[str] = []
    r = Snapshotter(socket_path=group.path, job="j", log_line=lines.append)
    assert r.restore(like={"m": {"w": distribute_tensor(torch.ones(8, 5), mesh, [Shard(0)])}}) is None
    assert "state['m']['w'] was saved as a DTensor of shape [7, 5] and stride [5, 1] placed (('S', 0),) on a cpu " \
           "mesh of shape [1] (ranks [0]), its shard [7, 5]; the state given to restore has a DTensor of shape [8, 5]" \
           in (r.why_not or "")
    assert lines[-1].endswith("falling back to the file checkpoint")
    with pytest.raises(MemorySnapshotError, match=r"state\['x'\] is a object"):  # like is checked as save checks
        r.restore(like={"x": object()})


def test_dtensors_a_snapshot_cannot_hold_are_refused_by_path(group: FakeMonitor) -> None:
    mesh = init_device_mesh("cpu", (1,))
    strided = DTensor.from_local(torch.ones(4), mesh, [_StridedShard(0, split_factor=2)], run_check=False)
    s = Snapshotter(socket_path=group.path, job="j")
    with pytest.raises(MemorySnapshotError, match=r"state\['tp'\]\[0\] is a DTensor placed _StridedShard"):
        s.save(1, {"tp": [strided]})
    gaps = distribute_tensor(torch.ones(4, 4)[:, ::2], mesh, [Replicate()])  # every other column: stride (4, 2)
    with pytest.raises(MemorySnapshotError, match=r"state\['g'\] is a DTensor of shape \[4, 2\] and stride \[4, 2\]: "
                                                  "snapshots hold DTensors laid out with no overlap or gap"):
        s.save(1, {"g": gaps})
    assert s.memory.own is None  # refused before anything was asked or written


def _forge(s: Snapshotter, tree: Any, specs: list[fmt.TensorSpec], newest: bool = True) -> None:
    """Another process rewrites the layout of ``s``'s newest (else older) snapshot and its checksum (it has no key)."""
    assert s.memory.own is not None
    found = s.memory.own.newest(job="j")
    assert found is not None
    i = found[0] if newest else 1 - found[0]
    buf = s.memory.own.buffers[i]
    h = fmt.check(buf.mm, job="j", rank=0)
    forged = fmt.encode_layout(tree, specs)
    buf.mm[HEADER_SIZE:HEADER_SIZE + len(forged)] = forged
    head = Header(**{**h.__dict__, "layout_len": len(forged)})
    buf.write_header(Header(**{**head.__dict__, "checksum": fmt.body_checksum(buf.mm, head)}))


@pytest.mark.parametrize("stride, why", [
    ((0, 0), "stride [0, 0] and a local tensor of shape [4, 4] (one stride a dimension, no overlap, no gap)"),
    ((2**62, 1), f"stride [{2**62}, 1] and a local tensor of shape [4, 4]"),
    ((1, 4), "state['m']['w'] was saved as a DTensor of shape [4, 4] and stride [1, 4] placed (('S', 0),) on a cpu "
             "mesh of shape [1] (ranks [0]), its shard [4, 4]; the state given to restore has a DTensor of shape "
             "[4, 4] and stride [4, 1]"),  # a transposed layout is dense: refused as unlike the model's
])
def test_a_forged_dtensor_stride_is_refused_and_the_other_buffer_or_the_file_checkpoint_restored(
        group: FakeMonitor, stride: tuple[int, int], why: str) -> None:
    mesh = init_device_mesh("cpu", (1,))
    state = {"m": {"w": distribute_tensor(torch.full((4, 4), 10.0), mesh, [Shard(0)])}}
    s = Snapshotter(socket_path=group.path, job="j")
    s.save(10, state)
    s.save(20, {"m": {"w": distribute_tensor(torch.full((4, 4), 20.0), mesh, [Shard(0)])}})
    s.wait()
    ref = fmt.DTensorRef(0, (4, 4), stride, (("S", 0),), fmt.MeshSpec("cpu", (1,), (0,)))
    _forge(s, {"m": {"w": ref}}, [fmt.TensorSpec("float32", (4, 4), 0, 64)])
    lines: list[str] = []
    step, got = Snapshotter(socket_path=group.path, job="j", log_line=lines.append).restore(  # type: ignore[misc]
        like=state)
    assert step == 10 and got["m"]["w"].stride() == (4, 1) and float(got["m"]["w"].to_local()[0, 0]) == 10.0
    refused = [line for line in lines if "refused" in line]
    assert len(refused) == 1 and why in refused[0] and "\n" not in refused[0], lines
    _forge(s, {"m": {"w": ref}}, [fmt.TensorSpec("float32", (4, 4), 0, 64)], newest=False)  # both buffers now
    lines.clear()
    r = Snapshotter(socket_path=group.path, job="j", log_line=lines.append)
    assert r.restore(like=state) is None
    assert len(lines) == 1 and why in lines[0] and lines[0].endswith("falling back to the file checkpoint"), lines


def test_a_layout_whose_shard_is_not_the_ranks_is_refused_and_the_other_buffer_restored(group: FakeMonitor) -> None:
    mesh = init_device_mesh("cpu", (1,))
    s = Snapshotter(socket_path=group.path, job="j")
    s.save(10, {"w": distribute_tensor(torch.full((4, 2), 10.0), mesh, [Shard(0)])})
    s.save(20, {"w": distribute_tensor(torch.full((4, 2), 20.0), mesh, [Shard(0)])})
    s.wait()
    assert s.memory.own is not None
    newest = s.memory.own.newest(job="j")
    assert newest is not None
    # another process rewrites step 20's layout: its DTensor claims a [8, 2] sharded over ranks [0, 1] (rank 0
    # would hold 4 rows: consistent), then one claiming rank 0 holds rows of a [9, 2] (5 rows, not 4)
    _forge(s, {"w": fmt.DTensorRef(0, (9, 2), (2, 1), (("S", 0),), fmt.MeshSpec("cpu", (2,), (0, 1)))},
           [fmt.TensorSpec("float32", (4, 2), 0, 32)])
    lines: list[str] = []
    step, got = Snapshotter(socket_path=group.path, job="j", log_line=lines.append).restore()  # type: ignore[misc]
    assert step == 10 and float(got["w"].to_local()[0, 0]) == 10.0
    assert any("refused: state['w']: rank 0's shard of a DTensor of shape [9, 2] placed (('S', 0),) is [5, 2], "
               "not [4, 2]" in line for line in lines), lines


def test_dtensors_restored_without_a_process_group_are_refused_with_a_line(group: FakeMonitor,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = init_device_mesh("cpu", (1,))
    s = Snapshotter(socket_path=group.path, job="j", rank=0)
    s.save(1, {"w": distribute_tensor(torch.ones(2), mesh, [Shard(0)])})
    s.wait()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # as a process that never made its group
    r = Snapshotter(socket_path=group.path, job="j", rank=0)
    assert r.restore() is None
    assert "restoring them needs torch.distributed initialized" in (r.why_not or "")


TWO_RANKS = r'''
import os, sys, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
sys.path.insert(0, os.environ["REPO"])
from ft_client.snapshot import Snapshotter
from tests.test_snapshot import FakeMonitor
from tests.test_fsdp2_restore import same

dist.init_process_group("gloo")
rank = dist.get_rank()

def model(mesh):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=0.1)

mon = FakeMonitor(os.path.join(tempfile.mkdtemp(), "m.sock"))
for name, shape, names in (("fsdp", (2,), None), ("hsdp", (1, 2), ("rep", "shard")), ("hsdp2", (2, 1), ("rep", "shard"))):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    m, opt = model(mesh)
    for _ in range(2):
        m(torch.randn(3, 5)).sum().backward(); opt.step(); opt.zero_grad()
    s = Snapshotter(socket_path=mon.path, job=name, peer=False)
    s.save(2, {"model": m, "opt": opt})
    s.wait()
    want = {"model": m.state_dict(), "opt": opt.state_dict()}
    for like in (False, True):  # meshes made as recorded (a collective on the 2-D meshes), then the new model's
        m2, opt2 = model(mesh)
        step, got = Snapshotter(socket_path=mon.path, job=name, peer=False).restore(
            like={"model": m2, "opt": opt2} if like else None)
        same(want, got)
        m2.load_state_dict(got["model"]); opt2.load_state_dict(got["opt"])
        same(want, {"model": m2.state_dict(), "opt": opt2.state_dict()})
        x = torch.randn(3, 5)
        assert torch.equal(m(x), m2(x))
        print(f"rank {rank}: {name} like={like} equal", flush=True)
# a DTensor on the rank's own sub-mesh (rank 0's [0], rank 1's [1]): without like, the ranks would make
# different meshes (process groups every rank must make alike): refused on both, with like restored
mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["tp"]
state = {"w": distribute_tensor(torch.full((2, 2), float(rank)), mesh, [Shard(0)])}
s = Snapshotter(socket_path=mon.path, job="sub", peer=False)
s.save(1, state)
s.wait()
r = Snapshotter(socket_path=mon.path, job="sub", peer=False)
print(f"rank {rank}: sub without like: {r.restore()} {r.why_not}", flush=True)
same(state, r.restore(like=state)[1])
print(f"rank {rank}: sub like=True equal", flush=True)
mon.close()
dist.destroy_process_group()
'''


@pytest.mark.skipif(not torch_features.fsdp2_on_cpu(), reason=torch_features.FSDP2_CPU.line(str(torch_features.version())))
def test_two_ranks_restore_fsdp2_and_hsdp_state_with_and_without_the_model(tmp_path: Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {**os.environ, "REPO": str(ROOT), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(script)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120 * slack())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    for r in (0, 1):
        for name in ("fsdp", "hsdp", "hsdp2"):
            for like in (False, True):
                assert f"rank {r}: {name} like={like} equal" in out, out[-6000:]
        assert f"rank {r}: sub without like: None no snapshot to restore: the ranks would make different device " \
               "meshes for their DTensors" in out, out[-6000:]
        assert f"rank {r}: sub like=True equal" in out
