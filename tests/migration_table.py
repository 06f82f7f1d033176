"""docs/migration.md's name table, generated from docs/migration-names.toml.

`render()` builds the table's markdown from the names file; tests/test_migration.py checks
that docs/migration.md holds exactly that between the markers, and checks the names file
against the code. After editing the names file::

    .venv/bin/python -m tests.migration_table --write
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAMES = ROOT / "docs" / "migration-names.toml"
DOC = ROOT / "docs" / "migration.md"
BEGIN = "<!-- BEGIN NAME TABLE: generated from docs/migration-names.toml by tests/migration_table.py -->"
END = "<!-- END NAME TABLE -->"
STATUSES = ("same", "different", "absent")


def load() -> dict[str, Any]:
    with open(NAMES, "rb") as f:
        return tomllib.load(f)


def rows(data: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(group, row) for every name, in file order."""
    return [(group, row) for group in data["group"] for row in group["name"]]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(data: dict[str, Any]) -> str:
    ref = data["reference"]
    counts = {s: sum(1 for _, r in rows(data) if r["status"] == s) for s in STATUSES}
    lines = [
        BEGIN,
        "",
        f"{sum(counts.values())} names of `{ref['package']}` ({ref['repo']} at "
        f"`{ref['commit'][:12]}`): {counts['same']} the same, {counts['different']} different, "
        f"{counts['absent']} absent.",
    ]
    for group in data["group"]:
        lines += ["", f"### {group['title']}", ""]
        lines += ["| reference | ours | status | how / why |", "|---|---|---|---|"]
        for row in group["name"]:
            name = f"`{row['ref']}{row.get('sig', '')}`"
            if row["status"] == "absent":
                ours = "ignored, with a warning" if group.get("fields") else "—"
            else:
                ours = f"`{row['ours']}`"
            lines.append(f"| {_cell(name)} | {_cell(ours)} | {row['status']} | {_cell(row.get('note', ''))} |")
    lines += ["", END]
    return "\n".join(lines)


def current_table() -> str:
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def write() -> None:
    text = DOC.read_text()
    DOC.write_text(text.replace(current_table(), render(load())))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.migration_table --write")
    write()
