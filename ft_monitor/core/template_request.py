"""The worker template's requests and replies, read field by field (pure: no I/O).

The launcher talks to its worker template (`ft_monitor.launcher.warm.template`) over a Unix
socket, one request per connection; a frame is a 4-byte big-endian length and a msgpack
map (`ft_monitor.launcher.warm.template_wire` owns the bytes)::

    {"op": "status"}
        -> {"ok": true, "pid", "preloaded": [name], "failed": {name: why}, "threads",
            "cuda_initialized", "rss_kb", "unsafe": {name: what it did at import}}
    {"op": "spawn", "argv": [str], "env": {str: str}, "cwd": absolute path,
     "stdio": ["stdout", "stderr"]}    descriptors attached (SCM_RIGHTS), in stdio's order
        -> {"ok": true, "pid": the worker's pid, "ignored_env": [name]}
    any refusal
        -> {"ok": false, "error": why}

`parse_request` is total: whatever the decoder produced, it returns a typed request or a
`Refusal` saying what is wrong (the template reads nothing else of a request). The replies
are read the same way on the launcher's side (`parse_status_reply`, `parse_spawn_reply`).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from ft_monitor.core.template_argv import Refusal

MAX_ARGS = 65536
MAX_ARG_BYTES = 128 * 1024
"""Linux's limit on one argument or environment string (MAX_ARG_STRLEN)."""
STDIO = ("stdout", "stderr")


@dataclass(frozen=True, slots=True)
class StatusRequest:
    pass


@dataclass(frozen=True, slots=True)
class SpawnRequest:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str
    stdio: tuple[str, ...]
    """Which of the worker's stdout and stderr the attached descriptors are, in their order;
    one left out is the template's own."""


Request = StatusRequest | SpawnRequest


@dataclass(frozen=True, slots=True)
class SpawnReply:
    pid: int
    ignored_env: tuple[str, ...]


def _text_problem(value: object, what: str) -> str | None:
    if not isinstance(value, str):
        return f"{what} must be a string, got {type(value).__name__}"
    if "\0" in value:
        return f"{what} contains a NUL character"
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ARG_BYTES:
        return f"{what} is longer than {MAX_ARG_BYTES} bytes"
    return None


def parse_request(obj: object, nfds: int) -> Request | Refusal:
    """The request in ``obj`` (a decoded frame) that came with ``nfds`` descriptors."""
    if not isinstance(obj, dict):
        return Refusal(f"bad request: a map was expected, got {type(obj).__name__}")
    op = obj.get("op")
    if op == "status":
        extra = sorted(str(k) for k in obj if k != "op")
        if extra:
            return Refusal(f"bad request: status takes no field, got {', '.join(extra)}")
        if nfds:
            return Refusal("bad request: status takes no descriptor")
        return StatusRequest()
    if op != "spawn":
        return Refusal(f"bad request: unknown op {op!r}" if isinstance(op, str) else "bad request: no op")
    extra = sorted(str(k) for k in obj if k not in ("op", "argv", "env", "cwd", "stdio"))
    if extra:
        return Refusal(f"bad request: spawn has no field {', '.join(extra)}")
    argv = obj.get("argv")
    if not isinstance(argv, list) or not argv:
        return Refusal("bad request: argv must be a non-empty list of strings")
    if len(argv) > MAX_ARGS:
        return Refusal(f"bad request: more than {MAX_ARGS} arguments")
    for i, a in enumerate(argv):
        problem = _text_problem(a, f"argv[{i}]")
        if problem:
            return Refusal(f"bad request: {problem}")
    env = obj.get("env")
    if not isinstance(env, dict):
        return Refusal("bad request: env must be a map of strings to strings")
    if len(env) > MAX_ARGS:
        return Refusal(f"bad request: more than {MAX_ARGS} environment variables")
    pairs: list[tuple[str, str]] = []
    for k, v in env.items():
        problem = _text_problem(k, "an environment variable's name")
        if problem is None and (not k or "=" in k):
            problem = f"the environment variable name {k!r} is empty or contains '='"
        if problem is None:
            problem = _text_problem(v, f"the environment variable {k}")
        if problem:
            return Refusal(f"bad request: {problem}")
        pairs.append((k, v))
    cwd = obj.get("cwd")
    problem = _text_problem(cwd, "cwd")
    if problem:
        return Refusal(f"bad request: {problem}")
    assert isinstance(cwd, str)
    if not posixpath.isabs(cwd):
        return Refusal(f"bad request: cwd {cwd!r} is not an absolute path")
    stdio = obj.get("stdio", [])
    if not isinstance(stdio, list) or any(s not in STDIO for s in stdio) or len(set(stdio)) != len(stdio):
        return Refusal("bad request: stdio must list 'stdout' and/or 'stderr', each at most once")
    if len(stdio) != nfds:
        return Refusal(f"bad request: stdio names {len(stdio)} descriptor(s), {nfds} came with the request")
    return SpawnRequest(tuple(argv), tuple(pairs), cwd, tuple(stdio))


def encode_spawn(argv: list[str], env: dict[str, str], cwd: str, stdio: list[str]) -> dict[str, Any]:
    """The spawn request's map (the launcher's side)."""
    return {"op": "spawn", "argv": argv, "env": env, "cwd": cwd, "stdio": stdio}


def _refusal(obj: dict[Any, Any]) -> Refusal:
    error = obj.get("error")
    return Refusal(error if isinstance(error, str) and error else "refused without a reason")


def parse_spawn_reply(obj: object) -> SpawnReply | Refusal:
    if not isinstance(obj, dict):
        return Refusal(f"the template's reply is not a map: {type(obj).__name__}")
    if obj.get("ok") is not True:
        return _refusal(obj)
    pid = obj.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return Refusal(f"the template's reply has no valid pid: {pid!r}")
    ignored = obj.get("ignored_env", [])
    if not isinstance(ignored, list) or not all(isinstance(n, str) for n in ignored):
        ignored = []
    return SpawnReply(pid, tuple(ignored))


STATUS_FIELDS: dict[str, tuple[type, ...]] = {
    "pid": (int,), "preloaded": (list,), "failed": (dict,), "threads": (int,),
    "cuda_initialized": (bool,), "rss_kb": (int,), "frozen_objects": (int,),
}


def parse_status_reply(obj: object) -> dict[str, Any] | Refusal:
    """The status map with each field of the right type, or why not."""
    if not isinstance(obj, dict):
        return Refusal(f"the template's reply is not a map: {type(obj).__name__}")
    if obj.get("ok") is not True:
        return _refusal(obj)
    out: dict[str, Any] = {"ok": True}
    for name, types in STATUS_FIELDS.items():
        value = obj.get(name)
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            return Refusal(f"the template's status has no valid {name}: {value!r}")
        out[name] = value
    unsafe = obj.get("unsafe", {})
    out["unsafe"] = unsafe if isinstance(unsafe, dict) else {}
    if not all(isinstance(n, str) for n in out["preloaded"]) or \
            not all(isinstance(k, str) and isinstance(v, str) for m in ("failed", "unsafe") for k, v in out[m].items()):
        return Refusal("the template's status lists names that are not strings")
    return out
