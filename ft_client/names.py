"""The section-name rule, written once: the wire, the timeouts map, the config and
the settings all check names with `section_name_problem`."""

from __future__ import annotations

MAX_SECTION_NAME_BYTES = 256
"""Longest section name, in UTF-8 bytes."""


def section_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a section name, or None if it can: a non-empty string of
    valid UTF-8 text, at most MAX_SECTION_NAME_BYTES bytes."""
    if not isinstance(name, str):
        return f"section name must be a string, got {type(name).__name__}"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"section name {name[:40]!r} is not valid UTF-8 text"
    if not 0 < size <= MAX_SECTION_NAME_BYTES:
        return f"section name must be 1..{MAX_SECTION_NAME_BYTES} bytes of UTF-8, got {size} bytes"
    return None
