"""The tree shows the architecture (issue 25): ft_monitor's rooms import one way, the pure
core imports nothing above it, and no module of the project (bench/ included) imports itself
back through others. Read from the source with `ast` (every import counts: those under
TYPE_CHECKING and inside functions too), so a circle cannot hide behind a lazy import.
Issue 40: ft-launcher's and ft_client's modules are in rooms that import downwards too, and no
module grows over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ft_client", "ft_monitor", "bench")

ROOMS_BELOW: dict[str, set[str]] = {
    # ft_monitor's rooms, and the rooms each may import (besides itself)
    "core": set(),
    "forensics": {"core"},
    "processes": {"core"},
    "daemon": {"core", "forensics", "processes"},
    "launcher": {"core", "forensics", "processes"},
    "views": {"core", "forensics", "processes", "launcher"},
}
ENTRY_POINTS = {
    # the command lines and the public façade: they may import any room
    "ft_monitor", "ft_monitor.cli", "ft_monitor.config", "ft_monitor.config_text",
    "ft_monitor.rank_monitor_server", "ft_monitor.testing", "ft_monitor.launcher.main",
    "ft_monitor.launcher.early_check",  # the launcher's flags, checked before torch: the command line's
}
CLIENT_VOCABULARY = {
    # what the pure core may take from ft_client: words shared by both sides, no connection
    "ft_client.errors", "ft_client.timeouts", "ft_client.learning.calc", "ft_client.names",
    "ft_client.record", "ft_client.record.read", "ft_client.collectives", "ft_client.startup",
    "ft_client.session_info",
}

SNAPSHOT_ROOM = [
    # ft_client/snapshot/, bottom first: each module imports only those before it (the package's
    # __init__, its public API, may import them all; none of them imports the package back)
    "ft_client.snapshot.format",
    "ft_client.snapshot.tree",
    "ft_client.snapshot.memory",
    "ft_client.snapshot.agreement",
    "ft_client.snapshot.peer",
    "ft_client.snapshot.snapshotter",
]
CLIENT_ROOMS_BELOW: dict[str, set[str]] = {
    # ft_client's rooms (issue 40), and the client rooms each may import (besides itself and
    # the hall's words)
    "wire": set(),
    "record": set(),
    "store": set(),
    "learning": set(),
    "startup": set(),
    "snapshot": {"wire", "record", "store"},
    "inprocess": {"wire", "record", "store", "startup", "snapshot"},
    "client": {"wire", "record", "store", "learning", "startup", "inprocess"},
    "integrations": {"client", "inprocess", "snapshot", "wire", "record", "store", "learning", "startup"},
}
CLIENT_WORDS = {
    # ft_client's hall: the words both sides share; each imports only other words
    "ft_client.errors", "ft_client.env", "ft_client.names", "ft_client.logs", "ft_client.workload",
    "ft_client.process_group", "ft_client.timeouts", "ft_client.session_info", "ft_client.safefiles",
    "ft_client.collectives", "ft_client.torch_features",
}
CLIENT_DOORS = {
    # ft_client's public façade and the doors kept for documented paths: they may import any room
    "ft_client", "ft_client.observer", "ft_client.timeouts_calc",
}
MAX_LINES = 500
OVERSIZED: set[str] = set()
"""Modules still to be split (issue 40 split the last of them)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) for n, p in mods.items()}


