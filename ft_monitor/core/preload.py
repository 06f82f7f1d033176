"""What the worker template preloads (``--ft-preload``), decided from text: pure.

`parse_preload` reads the flag; `modules_from_file` reads what a worker wrote (untrusted:
any bytes give a list, possibly empty)."""

from __future__ import annotations

import json

from ft_client.errors import FtError

MAX_MODULES = 20000
"""The most module names read from one worker's file."""


class PreloadError(FtError, ValueError):
    """``--ft-preload`` names something that is not a module."""


def parse_preload(text: str | None) -> tuple[list[str], bool]:
    """(modules, auto) from ``--ft-preload`` (comma-separated names, or ``auto``); torch always."""
    if text is None or not text.strip():
        return ["torch"], False
    names = [n.strip() for n in text.split(",") if n.strip()]
    auto = "auto" in names
    names = [n for n in names if n != "auto"]
    for n in names:
        if not all(part.isidentifier() for part in n.split(".")):
            raise PreloadError(f"--ft-preload: {n!r} is not a module name")
    return (["torch"] + [n for n in names if n != "torch"]), auto


def modules_from_file(raw: str | bytes) -> list[str]:
    """The module names a worker wrote (a JSON list of dotted names); [] for anything else."""
    try:
        names = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names[:MAX_MODULES]
            if isinstance(n, str) and len(n) < 256 and all(p.isidentifier() for p in n.split("."))]
