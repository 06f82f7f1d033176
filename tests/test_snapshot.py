"""ft_client.snapshot and its format: fast tests against a fake monitor that owns the memory.

The fake monitor speaks the snapshot handover of docs/protocol.md ("Snapshots") on a real
Unix socket with real memfds; the daemon's side is tested in test_daemon_snapshots.py and
the whole path (kill -9, the launcher, peers) in test_snapshot_e2e.py.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import xxhash

from ft_client import wire
from ft_client.errors import FtError, MemorySnapshotError
from ft_client.snapshot import Agreement, Held, Snapshotter, agree, from_row, open_pair, partners, to_row
from ft_client.snapshot import format as fmt
from ft_client.snapshot.format import HEADER_SIZE, Header, SnapshotFormatError

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

REPO = Path(__file__).resolve().parents[1]


class FakeMonitor:
    """Holds memfd pairs per kind and hands them over as the daemon does (or refuses)."""

    def __init__(self, path: str, limit: int = 1 << 30) -> None:
        self.path = path
        self.limit = limit
        self.pairs: dict[str, list[int]] = {}
        self.sizes: dict[str, int] = {}
        self.asked: list[dict[str, Any]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                n = wire.frame_length(conn.recv(4))
                body = b""
                while len(body) < n:
                    body += conn.recv(n - len(body))
                hello = wire.decode_body(body)
                assert isinstance(hello, wire.Hello) and hello.role == wire.Role.SNAPSHOT
                self.asked.append(hello.info)
                kind, want = hello.info["kind"], hello.info["bytes"]
                if want > self.limit:
                    conn.sendall(wire.encode(wire.Error("bad_request", f"{want} bytes asked; the limit is "
                                                                        f"{self.limit}")))
                    continue
                if kind not in self.pairs and want == 0:
                    conn.sendall(wire.encode(wire.HelloOk(2, {"snapshot": {"kind": kind, "buffers": 0, "bytes": 0}})))
                    continue
                if kind not in self.pairs:
                    self.pairs[kind] = []
                    for i in range(2):
                        fd = os.memfd_create(f"fake-{kind}-{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                        os.ftruncate(fd, want)
                        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
                        self.pairs[kind].append(fd)
                    self.sizes[kind] = want
                elif want > self.sizes[kind]:
                    for fd in self.pairs[kind]:
                        os.ftruncate(fd, want)
                    self.sizes[kind] = want
                reply = wire.encode(wire.HelloOk(2, {"snapshot": {"kind": kind, "buffers": 2,
                                                                   "bytes": self.sizes[kind]}}))
                socket.send_fds(conn, [reply], self.pairs[kind])

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (closing alone does not, on Linux)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(10)
        for fds in self.pairs.values():
            for fd in fds:
                os.close(fd)


@pytest.fixture
def monitor(tmp_path: Path):
    m = FakeMonitor(str(tmp_path / "mon.sock"))
    yield m
    m.close()


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "step": 7, "name": "run", "empty": torch.empty(0),
            "bf": torch.ones(3, dtype=torch.bfloat16), "sched": {"last_epoch": 3, "betas": (0.9, 0.99)}}


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b and type(a) is type(b)


# -- the format ------------------------------------------------------------------------------------
def _header(**kw: Any) -> Header:
    base = {"state": fmt.COMPLETE, "generation": 3, "step": 20, "rank": 1, "world": 2, "layout_len": 10,
            "data_offset": 8192, "data_len": 64, "saved_at": 1.5, "job": "j", "checksum": 0}
    return Header(**{**base, **kw})


def test_a_header_reads_back_and_a_flipped_byte_is_refused() -> None:
    h = _header()
    raw = bytearray(h.pack())
    assert fmt.parse_header(raw) == h
    raw[20] ^= 1
    with pytest.raises(SnapshotFormatError, match="header's checksum"):
        fmt.parse_header(raw)
    assert fmt.describe(bytes(HEADER_SIZE))["state"] == "empty"
    assert fmt.describe(raw)["state"] == "invalid"
    assert fmt.describe(h.pack())["step"] == 20


def test_any_bytes_give_a_header_or_our_refusal() -> None:
    import random

    rnd = random.Random(5)
    good = _header().pack()
    for _ in range(3000):
        raw = bytearray(good)
        for _ in range(rnd.randint(1, 4)):
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        try:
            fmt.parse_header(raw[: rnd.randint(0, len(raw))])
        except SnapshotFormatError:
            pass
    for _ in range(3000):
        blob = bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 64)))
        try:
            fmt.decode_layout(blob, 1024)
        except SnapshotFormatError:
            pass


def test_a_layout_that_lies_about_its_tensors_is_refused() -> None:
    specs = [fmt.TensorSpec("float32", (2, 3), 0, 24)]
    tree, got = fmt.decode_layout(fmt.encode_layout({"w": fmt.TensorRef(0), "t": (1, "a")}, specs), 64)
    assert tree == {"w": fmt.TensorRef(0), "t": (1, "a")} and got == specs
    for bad, why in [([fmt.TensorSpec("float32", (2, 3), 0, 20)], "in 20 bytes"),
                     ([fmt.TensorSpec("float32", (2, 3), 64, 24)], "outside"),
                     ([fmt.TensorSpec("object", (1,), 0, 8)], "dtype")]:
        with pytest.raises(SnapshotFormatError, match=why):
            fmt.decode_layout(fmt.encode_layout({"w": fmt.TensorRef(0)}, bad), 64)
    with pytest.raises(SnapshotFormatError, match="reference to tensor 1"):
        fmt.decode_layout(fmt.encode_layout([fmt.TensorRef(1)], specs), 64)


NESTED_300 = """
import msgpack
from ft_client.snapshot import format as fmt
data = msgpack.packb([])
for _ in range(300):
    data = msgpack.packb([msgpack.ExtType(fmt._EXT_TUPLE, data)])
