"""ft-launcher's own flags (`add_launcher_flags`), and what it can refuse with them before it
imports torch (seconds on a busy machine): an unknown --ft-* flag (with the nearest known one),
a flag of nvidia-resiliency-ext's ft_launcher given a value that means nothing here
(nvrx_flags.py, which also adds those flags), and a config that does not validate (the YAML
file, FT_<FIELD> and the --ft-* flags, as the launch will read them). One line and exit 2,
within a fraction of a second; anything this check cannot tell (torchrun's own flags, a
``--no-python`` command) is left to the full parse, which runs after torch is imported as before.
`missing_script` is checked last, after every other check of the launch (main.py).

The launcher's part of the command line is what comes before the training script: the first
argument ending in ``.py``, or the module after ``-m``/``--module``. Without either (a
``--no-python`` command) nothing is checked here.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from ft_client.errors import FtError
from ft_monitor.config_text import FIELDS, IGNORED_NVRX_FIELDS, add_config_flags
from ft_monitor.launcher import nvrx_flags

MODULE_FLAGS = ("-m", "--module")
_SILENT = logging.getLogger("ft_monitor.launcher.early_check")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False  # what the config's warnings say is said once, by the launch's own reading
HELP_FLAGS = ("-h", "--help")


class _Refused(FtError, ValueError):
    """The bare parser's refusal (caught here: said in one line)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Quiet(argparse.ArgumentParser):
    """A parser that raises instead of printing the usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refused(message)


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """ft-launcher's own flags (the --ft-* settings, the launcher's, and nvidia-resiliency-ext's
    ft_launcher flags that torchrun lacks: nvrx_flags.py), on torchrun's parser or, for the check
    before torch is imported (early_check.py), on a bare one."""
    add_config_flags(parser, with_cfg_path=True, param_aliases=True)  # --ft-param-*: the reference's old spelling
    parser.add_argument("--ft-summary-json", default=None, metavar="FILE",
                        help="write what happened (hangs, restart timings, exit code) to FILE as JSON")
    parser.add_argument("--ft-job-secret-file", "--ft_job_secret_file", dest="ft_job_secret_file", default=None,
                        metavar="FILE",
                        help="the job's secret (same on every node, readable only by you; or set "
                             "$FT_JOB_SECRET_FILE, with $FT_JOB_SECRET_FILE_ONCE=1 for a file made for this launcher "
                             "alone, removed once read; or $FT_JOB_SECRET): signs the launchers' messages in the "
                             "rendezvous store. Without it, hang attribution and shutdown across nodes are off")
    parser.add_argument("--ft-warm-restart", "--ft_warm_restart", dest="ft_warm_restart", action="store_true",
                        help="fork the workers of every restart from a worker template that has already imported "
                             "torch and --ft-preload's modules (no interpreter start, no imports); attempt 0 and "
                             "anything the template cannot run start as usual (docs/launcher.md, 'Warm restarts')")
    parser.add_argument("--ft-warm-start", "--ft_warm_start", dest="ft_warm_start", action="store_true",
                        help="with --ft-warm-restart (implied): attempt 0's workers are forked from the template too, "
                             "once it has imported: torch and --ft-preload's modules are imported once per node "
                             "instead of once per worker (docs/launcher.md, 'Warm restarts')")
    parser.add_argument("--ft-preload", "--ft_preload", dest="ft_preload", default=None, metavar="MODULES",
                        help="with --ft-warm-restart: comma-separated modules the template imports besides torch, "
                             "or 'auto': those the first attempt's workers had loaded")
    nvrx_flags.add_flags(parser, FIELDS + tuple(sorted(IGNORED_NVRX_FIELDS)))  # the reference's other flags


def unknown_flag(arg: str, parser: argparse.ArgumentParser, ours_only: bool = False) -> str:
    """"unknown flag X", with the nearest of ``parser``'s flags (of the --ft-* ones with ``ours_only``)."""
    name = arg.split("=", 1)[0]
    known = [o for o in parser._option_string_actions  # noqa: SLF001 - argparse's own table of flags
             if o.startswith("--") and (o.startswith("--ft") or not ours_only)]
    close = difflib.get_close_matches(name.replace("_", "-"), [k.replace("_", "-") for k in known], n=1, cutoff=0.75)
    return f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else "")


def refuse_in_one_line(parser: argparse.ArgumentParser) -> None:
    """torchrun's parser (`main.build_parser`), made to refuse as ours do: no prefix of a flag is
    taken for the flag (``--max-restart 2`` was silently ``--max-restarts``), and a flag it does
    not know is one line with the nearest known one and exit 2, not torchrun's whole usage."""
    parser.allow_abbrev = False

    def error(message: str) -> NoReturn:
        words = message.removeprefix("unrecognized arguments: ").split()
        flags = [w for w in words if w.startswith("-")] if message.startswith("unrecognized arguments") else []
        line = "; ".join(unknown_flag(w, parser) for w in flags) if flags else message
        parser.exit(2, f"{parser.prog}: {line} (ft-launcher --help lists the flags)\n")

    parser.error = error  # type: ignore[method-assign]


def launcher_part(argv: Sequence[str]) -> tuple[list[str], str | None] | None:
    """The arguments before the training script, and the script (None for a module); None
    when the script cannot be told apart without torchrun's parser."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return None
        if arg in MODULE_FLAGS:
            return list(argv[:i]), None
        if arg.endswith(".py") and not arg.startswith("-"):
            return list(argv[:i]), arg
    return None


def parse_launch(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The launch's flags, parsed as torchrun parses them but for the training script's own
    arguments, which are never parsed: argparse takes an argument after the script for a flag
    of ours when it is a prefix of one (a script's ``--workers 2`` was refused as ambiguous
    with ``--workers-stop-timeout``, and a unique prefix would have been taken as ours). Where
    the script cannot be told apart (``-m``, ``--no-python``, ``--``), all of it is parsed, as
    torchrun does."""
    found = launcher_part(argv)
    if found is None or found[1] is None:
        return parser.parse_args(list(argv))
    cut = len(found[0]) + 1
    args = parser.parse_args(list(argv[:cut]))
    args.training_script_args = [*args.training_script_args, *argv[cut:]]
    return args


def missing_script(argv: Sequence[str], cwd: str | None = None) -> str | None:
    """Why the training script cannot run, where it is a file that does not exist; else None."""
    found = launcher_part(argv)
    script = found[1] if found is not None else None
    if script is None:
        return None
    path = Path(cwd or os.getcwd(), script)
    if path.is_file():
        return None
    return f"the training script {script} does not exist (in {path.parent})"


def problem(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """Why the launch will be refused, found without torch; None when nothing is (yet)."""
    from ft_monitor.config import ConfigError, cli_overrides, load_config
    from ft_monitor.core.settings import Settings, SettingsError

    found = launcher_part(argv)
    if found is None:
        return None
    ours, _ = found
    if any(a in HELP_FLAGS for a in ours):
        return None
    parser = _Quiet(prog="ft-launcher", add_help=False, allow_abbrev=False)
    add_launcher_flags(parser)
    try:
        args, rest = parser.parse_known_args(ours)
    except _Refused as e:
        return e.message
    for arg in rest:
        if arg.startswith(("--ft-", "--ft_")):
            return unknown_flag(arg, parser, ours_only=True)
    refused = nvrx_flags.apply(args).refusal  # its warnings are logged once, by the launch's own parse
    if refused is not None:
        return refused
    try:
        Settings.from_config(load_config(args.ft_cfg_path, environ, cli_overrides(args), log=_SILENT))
    except (ConfigError, SettingsError) as e:
        return str(e)
    return None
