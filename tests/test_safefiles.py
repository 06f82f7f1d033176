"""ft_client.safefiles' rule for files in folders others may write (security round 4): every
reason a folder or a file is refused, and the writes that replace what was planted instead of
going through it. Another local user is uid 65534 (files chowned to it: the suite runs as root)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ft_client import FtError
from ft_client.safefiles import (
    UnsafeFileError,
    load_json,
    make_dir,
    read_owned,
    shared_dir_problem,
    write_bytes_atomic,
    write_json_atomic,
)

OTHER_UID = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root (chown)")


def _own_file(path: Path, data: bytes = b'{"a": 1}', mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_regular_file_of_ours_that_no_one_else_can_write_is_read(tmp_path: Path) -> None:
    assert load_json(_own_file(tmp_path / "f.json")) == {"a": 1}
    assert read_owned(_own_file(tmp_path / "g", b"x" * 10, 0o644), 10) == b"x" * 10  # others may read it
    with pytest.raises(FileNotFoundError):  # nothing there: the caller's quiet case
        read_owned(tmp_path / "missing", 10)


@pytest.mark.parametrize(("plant", "reason"), [
    ("symlink", "is a symbolic link; refusing to follow it"),
    ("fifo", "is a FIFO, not a regular file"),
    ("directory", "is a directory, not a regular file"),
    ("group-writable", "has mode 0620: other users can write it"),
    ("world-writable", "has mode 0606: other users can write it"),
    ("hard link", "has 2 hard links: it may be another file of ours"),
    ("too large", "holds 11 bytes, more than the 10 expected"),
    ("not json", "is not JSON: "),
])
def test_every_reason_a_file_is_refused_is_named(tmp_path: Path, plant: str, reason: str) -> None:
    path = tmp_path / "state.json"
    target = _own_file(tmp_path / "target", b"[1]")
    if plant == "symlink":
        path.symlink_to(target)
    elif plant == "fifo":
        os.mkfifo(path)  # opened without blocking: no writer needed
    elif plant == "directory":
        path.mkdir()
    elif plant == "hard link":
        os.link(target, path)
    else:
        data, mode = {"group-writable": (b"[1]", 0o620), "world-writable": (b"[1]", 0o606),
                      "too large": (b"[1]" + b" " * 8, 0o600), "not json": (b"{nope", 0o600)}[plant]
        _own_file(path, data, mode)
    with pytest.raises(UnsafeFileError) as e:
        load_json(path, limit=10)
    assert str(e.value).startswith(str(path)) and reason in str(e.value), str(e.value)
    assert isinstance(e.value, FtError)


@as_root
def test_another_users_file_is_refused(tmp_path: Path) -> None:
    path = _own_file(tmp_path / "state.json")
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match=f"belongs to uid {OTHER_UID}, not to this user"):
        load_json(path)


@as_root
@pytest.mark.parametrize(("mode", "owner", "reason"), [
    (0o700, None, None), (0o755, None, None), (0o775, None, None),  # ours; group-writable (umask 002) too
    (0o1777, None, None),  # ours, others may add files but not replace ours (sticky)
    (0o777, None, "has mode 0777: any user can write there and replace our files (no sticky bit)"),
    (0o755, OTHER_UID, f"belongs to uid {OTHER_UID}, not to this user"),
    (0o1777, OTHER_UID, f"belongs to uid {OTHER_UID}, not to this user"),
])
def test_a_folder_is_used_only_where_it_is_ours_and_others_cannot_replace_our_files(
        tmp_path: Path, mode: int, owner: int | None, reason: str | None) -> None:
    folder = tmp_path / "exp"
    folder.mkdir()
    folder.chmod(mode)
    if owner is not None:
        os.chown(folder, owner, owner)
    problem = shared_dir_problem(folder)
    assert (problem is None) if reason is None else (problem is not None and reason in problem), problem
    if reason is None:
        make_dir(folder)  # adopted
    else:
        with pytest.raises(UnsafeFileError, match=f"refusing to use the folder {folder}: "):
            make_dir(folder)


@as_root
def test_folder_links_and_files_are_told_apart(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "ours").symlink_to(real)
    assert shared_dir_problem(tmp_path / "ours") is None  # a link of ours to a folder of ours
    (tmp_path / "theirs").symlink_to(real)
    os.lchown(tmp_path / "theirs", OTHER_UID, OTHER_UID)
    assert f"symbolic link owned by uid {OTHER_UID}" in str(shared_dir_problem(tmp_path / "theirs"))
    assert "is not a directory" in str(shared_dir_problem(_own_file(tmp_path / "file")))
    assert "cannot inspect" in str(shared_dir_problem(tmp_path / "missing"))


def test_a_folder_we_make_is_ours_and_0700_and_a_private_one_must_be_private(tmp_path: Path) -> None:
    made = tmp_path / "a" / "b"
    make_dir(made)
    st = os.stat(made)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    open_one = tmp_path / "open"
    open_one.mkdir(mode=0o775)
    open_one.chmod(0o775)
    make_dir(open_one)  # shared rule: a group-writable folder of ours is fine
    with pytest.raises(UnsafeFileError, match="has mode 0775: other users can write there"):
        make_dir(open_one, private=True)  # a checkpoint folder we write into must be private


def test_a_write_replaces_a_planted_symlink_and_never_writes_through_it(tmp_path: Path) -> None:
    victim = _own_file(tmp_path / "victim", b"precious")
    path = tmp_path / "state.json"
    path.symlink_to(victim)
    write_json_atomic(path, {"x": 1})
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink() and json.loads(path.read_text()) == {"x": 1}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "victim"]  # no fresh name left


def test_a_write_for_other_readers_takes_the_mode_less_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_bytes_atomic(tmp_path / "metrics.prom", b"x 1\n", mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "metrics.prom").st_mode) == 0o640


def test_the_other_writers_to_user_given_paths_replace_a_planted_link(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node-exporter textfile (prometheus_client's writer opened ``<path>.<pid>.<thread>``
    and followed a link planted at that guessable name), a config written with
    `FaultToleranceConfig.to_yaml_file`, and a worker's loaded-modules file: each goes through
    a fresh file renamed into place."""
    import threading

    from prometheus_client import CollectorRegistry, Counter

    from ft_client.startup import loaded_modules
    from ft_monitor.config import FaultToleranceConfig
    from ft_monitor.launcher.telemetry.metrics import write_textfile

    victim = _own_file(tmp_path / "victim", b"precious")
    textfile = tmp_path / "ft.prom"
    (tmp_path / f"ft.prom.{os.getpid()}.{threading.current_thread().ident}").symlink_to(victim)
    textfile.symlink_to(victim)
    reg = CollectorRegistry()
    Counter("job_steps", "Steps.", registry=reg).inc(7)
    write_textfile(str(textfile), reg)
    config = tmp_path / "ft.yaml"
    config.symlink_to(victim)
    FaultToleranceConfig().to_yaml_file(config)
    modules = tmp_path / "modules.json"
    modules.symlink_to(victim)
    monkeypatch.setenv(loaded_modules.MODULES_FILE_ENV, str(modules))
    loaded_modules.report()
    assert victim.read_bytes() == b"precious"
    for path in (textfile, config, modules):
        assert not path.is_symlink() and path.stat().st_size > 0, path
    assert FaultToleranceConfig.from_yaml_file(config) == FaultToleranceConfig()
    assert "os" in json.loads(modules.read_text()) and "job_steps_total 7.0" in textfile.read_text()
    assert stat.S_IMODE(textfile.stat().st_mode) & 0o044  # node-exporter, another user, reads it