raw = msgpack.packb({"tree": msgpack.ExtType(fmt._EXT_TUPLE, data), "tensors": []})
try:
    fmt.decode_layout(raw, 0)
except fmt.SnapshotFormatError as e:
    print(e)
"""


def test_a_layout_of_tuples_nested_300_deep_is_refused_not_a_crash() -> None:
    # issue 38: 729 bytes of nested tuples (the checksum has no key) killed the restoring process with SIGSEGV
    # (from depth 200), every restore crashed and the job crash-looped; in a new interpreter, which it killed
    done = subprocess.run([sys.executable, "-c", NESTED_300], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"tuples nested over {fmt.MAX_TUPLE_DEPTH} deep\n"), done
    nested: Any = (1,)
    for _ in range(fmt.MAX_TUPLE_DEPTH - 2):
        nested = (nested,)
    assert fmt.decode_layout(fmt.encode_layout(nested, []), 0)[0] == nested  # as deep as a real model's: kept


IMPORTS = """
import logging, sys
import ft_client
assert "ft_client.snapshot" not in sys.modules, "import ft_client loaded the snapshots"
from ft_client.snapshot import format
import ft_client.snapshot
from ft_client.snapshot import Snapshotter, restore, save, wait
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")), logging.getLogger("ft_client").handlers)
"""


def test_importing_the_snapshots_imports_no_torch() -> None:
    # issue 40: the package of modules (the daemon imports its format) loads torch only when a snapshot is saved
    # or restored, and installs the client's log handler only when a Snapshotter is made
    done = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (done.returncode, done.stdout) == (0, "[] []\n"), done


# -- agreement --------------------------------------------------------------------------------------
def _h(*slots: tuple[int, int] | None) -> tuple[Held | None, ...]:
    return tuple(None if x is None else Held(*x) for x in (list(slots) + [None] * 4)[:4])


def test_the_newest_step_every_rank_holds_is_agreed() -> None:
    # rank 1 was killed while saving step 40: it holds 20 and 30; rank 0 finished 40
    table = [_h((0, 40), (0, 30)), _h((1, 30), (1, 20))]
    assert agree(table) == Agreement(30, {})
    lost = [_h((0, 40)), _h()]
    assert agree(lost).step is None and "no monitor holds a snapshot of rank(s) 1" in agree(lost).why
    assert "no step is held for every rank" in agree([_h((0, 40)), _h((1, 30))]).why
    assert agree([_h(), _h()]).nothing and not agree(lost).nothing  # a first start: nothing anywhere
    assert to_row(table[1]) == [1, 30, 1, 20, -1, -1, -1, -1] and from_row(to_row(table[1])) == table[1]


def test_a_rank_that_lost_its_node_fetches_from_the_monitor_that_kept_its_copy() -> None:
    # 2 nodes x 1 rank: rank 0 keeps rank 1's copies in its peer pair (slots 2, 3). Rank 1's node
    # was lost: its new monitor holds nothing.
    table = [_h((0, 30), (0, 20), (1, 30), (1, 20)), _h()]
    assert agree(table) == Agreement(30, {1: (0, 2)})
    # the copy lags one save behind: the newest step everybody can get is 20
    table = [_h((0, 30), (0, 20), (1, 20), (1, 10)), _h()]
    assert agree(table) == Agreement(20, {1: (0, 2)})
    # the ranks were numbered again: each monitor holds the other rank's own snapshots
    table = [_h((1, 30), (1, 20)), _h((0, 30), (0, 20))]
    assert agree(table) == Agreement(30, {0: (1, 0), 1: (0, 0)})
    assert partners(0, 4, 2) == (2, 2) and partners(3, 4, 2) == (1, 1)
    assert partners(0, 2, 2) is None and partners(1, 8, 8) is None


# -- save and restore through the fake monitor -------------------------------------------------------
def test_a_state_saved_is_restored_whole(monitor: FakeMonitor) -> None:
    s = Snapshotter(socket_path=monitor.path, job="job1", rank=0)
    state = _state()
    assert s.save(7, state)
    s.wait()
    step, got = s.restore()  # type: ignore[misc]
    assert step == 7
    _same(state, got)
    # a new process's snapshotter (a restarted rank) finds it too
    step2, got2 = Snapshotter(socket_path=monitor.path, job="job1", rank=0).restore()  # type: ignore[misc]
    assert step2 == 7
    _same(state, got2)


def test_stateful_objects_are_saved_by_their_state_dict(monitor: FakeMonitor) -> None:
    model = torch.nn.Linear(4, 2)
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    s.save(1, {"model": model})
    step, got = s.restore()  # type: ignore[misc]
    _same(model.state_dict(), got["model"])


def test_values_a_snapshot_cannot_hold_are_named_by_path(monitor: FakeMonitor) -> None:
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    with pytest.raises(MemorySnapshotError, match=r"state\['a'\]\[0\] is a object"):
        s.save(1, {"a": [object()]})
    with pytest.raises(FtError, match="key"):
        s.save(1, {(1, 2): 3})


def test_the_newest_complete_save_survives_a_torn_one(monitor: FakeMonitor) -> None:
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    s.save(10, {"w": torch.full((1000,), 10.0)})
    s.save(20, {"w": torch.full((1000,), 20.0)})
    s.wait()
    assert s.memory.own is not None
    # the next save goes to the buffer holding step 10; its writer dies half-way (WRITING left)
    i = s.memory.own.target(job="j")
    b = s.memory.own.buffers[i]
    h = fmt.parse_header(b.mm[: fmt.HEAD_BYTES])
    assert h.step == 10
    b.write_header(Header(**{**h.__dict__, "state": fmt.WRITING, "step": 30, "generation": 9}))
    lines: list[str] = []
    step, got = Snapshotter(socket_path=monitor.path, job="j", rank=0, log_line=lines.append).restore()  # type: ignore[misc]
    assert step == 20 and float(got["w"][0]) == 20.0
    assert any("torn write" in line and "step 30" in line for line in lines), lines


def _steps_10_and_20(monitor: FakeMonitor) -> tuple[Any, Header]:
    """Steps 10 and 20 saved: the buffer holding 20, and its header."""
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    s.save(10, {"w": torch.full((1000,), 10.0)})
    s.save(20, {"w": torch.full((1000,), 20.0)})
    s.wait()
    assert s.memory.own is not None
    newest = s.memory.own.newest(job="j")
    assert newest is not None and newest[1].step == 20
    return s.memory.own.buffers[newest[0]], newest[1]


def _restored_step_10(monitor: FakeMonitor) -> list[str]:
    """A new process's restore gives step 10 (the other buffer); its lines."""
    lines: list[str] = []
    step, got = Snapshotter(socket_path=monitor.path, job="j", rank=0, log_line=lines.append).restore()  # type: ignore[misc]
    assert step == 10 and float(got["w"][0]) == 10.0
    return lines


