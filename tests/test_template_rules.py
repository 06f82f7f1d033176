"""The worker template's pure rules: which command lines it runs, when it may fork, which
variables cannot take effect, and its requests read field by field (issue 27)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_monitor.core.template_argv import Plan, Refusal, ctype_locale, fork_problem, ignored_env, plan, stdio_codec
from ft_monitor.core.template_request import (
    SpawnRequest,
    StatusRequest,
    parse_request,
    parse_spawn_reply,
    parse_status_reply,
)
from ft_monitor.launcher.warm import template_wire
from ft_monitor.launcher.warm.template_wire import TemplateError

PY = "/venv/bin/python"
LINKS = {"/venv/bin/python": "/usr/lib/python3.11", "/venv/bin/python3": "/usr/lib/python3.11",
         "/other/bin/python": "/usr/lib/python3.11", "/usr/bin/echo": "/usr/bin/echo",
         "/usr/bin/python3.12": "/usr/bin/python3.12"}


def realpath(p: str) -> str:
    return LINKS.get(p, p)


def test_torchruns_command_line_is_planned() -> None:
    assert plan([PY, "-u", "train.py", "--lr", "0.1"], PY, realpath=realpath) == \
        Plan("train.py", ("--lr", "0.1"), unbuffered=True)
    assert plan(["/venv/bin/python3", "/abs/t.py"], PY, realpath=realpath) == Plan("/abs/t.py", ())
    assert plan([PY, "-uB", "--", "-odd.py", "-m"], PY, realpath=realpath) == \
        Plan("-odd.py", ("-m",), unbuffered=True, dont_write_bytecode=True)
    # the script's own options are its own, after the script
    assert plan([PY, "t.py", "-m", "x", "-c", "y"], PY, realpath=realpath) == Plan("t.py", ("-m", "x", "-c", "y"))


@pytest.mark.parametrize(("argv", "words"), [
    ([], "empty"),
    ([PY, "-u", "-m", "pkg.train", "--x"], "module entry point (-m pkg.train)"),
    ([PY, "-um", "pkg.train"], "module entry point"),
    ([PY, "-c", "print(1)"], "command string (-c)"),
    (["/usr/bin/echo", "hi"], "is not the template's interpreter"),
    (["/usr/bin/python3.12", "t.py"], "another Python"),
    (["python", "t.py"], "not an absolute path"),
    (["/other/bin/python", "t.py"], "another virtual environment"),
    ([PY, "-O", "t.py"], "option -O"),
    ([PY, "-X", "dev", "t.py"], "option -X"),
    ([PY, "--check-hash-based-pycs", "always", "t.py"], "--check-hash-based-pycs"),
    ([PY, "-", "a"], "stdin"),
    ([PY, "-u"], "no script"),
])
def test_what_the_template_cannot_run_is_refused_with_the_reason(argv: list[str], words: str) -> None:
    got = plan(argv, PY, realpath=realpath)
    assert isinstance(got, Refusal)
    assert words in got.why


def test_fork_problem() -> None:
    assert fork_problem(["python"], False) is None
    why = fork_problem(["python", "preload-thread"], False)
    assert why == ("the template has 2 threads (python, preload-thread): forking it would copy a process with "
                   "locks held by threads that do not exist in the child")
    why = fork_problem(["python"], True)
    assert why is not None and "initialised CUDA" in why
    why = fork_problem(["python", "python"], False, {"mod": "started 1 thread(s)"})
    assert why is not None and why.endswith("do not exist in the child (mod started 1 thread(s) at import)")
    assert "0 threads" in (fork_problem([], False) or "")
    # a real GPU: CUDA's init starts a driver thread; CUDA, the cause, is what the reason says (seen on an H100)
    why = fork_problem(["python3", "cuda00001400006"], True, {"mod": "started 1 thread(s) and initialised CUDA"})
    assert why is not None and why.startswith("the template has initialised CUDA")
    assert why.endswith("(mod started 1 thread(s) and initialised CUDA at import)")


@pytest.mark.parametrize(("env", "locale_name", "codeset", "codec"), [
    ({}, "C", "ANSI_X3.4-1968", ("utf-8", "surrogateescape")),  # no locale: C, UTF-8 mode
    ({"LANG": "C.UTF-8"}, "C.UTF-8", "UTF-8", ("utf-8", "surrogateescape")),  # a coercion target
    ({"LANG": "en_US.UTF-8"}, "en_US.UTF-8", "UTF-8", ("utf-8", "strict")),
    ({"LANG": "de_DE.ISO-8859-1"}, "de_DE.ISO-8859-1", "ISO-8859-1", ("iso8859-1", "strict")),
    ({"LANG": "en_US.UTF-8", "PYTHONUTF8": "1"}, "en_US.UTF-8", "UTF-8", ("utf-8", "surrogateescape")),
    ({"PYTHONUTF8": "0"}, "C", "ANSI_X3.4-1968", ("utf-8", "surrogateescape")),  # PEP 538's coercion
    ({"PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}, "C", "ANSI_X3.4-1968", ("ascii", "surrogateescape")),
])
def test_stdio_codec_follows_the_workers_locale(env: dict[str, str], locale_name: str, codeset: str,
                                                codec: tuple[str, str]) -> None:
    assert stdio_codec(env, locale_name, codeset) == codec


def test_the_ctype_locale_is_lc_all_then_lc_ctype_then_lang() -> None:
    assert ctype_locale({"LANG": "a", "LC_CTYPE": "b", "LC_ALL": "c"}) == "c"
    assert ctype_locale({"LANG": "a", "LC_CTYPE": "b", "LC_ALL": ""}) == "b"
    assert ctype_locale({"LANG": "a"}) == "a"
    assert ctype_locale({}) == "C"


def test_ignored_env_names_what_the_interpreter_read_at_start() -> None:
    template = {"PATH": "/bin", "PYTHONHASHSEED": "0", "PYTHONPATH": "/a", "OMP_NUM_THREADS": "4"}
    worker = {"PATH": "/usr/bin", "PYTHONHASHSEED": "1", "PYTHONPATH": "/b", "PYTHONWARNINGS": "error",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    assert ignored_env(template, worker) == ("MKL_NUM_THREADS", "PYTHONHASHSEED", "PYTHONWARNINGS")
    assert ignored_env(template, template) == ()


def test_requests_are_read_field_by_field() -> None:
    assert parse_request({"op": "status"}, 0) == StatusRequest()
    ok = {"op": "spawn", "argv": [PY, "t.py"], "env": {"A": "1"}, "cwd": "/w", "stdio": ["stdout", "stderr"]}
    assert parse_request(ok, 2) == SpawnRequest((PY, "t.py"), (("A", "1"),), "/w", ("stdout", "stderr"))
    assert parse_request({**ok, "stdio": []}, 0) == SpawnRequest((PY, "t.py"), (("A", "1"),), "/w", ())
    bad: list[tuple[object, int, str]] = [
        ([1], 0, "a map was expected"),
        ({"op": "status", "x": 1}, 0, "takes no field"),
        ({"op": "status"}, 1, "no descriptor"),
        ({"op": "fork"}, 0, "unknown op"),
        ({}, 0, "no op"),
        ({**ok, "extra": 1}, 2, "no field extra"),
        ({**ok, "argv": []}, 2, "argv"),
        ({**ok, "argv": [PY, 3]}, 2, "argv[1] must be a string"),
        ({**ok, "argv": [PY, "a\0b"]}, 2, "NUL"),
        ({**ok, "env": {"A=B": "1"}}, 2, "contains '='"),
        ({**ok, "env": {"": "1"}}, 2, "empty"),
        ({**ok, "env": {"A": 1}}, 2, "must be a string"),
        ({**ok, "env": [["A", "1"]]}, 2, "env must be a map"),
        ({**ok, "cwd": "rel"}, 2, "not an absolute path"),
        ({**ok, "cwd": None}, 2, "cwd must be a string"),
        ({**ok, "stdio": ["stdin"]}, 1, "stdio must list"),
        ({**ok, "stdio": ["stdout", "stdout"]}, 2, "at most once"),
        ({**ok, "stdio": ["stdout"]}, 2, "1 descriptor(s), 2 came"),
    ]
    for obj, nfds, words in bad:
        got = parse_request(obj, nfds)
        assert isinstance(got, Refusal), obj
        assert words in got.why, (obj, got.why)


def test_replies_are_read_field_by_field() -> None:
    assert parse_spawn_reply({"ok": True, "pid": 42}).pid == 42  # type: ignore[union-attr]
    assert parse_spawn_reply({"ok": False, "error": "no"}) == Refusal("no")
    assert isinstance(parse_spawn_reply({"ok": True, "pid": True}), Refusal)
    assert isinstance(parse_spawn_reply("x"), Refusal)
    status = {"ok": True, "pid": 5, "preloaded": ["torch"], "failed": {}, "threads": 1, "cuda_initialized": False,
              "rss_kb": 100, "frozen_objects": 0}
    assert parse_status_reply(status) == {**status, "unsafe": {}}
    assert parse_status_reply({**status, "unsafe": {"m": "initialised CUDA"}}) == \
        {**status, "unsafe": {"m": "initialised CUDA"}}
    assert isinstance(parse_status_reply({**status, "unsafe": {"m": 1}}), Refusal)
    assert isinstance(parse_status_reply({**status, "threads": "1"}), Refusal)
    assert isinstance(parse_status_reply({**status, "cuda_initialized": 0}), Refusal)
    assert isinstance(parse_status_reply({**status, "failed": {"a": 1}}), Refusal)


PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


@given(st.one_of(PLAIN, st.fixed_dictionaries({"op": st.sampled_from(["spawn", "status"])}, optional={
    "argv": PLAIN | st.lists(st.text(max_size=6), max_size=3), "env": PLAIN, "cwd": PLAIN | st.just("/w"),
    "stdio": PLAIN})), st.integers(0, 3))
@settings(max_examples=300, deadline=None)
def test_parse_request_is_total(obj: object, nfds: int) -> None:
    assert isinstance(parse_request(obj, nfds), (StatusRequest, SpawnRequest, Refusal))


@given(PLAIN)
@settings(max_examples=200, deadline=None)
def test_parse_replies_are_total(obj: object) -> None:
    parse_spawn_reply(obj)
    parse_status_reply(obj)


def test_frames_refuse_extension_types_and_garbage() -> None:
    with pytest.raises(TemplateError, match="extension type 5"):
        template_wire.decode(msgpack.packb(msgpack.ExtType(5, b"x")))
    with pytest.raises(TemplateError, match="not valid msgpack"):
        template_wire.decode(b"\xc1")
    assert template_wire.decode(template_wire.encode({"op": "status"})[4:]) == {"op": "status"}
