"""What ft-launcher can refuse before it imports torch (seconds on a busy machine): an unknown
--ft-* flag (with the nearest known one), a config that does not validate (the YAML file,
FT_<FIELD> and the --ft-* flags, as the launch will read them), and a training script that
does not exist. One line and exit 2, within a fraction of a second; anything this check cannot
tell (torchrun's own flags, a ``--no-python`` command) is left to the full parse, which runs
after torch is imported as before.

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

MODULE_FLAGS = ("-m", "--module")
_SILENT = logging.getLogger("ft_monitor.launcher.early_check")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False  # what the config's warnings say is said once, by the launch's own reading
HELP_FLAGS = ("-h", "--help")


class _Refused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Quiet(argparse.ArgumentParser):
    """A parser that raises instead of printing the usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refused(message)


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


def problem(argv: Sequence[str], environ: Mapping[str, str], cwd: str | None = None) -> str | None:
    """Why the launch will be refused, found without torch; None when nothing is (yet)."""
    from ft_monitor.config import ConfigError, cli_overrides, load_config
    from ft_monitor.core.settings import Settings, SettingsError
    from ft_monitor.launcher.main import add_launcher_flags

    found = launcher_part(argv)
    if found is None:
        return None
    ours, script = found
    if any(a in HELP_FLAGS for a in ours):
        return None
    parser = _Quiet(prog="ft-launcher", add_help=False)
    add_launcher_flags(parser)
    try:
        args, rest = parser.parse_known_args(ours)
    except _Refused as e:
        return e.message
    for arg in rest:
        if arg.startswith(("--ft-", "--ft_")):
            name = arg.split("=", 1)[0]
            known = [o for o in parser._option_string_actions if o.startswith("--ft")]  # noqa: SLF001 - argparse's
            close = difflib.get_close_matches(name.replace("_", "-"), [k.replace("_", "-") for k in known], n=1,
                                              cutoff=0.75)
            return f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else "")
    try:
        Settings.from_config(load_config(args.ft_cfg_path, environ, cli_overrides(args), log=_SILENT))
    except (ConfigError, SettingsError) as e:
        return str(e)
    if script is not None:
        path = Path(cwd or os.getcwd(), script)
        if not path.is_file():
            return f"the training script {script} does not exist (in {path.parent})"
    return None