def test_a_checksum_mismatch_falls_back_to_the_other_buffer(monitor: FakeMonitor) -> None:
    buf, h = _steps_10_and_20(monitor)
    buf.mm[h.data_offset + 5] ^= 0xFF
    lines = _restored_step_10(monitor)
    assert any("checksum mismatch (step 20" in line for line in lines), lines


def _nested_tuples(depth: int) -> bytes:
    """A layout whose tree is tuples nested ``depth`` deep (msgpack's own encoding of them, built
    in a loop)."""
    data = msgpack.packb([])
    for _ in range(depth - 1):
        data = msgpack.packb([msgpack.ExtType(fmt._EXT_TUPLE, data)])
    return msgpack.packb({"tree": msgpack.ExtType(fmt._EXT_TUPLE, data), "tensors": []})


@pytest.mark.parametrize("layout, why", [
    (msgpack.packb({"tree": msgpack.ExtType(42, b""), "tensors": []}), "an unknown extension type 42"),
    (b"\xc6\xff\xff\xff\xff", "its layout does not decode"),  # a bin32 of 2^32 - 1 bytes
    (msgpack.packb({"tree": [msgpack.ExtType(fmt._EXT_TUPLE, b"\xdd\xff\xff\xff\xff")], "tensors": []}),
     "its layout does not decode"),  # a tuple claiming 2^32 - 1 items
    (_nested_tuples(300), f"tuples nested over {fmt.MAX_TUPLE_DEPTH} deep"),
    (b"\x82\xa4tree" + b"\x91" * 3000 + b"\xc0\xa7tensors\x90", "its layout does not decode"),  # lists 3000 deep
], ids=["unknown ext type", "2^32-byte length", "2^32-item tuple", "tuples 300 deep", "lists 3000 deep"])
def test_a_layout_that_does_not_decode_falls_back_to_the_other_buffer(monitor: FakeMonitor, layout: bytes,
                                                                      why: str) -> None:
    # issue 38: restore() raised SnapshotFormatError to the training script instead of refusing that buffer
    # (and tuples 200 deep killed it with SIGSEGV): a layout is bytes another process can write
    buf, h = _steps_10_and_20(monitor)
    assert len(layout) <= h.data_offset - HEADER_SIZE  # the room a layout has
    buf.mm[HEADER_SIZE:HEADER_SIZE + len(layout)] = layout  # the checksum recomputed: it has no key
    buf.write_header(Header(**{**h.__dict__, "layout_len": len(layout), "checksum": fmt.body_checksum(
        buf.mm, Header(**{**h.__dict__, "layout_len": len(layout)}))}))
    lines = _restored_step_10(monitor)
    assert any(line.startswith("ft_client.snapshot: buffer ") and " refused: " in line and why in line
               for line in lines), lines