def _room(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] != "ft_monitor" or mod in ENTRY_POINTS or len(parts) < 3:
        return None
    return parts[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), package __init__s left
    out (importing a submodule runs its package's __init__, which is not a circle of code)."""
    nodes = {n for n in graph if not ((ROOT / n.replace(".", "/")) / "__init__.py").exists()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in sorted(nodes):
        if n not in index:
            visit(n)
    return out


def test_no_module_imports_itself_back_through_others(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def test_every_ft_monitor_module_lives_in_a_room_or_is_an_entry_point(graph: dict[str, set[str]]) -> None:
    loose = sorted(m for m in graph if m.startswith("ft_monitor") and m not in ENTRY_POINTS
                   and (_room(m) not in ROOMS_BELOW and m.removeprefix("ft_monitor.") not in ROOMS_BELOW))
    assert loose == []


def test_rooms_import_only_the_rooms_below_them(graph: dict[str, set[str]]) -> None:
    upward = []
    for mod, deps in graph.items():
        room = _room(mod)
        if room is None:
            continue
        for dep in deps:
            if dep in ENTRY_POINTS:
                upward.append((mod, dep))
                continue
            other = _room(dep) or (dep.split(".")[1] if dep.startswith("ft_monitor.") else None)
            if other is not None and other != room and other not in ROOMS_BELOW[room]:
                upward.append((mod, dep))
    assert sorted(upward) == []


def test_the_pure_core_imports_nothing_of_the_client_but_its_vocabulary(graph: dict[str, set[str]]) -> None:
    core = {m: deps for m, deps in graph.items() if _room(m) == "core"}
    assert core, "no core modules found"
    wrong = sorted((m, d) for m, deps in core.items() for d in deps
                   if d.startswith("ft_client") and d not in CLIENT_VOCABULARY and d != "ft_client")
    assert wrong == []


def test_the_clients_vocabulary_does_not_reach_the_connection(graph: dict[str, set[str]]) -> None:
    """The words the core borrows from ft_client stay words: none of them imports the client's
    connection, transport or the in-process restart."""
    heavy = {"ft_client.client", "ft_client.wire.transport", "ft_client.inprocess"}
    wrong = sorted((m, d) for m in CLIENT_VOCABULARY for d in graph.get(m, set())
                   if any(d == h or d.startswith(h + ".") for h in heavy))
    assert wrong == []


def test_the_core_imports_no_io_library() -> None:
    """The pure core decides; sockets, processes and event loops are the other rooms' business."""
    banned = {"socket", "subprocess", "asyncio", "selectors", "threading", "multiprocessing", "mmap"}
    found = []
    for path in (ROOT / "ft_monitor" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [(path.name, n) for n in names if n.split(".")[0] in banned]
    assert found == []


def test_the_training_process_side_imports_nothing_of_the_monitor(graph: dict[str, set[str]]) -> None:
    """ft_client runs in the training process: it speaks the protocol, it never loads the
    daemon's or the launcher's code (whose imports it would pay for at every start)."""
    wrong = sorted((m, d) for m, deps in graph.items() if m.startswith("ft_client")
                   for d in deps if d.startswith("ft_monitor"))
    assert wrong == []


def test_the_snapshot_room_imports_only_downwards(graph: dict[str, set[str]]) -> None:
    room = sorted(m for m in graph if m.startswith("ft_client.snapshot."))
    assert room == sorted(SNAPSHOT_ROOM), "every module of ft_client/snapshot/ has its place in SNAPSHOT_ROOM"
    upward = sorted((mod, dep) for i, mod in enumerate(SNAPSHOT_ROOM) for dep in graph[mod]
                    if dep.startswith("ft_client.snapshot") and dep not in SNAPSHOT_ROOM[:i])
    assert upward == []


LAUNCHER_ROOMS_BELOW: dict[str, set[str]] = {
    # ft_monitor/launcher's rooms (issue 40), and the launcher rooms each may import (besides itself)
    "store": set(),
    "rdzv": set(),
    "warm": set(),
    "incident": {"store", "rdzv"},
    "telemetry": {"store", "rdzv", "incident"},
    "agent": {"store", "rdzv", "warm", "incident", "telemetry"},
}
LAUNCHER_HALL = {
    # the launcher's own top: the command line (main, its flags) and the words every room shares
    "ft_monitor.launcher", "ft_monitor.launcher.main", "ft_monitor.launcher.early_check",
    "ft_monitor.launcher.nvrx_flags", "ft_monitor.launcher.exit_codes", "ft_monitor.launcher.stop_signal",
}
LAUNCHER_VOCABULARY = {"ft_monitor.launcher.exit_codes", "ft_monitor.launcher.stop_signal"}


def _launcher_room(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) >= 4 and parts[:2] == ["ft_monitor", "launcher"] else None


def test_every_launcher_module_lives_in_a_room_or_the_hall(graph: dict[str, set[str]]) -> None:
    loose = sorted(m for m in graph if m.startswith("ft_monitor.launcher") and m not in LAUNCHER_HALL
                   and _launcher_room(m) not in LAUNCHER_ROOMS_BELOW
                   and m.removeprefix("ft_monitor.launcher.") not in LAUNCHER_ROOMS_BELOW)
    assert loose == []


def test_the_launchers_rooms_import_only_downwards(graph: dict[str, set[str]]) -> None:
    """A room may import its own modules, the rooms below it and the hall's shared words; never
    the command line above it, nor a room beside or above it."""
    upward = []
    for mod, deps in graph.items():
        room = _launcher_room(mod)
        if room is None:
            continue
        for dep in deps:
            if not dep.startswith("ft_monitor.launcher") or dep in LAUNCHER_VOCABULARY:
                continue
            other = _launcher_room(dep) or dep.removeprefix("ft_monitor.launcher.")
            if other != room and other not in LAUNCHER_ROOMS_BELOW[room]:
                upward.append((mod, dep))
    assert sorted(upward) == []


def _client_room(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "ft_client" and parts[1] in CLIENT_ROOMS_BELOW else None


def test_every_client_module_lives_in_a_room_or_the_hall(graph: dict[str, set[str]]) -> None:
    loose = sorted(m for m in graph if m.startswith("ft_client") and _client_room(m) is None
                   and m not in CLIENT_WORDS | CLIENT_DOORS)
    assert loose == []


def test_the_clients_rooms_import_only_downwards(graph: dict[str, set[str]]) -> None:
    """A client room imports its own modules, the rooms below it and the hall's words; a word
    imports only words. Never a door (the façade above every room), nor a room beside or above."""
    upward = []
    for mod, deps in graph.items():
        if not mod.startswith("ft_client") or mod in CLIENT_DOORS:
            continue
        room = _client_room(mod)
        for dep in deps:
            if not dep.startswith("ft_client") or dep in CLIENT_WORDS:
                continue
            other = _client_room(dep)
            if room is None or other is None or (other != room and other not in CLIENT_ROOMS_BELOW[room]):
                upward.append((mod, dep))
    assert sorted(upward) == []


def test_no_framework_is_imported_but_by_its_integration() -> None:
    """``import ft_client`` loads no framework: only ft_client/integrations/ imports Lightning,
    transformers or accelerate, and nothing of ft_client imports that room."""
    frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate")
    found = []
    for path in (ROOT / "ft_client").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                if (n.split(".")[0] in frameworks and not rel.startswith("ft_client/integrations/")) or \
                        (n.startswith("ft_client.integrations") and not rel.startswith("ft_client/integrations/")):
                    found.append((rel, n))
    assert found == []


def test_no_module_is_over_500_lines_but_those_still_to_be_split() -> None:
    """A module that outgrows MAX_LINES is split by what its parts do (issue 40), not let grow."""
    over = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if len(p.read_text().splitlines()) > MAX_LINES)
    assert [p for p in over if p not in OVERSIZED] == []
