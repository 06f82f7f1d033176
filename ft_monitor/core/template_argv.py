"""Which command lines a worker template can run, and when it may fork (pure: no I/O).

A worker template (`ft_monitor.launcher.warm.template`) is a Python interpreter that has
imported torch and the user's modules; it forks a ready interpreter for each worker and
runs the worker's script in it as ``python script.py`` would. It can only do that for a
command line that *is* ``python script.py`` with its own interpreter: torchrun passes
``[sys.executable, "-u", script, *args]``. `plan` reads a command line and says how to run
it, or why it cannot (a module entry point, another program, an interpreter option a
started interpreter cannot take); the launcher then starts that worker the normal way
and logs the reason.

`fork_problem` is the check made before every fork: the template must be one thread
(a fork copies only the calling thread, and locks held by the others stay held forever
in the child) and must never have initialised CUDA (a CUDA context does not survive a
fork). `ignored_env` names the variables of a worker's environment that cannot take
effect in a forked worker because the interpreter or a library reads them when it starts.
"""

from __future__ import annotations

import codecs
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

ACCEPTED_FLAGS = {"u": "unbuffered", "B": "dont_write_bytecode"}
"""Interpreter options a forked worker can take: ``-u`` (stdout and stderr reopened
unbuffered) and ``-B`` (``sys.dont_write_bytecode``)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """How to run a command line in a forked interpreter."""

    script: str
    """As given (``sys.argv[0]``); relative to the worker's cwd when not absolute."""
    args: tuple[str, ...]
    unbuffered: bool = False
    dont_write_bytecode: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the template will not do what was asked (one line, for the launcher's log)."""

    why: str


def plan(argv: Sequence[str], executable: str, *, realpath: Callable[[str], str]) -> Plan | Refusal:
    """How to run ``argv`` in a fork of the interpreter ``executable`` (the template's
    ``sys.executable``), or why it cannot be. ``realpath`` resolves symbolic links (the
    caller's ``os.path.realpath``): the command's interpreter must be the same file as the
    template's, found in the same directory (the one a virtual environment is found from)."""
    if not argv:
        return Refusal("an empty command line")
    program = argv[0]
    if not posixpath.isabs(program):
        return Refusal(f"the command's program {program!r} is not an absolute path: the template runs "
                       f"only its own interpreter, {executable}")
    if realpath(program) != realpath(executable):
        return Refusal(f"the command's program {program} is not the template's interpreter {executable} "
                       f"(another binary or another Python): the template runs only Python scripts with its "
                       f"own interpreter")
    if realpath(posixpath.dirname(program)) != realpath(posixpath.dirname(executable)):
        return Refusal(f"the command's interpreter {program} is the template's ({executable}) started from "
                       f"another directory, which may be another virtual environment")
    flags: set[str] = set()
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg == "-":
            return Refusal("a script read from stdin ('-'): the template runs script files only")
        if not arg.startswith("-"):
            break
        if arg.startswith("--"):
            return Refusal(f"the interpreter option {arg}: a forked worker cannot take it")
        for letter in arg[1:]:
            if letter == "m":
                return Refusal(f"a module entry point ({' '.join(argv[i:i + 2])}): the template runs script "
                               f"files only")
            if letter == "c":
                return Refusal("a command string (-c): the template runs script files only")
            if letter not in ACCEPTED_FLAGS:
                return Refusal(f"the interpreter option -{letter} (in {arg}): a forked worker cannot take it, "
                               f"its interpreter has started already (only -u and -B are understood)")
            flags.add(letter)
        i += 1
    if i >= len(argv):
        return Refusal("no script to run: the template runs script files only")
    return Plan(script=argv[i], args=tuple(argv[i + 1:]), unbuffered="u" in flags,
                dont_write_bytecode="B" in flags)


def fork_problem(threads: Sequence[str], cuda_initialized: bool,
                 unsafe: Mapping[str, str] | None = None) -> str | None:
    """Why the template must not fork now, or None. ``threads``: the name of each of its
    threads (``/proc/self/task/*/comm``); ``unsafe``: the preloaded modules seen doing either
    at import, and what they did (named in the reason, so that they can be left out)."""
    culprits = "; ".join(f"{m} {what} at import" for m, what in (unsafe or {}).items())
    suffix = f" ({culprits})" if culprits else ""
    if cuda_initialized:  # first: CUDA starts a driver thread too, and CUDA is what to leave out
        return (f"the template has initialised CUDA: a CUDA context does not survive a fork (a preloaded module "
                f"must not touch the GPU at import){suffix}")
    if len(threads) != 1:
        names = ", ".join(threads) if threads else "none could be read"
        return (f"the template has {len(threads)} threads ({names}): forking it would copy a process with "
                f"locks held by threads that do not exist in the child{suffix}")
    return None


C_LOCALES = frozenset({"C", "POSIX"})
COERCED_LOCALES = frozenset({"C.UTF-8", "C.utf8", "UTF-8"})
"""PEP 538's coercion targets: surrogateescape is their stdio default too."""


def ctype_locale(env: Mapping[str, str]) -> str:
    """The LC_CTYPE locale that ``env`` asks for: LC_ALL, else LC_CTYPE, else LANG, else C."""
    for name in ("LC_ALL", "LC_CTYPE", "LANG"):
        if env.get(name):
            return env[name]
    return "C"


def stdio_codec(env: Mapping[str, str], locale_name: str, codeset: str) -> tuple[str, str]:
    """(encoding, errors) of stdin and stdout as CPython picks them at start for ``env``,
    before PYTHONIOENCODING: ``locale_name`` is the LC_CTYPE locale set from ``env`` ("C" if
    it could not be set), ``codeset`` that locale's encoding. UTF-8 mode (PYTHONUTF8=1, or a
    C/POSIX locale without PYTHONUTF8=0) gives utf-8/surrogateescape; otherwise the locale's
    codeset, with surrogateescape in the C, POSIX and C.UTF-8 locales and strict elsewhere."""
    utf8 = env.get("PYTHONUTF8")
    utf8_mode = utf8 == "1" if utf8 in ("0", "1") else locale_name in C_LOCALES
    if utf8_mode:
        return "utf-8", "surrogateescape"
    if locale_name in C_LOCALES:  # PYTHONUTF8=0: coerced to C.UTF-8 unless PYTHONCOERCECLOCALE=0
        return ("ascii" if env.get("PYTHONCOERCECLOCALE") == "0" else "utf-8"), "surrogateescape"
    return _codec_name(codeset or "utf-8"), "surrogateescape" if locale_name in COERCED_LOCALES else "strict"


def _codec_name(encoding: str) -> str:
    """The codec's own name, as the interpreter normalises its stdio encoding ("UTF-8" -> "utf-8")."""
    try:
        return codecs.lookup(encoding).name
    except LookupError:
        return encoding


HANDLED_ENV = frozenset({
    "PYTHONPATH",  # sys.path rebuilt from it
    "PYTHONUNBUFFERED",  # as -u
    "PYTHONDONTWRITEBYTECODE",  # as -B
    "PYTHONFAULTHANDLER",  # faulthandler.enable()
    "PYTHONIOENCODING",  # stdio reopened with it
    "PYTHONBREAKPOINT", "PYTHONASYNCIODEBUG",  # read when used, not at start
})
"""Python's variables that do take effect in a forked worker."""

IMPORT_TIME_ENV = frozenset({
    # BLAS and OpenMP runtimes size their thread pools when loaded (OMP_NUM_THREADS is left
    # out: the template applies it to torch with torch.set_num_threads)
    "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "MKL_THREADING_LAYER", "KMP_AFFINITY",
    "OMP_PROC_BIND", "OMP_PLACES",
})


def ignored_env(template_env: Mapping[str, str], worker_env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables, set differently for the worker than for the template, that cannot take
    effect in a forked worker: Python's own (``PYTHON*``, read when the interpreter starts:
    PYTHONHASHSEED, PYTHONOPTIMIZE, PYTHONWARNINGS, ...) but those the template applies, and
    the thread-pool sizes of BLAS and OpenMP runtimes. A variable that a preloaded module
    reads at import is ignored too, and cannot be named here."""
    names = set(template_env) | set(worker_env)
    return tuple(sorted(
        n for n in names
        if template_env.get(n) != worker_env.get(n)
        and ((n.startswith("PYTHON") and n not in HANDLED_ENV) or n in IMPORT_TIME_ENV)
    ))