def test_another_jobs_or_another_ranks_snapshot_is_refused(monitor: FakeMonitor) -> None:
    Snapshotter(socket_path=monitor.path, job="old-job", rank=0).save(10, {"w": torch.ones(3)})
    lines: list[str] = []
    s = Snapshotter(socket_path=monitor.path, job="new-job", rank=0, log_line=lines.append)
    assert s.restore() is None
    assert "job 'old-job''s snapshot, not job 'new-job''s" in (s.why_not or "")
    assert "falling back to the file checkpoint" in lines[-1]
    s = Snapshotter(socket_path=monitor.path, job="old-job", rank=1, log_line=lines.append)
    assert s.restore() is None and "rank 0's snapshot, not rank 1's" in (s.why_not or "")


def test_no_snapshot_held_falls_back_with_one_line(monitor: FakeMonitor) -> None:
    lines: list[str] = []
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0, log_line=lines.append)
    assert s.restore() is None
    assert len(lines) == 1 and "the monitor holds no snapshot" in lines[0] and "file checkpoint" in lines[0]
    lines.clear()
    s = Snapshotter(socket_path=None, job="j", rank=0, log_line=lines.append)
    s.socket_path = None
    assert s.restore() is None and "FT_RANK_MONITOR_IPC_SOCKET is not set" in lines[0]


def test_memory_refused_by_the_monitor_skips_the_save_with_one_line(monitor: FakeMonitor) -> None:
    monitor.limit = 1 << 16
    lines: list[str] = []
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0, log_line=lines.append)
    assert not s.save(1, {"w": torch.zeros(1 << 16)})
    assert not s.save(2, {"w": torch.zeros(1 << 16)})
    assert len(lines) == 2 and "not saved: the monitor refused" in lines[0]


def test_a_state_that_grows_keeps_the_previous_snapshot(monitor: FakeMonitor) -> None:
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    s.save(1, {"w": torch.ones(10)})
    s.save(2, {"w": torch.ones(200_000)})  # asks the monitor for more: the buffers grow in place
    s.wait()
    assert monitor.asked[-1]["bytes"] > 800_000
    step, got = Snapshotter(socket_path=monitor.path, job="j", rank=0).restore()  # type: ignore[misc]
    assert step == 2 and got["w"].numel() == 200_000


def test_a_process_killed_with_sigkill_after_its_save_is_restored_by_the_next(monitor: FakeMonitor) -> None:
    code = f"""
import os, signal, torch
from ft_client.snapshot import Snapshotter
s = Snapshotter(socket_path={monitor.path!r}, job="j", rank=0)
torch.manual_seed(1)
s.save(5, {{"w": torch.randn(1000)}})
s.wait()
os.kill(os.getpid(), signal.SIGKILL)
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       timeout=120)
    assert p.returncode == -signal.SIGKILL
    torch.manual_seed(1)
    step, got = Snapshotter(socket_path=monitor.path, job="j", rank=0).restore()  # type: ignore[misc]
    assert step == 5 and torch.equal(got["w"], torch.randn(1000))


def test_the_checksum_covers_layout_and_data(monitor: FakeMonitor) -> None:
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    s.save(3, {"w": torch.arange(10.0)})
    s.wait()
    assert s.memory.own is not None
    got = s.memory.own.newest(job="j")
    assert got is not None
    i, h = got
    mm = s.memory.own.buffers[i].mm
    assert h.checksum == xxhash.xxh3_64_intdigest(mm[HEADER_SIZE:h.end])
    assert open_pair(monitor.path, "own", 0, 0) is not None


def test_a_rollback_restores_the_newest_save_not_the_highest_step(monitor: FakeMonitor) -> None:
    # the job went back to a file checkpoint (step 15) after holding a snapshot of step 30
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    s.save(30, {"w": torch.full((4,), 30.0)})
    s.save(15, {"w": torch.full((4,), 15.0)})
    s.wait()
    step, got = Snapshotter(socket_path=monitor.path, job="j", rank=0).restore()  # type: ignore[misc]
    assert step == 15 and float(got["w"][0]) == 15.0


def test_device_tensors_of_one_shape_each_get_their_own_staging(monkeypatch: pytest.MonkeyPatch,
                                                                monitor: FakeMonitor) -> None:
    # a parameter and its two Adam moments have one shape: one staging tensor per position
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    s = Snapshotter(socket_path=monitor.path, job="j", rank=0)
    w = torch.ones(4)
    a, b, c = s._staged(0, w), s._staged(1, w), s._staged(2, w)
    assert len({id(a), id(b), id(c)}) == 3
    assert s._staged(1, w) is b and s._staged(1, torch.ones(5)) is not b
