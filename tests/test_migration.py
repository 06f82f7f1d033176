"""Migration from nvidia-resiliency-ext: docs/migration-names.toml against the code, the
table in docs/migration.md against the names file, and a program written for the
reference's API (tests/workers/reference_style_script.py) run against ours."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ft_client import RankMonitorClient, TimeoutsCalc
from ft_monitor import RankMonitorServer
from ft_monitor.config import FIELDS, IGNORED_NVRX_FIELDS
from ft_monitor.core.settings import Settings
from tests import migration_table
from tests.procs import ROOT, WORKERS

ROWS = migration_table.rows(migration_table.load())
SCRIPT = WORKERS / "reference_style_script.py"

# Instance attributes are looked up on an instance made here (nothing is connected or started).
SAMPLES: dict[type, Callable[[], object]] = {
    RankMonitorClient: lambda: RankMonitorClient("/nonexistent/ft.sock"),
    TimeoutsCalc: lambda: TimeoutsCalc(start_time=0.0),
    RankMonitorServer: lambda: RankMonitorServer(Settings(), "/nonexistent/ft.sock"),
}


def row_id(row: dict[str, Any]) -> str:
    return str(row["ref"])


def named(status: str, *, with_sig: bool = False) -> list[dict[str, Any]]:
    return [r for _, r in ROWS if r["status"] == status and (not with_sig or "sig" in r)]


# -- looking names up in our code -----------------------------------------------------------
def member(obj: object, name: str) -> object:
    """``obj.name``, also a pydantic or dataclass field without a class attribute, or an
    attribute an instance gets in __init__; LookupError if there is none."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, type):
        fields = getattr(obj, "model_fields", None)
        if isinstance(fields, dict) and name in fields:
            return fields[name]
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                if f.name == name:
                    return f
        sample = SAMPLES.get(obj)
        if sample is not None and hasattr(sample(), name):
            return getattr(sample(), name)
    raise LookupError(f"{obj!r} has no {name!r}")


def resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = member(obj, name)
        return obj
    raise LookupError(path)


# -- comparing signatures ---------------------------------------------------------------------
_EMPTY = inspect.Parameter.empty


def reference_params(sig: str) -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None]], bool, bool]:
    """(positional [(name, default source)], keyword-only [...], *args?, **kwargs?) of a
    signature written as in the names file."""
    args = ast.parse(f"def f{sig}: pass").body[0].args  # type: ignore[attr-defined]
    positional = [a.arg for a in args.posonlyargs + args.args]
    defaults: list[str | None] = [None] * (len(positional) - len(args.defaults))
    defaults += [ast.unparse(d) for d in args.defaults]
    keyword = [(a.arg, None if d is None else ast.unparse(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return list(zip(positional, defaults)), keyword, args.vararg is not None, args.kwarg is not None


def default_problem(name: str, ref_default: str | None, ours: inspect.Parameter) -> str | None:
    if ref_default is None:
        return None  # required there: anything here accepts the same calls
    if ours.default is _EMPTY:
        return f"{name}: the reference defaults it to {ref_default}, ours has no default"
    try:
        expected = ast.literal_eval(ref_default)
    except ValueError:
        return f"{name}: the reference's default {ref_default} is not a literal; mark the row 'different'"
    if ours.default != expected:
        return f"{name}: the reference defaults it to {ref_default}, ours to {ours.default!r}"
    return None


def signature_problems(sig: str, obj: object) -> list[str]:
    """Why some call that the reference's signature accepts would fail, or mean something
    else, with ours: [] when every such call works the same way."""
    assert callable(obj)
    ours = list(inspect.signature(obj).parameters.values())
    if ours and ours[0].name in ("self", "cls") and "self" not in sig:
        ours = ours[1:]
    positional, keyword, star_args, star_kwargs = reference_params(sig)
    kinds = inspect.Parameter
    ours_positional = [p for p in ours if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in ours}
    problems = []
    for i, (name, ref_default) in enumerate(positional):
        if i >= len(ours_positional) or ours_positional[i].name != name:
            got = ours_positional[i].name if i < len(ours_positional) else "nothing"
            problems.append(f"position {i}: the reference's {name!r}, ours {got!r}")
            continue
        p = ours_positional[i]
        if p.kind is kinds.POSITIONAL_ONLY:
            problems.append(f"{name}: positional-only here, a keyword there")
        problem = default_problem(name, ref_default, p)
        if problem:
            problems.append(problem)
    for p in ours_positional[len(positional):]:
        if p.default is _EMPTY:
            problems.append(f"{p.name}: required here, not a parameter there")
    for name, ref_default in keyword:
        p = by_name.get(name)
        if p is None or p.kind not in (kinds.KEYWORD_ONLY, kinds.POSITIONAL_OR_KEYWORD):
            problems.append(f"{name}: keyword-only there, not a keyword here")
        elif (problem := default_problem(name, ref_default, p)) is not None:
            problems.append(problem)
    for p in ours:
        if p.kind is kinds.KEYWORD_ONLY and p.default is _EMPTY and p.name not in dict(keyword):
            problems.append(f"{p.name}: a required keyword here, not a parameter there")
    if star_args and not any(p.kind is kinds.VAR_POSITIONAL for p in ours):
        problems.append("*args there, not here")
    if star_kwargs and not any(p.kind is kinds.VAR_KEYWORD for p in ours):
        problems.append("**kwargs there, not here")
    return problems


# -- the names file against the code -----------------------------------------------------------
def test_every_row_is_complete() -> None:
    seen = set()
    for group, row in ROWS:
        assert row["status"] in migration_table.STATUSES, row
        assert row["ref"] not in seen, f"{row['ref']} is listed twice"
        seen.add(row["ref"])
        if row["status"] == "absent":
            assert "ours" not in row and row["note"], row
            assert group.get("fields") or row.get("absent_from"), row
        else:
            assert row.get("ours"), row
        if row["status"] == "different":
            assert row["note"], f"{row['ref']}: say how it differs"


@pytest.mark.parametrize("row", [r for _, r in ROWS if r["status"] != "absent"], ids=row_id)
def test_what_we_have_exists(row: dict[str, Any]) -> None:
    resolve(row["ours"])


@pytest.mark.parametrize("row", named("same", with_sig=True), ids=row_id)
def test_same_signature_accepts_every_call_of_the_reference(row: dict[str, Any]) -> None:
    assert signature_problems(row["sig"], resolve(row["ours"])) == []


@pytest.mark.parametrize("row", [r for _, r in ROWS if r["status"] == "absent" and r.get("absent_from")], ids=row_id)
def test_what_is_absent_is_absent(row: dict[str, Any]) -> None:
    name = row["ref"].split(".")[-1]
    for owner in row["absent_from"]:
        with pytest.raises(LookupError):
            member(resolve(owner), name)


def test_reference_config_fields_are_ours_or_ignored_and_same_defaults_match() -> None:
    from ft_monitor.config import FaultToleranceConfig

    fields = [row for group, row in ROWS if group.get("fields")]
    assert len(fields) >= 30
    for row in fields:
        name = row["ref"].split(".")[-1]
        if row["status"] == "absent":
            assert name in IGNORED_NVRX_FIELDS and name not in FIELDS, name
            continue
        assert name in FIELDS, name
        default = FaultToleranceConfig.model_fields[name].default
        ref_default = row["default"]
        expected = signal.Signals[ref_default] if ref_default.startswith("SIG") else ast.literal_eval(ref_default)
        if row["status"] == "same":
            assert default == expected, f"{name}: ours defaults to {default!r}, the reference to {ref_default}"
        else:
            assert default != expected or row["note"], name


def test_the_table_in_docs_is_generated_from_the_names_file() -> None:
    assert migration_table.current_table() == migration_table.render(migration_table.load()), \
        "docs/migration.md is out of date: run .venv/bin/python -m tests.migration_table --write"


# -- the launcher's command line as the reference's users type it --------------------------------
DOTTED = re.compile(r"`((?:ft_client|ft_monitor)(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`")
LOGGER_NAMES = {"ft_monitor.server", "ft_monitor.executor"}
"""Named in docs as loggers (migration.md: logger names are unchanged), not as modules."""


def docs_names() -> list[tuple[str, int, str]]:
    """Every ``ft_client.…`` / ``ft_monitor.…`` name the README and docs/ give in backticks, but
    the old-module column of migration.md's changelog tables (modules that moved away)."""
    found = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        old_table = False
        for n, line in enumerate(md.read_text().splitlines(), 1):
            if line.startswith("| old module"):
                old_table = True
                continue
            old_table = old_table and line.startswith("|")
            text = "|".join(line.split("|")[2:]) if old_table else line
            found += [(md.name, n, m.group(1)) for m in DOTTED.finditer(text) if m.group(1) not in LOGGER_NAMES]
    return found


def test_every_module_and_name_the_docs_give_imports() -> None:
    """Issue 40 moved modules into rooms: every path a page names still imports, through a door
    where the page names the old one (``ft_client.timeouts_calc``), and the changelog lists the rest."""
    names = docs_names()
    assert len(names) > 100, "the docs' names were not found"
    broken = []
    for page, line, name in names:
        try:
            resolve(name)
        except (LookupError, AttributeError, ImportError) as e:
            broken.append(f"{page}:{line} {name}: {e}")
    assert broken == []


def test_ft_launcher_is_also_installed_as_ft_launcher() -> None:
    """The reference's entry point is `ft_launcher`; before, only `ft-launcher` existed."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("ft_launcher") == scripts["ft-launcher"] == "ft_monitor.launcher.main:entrypoint"


@pytest.mark.parametrize("spelling", ["--ft-param-rank-heartbeat-timeout", "--ft_param_rank_heartbeat_timeout"])
def test_ft_launcher_takes_the_references_ft_param_flags(spelling: str) -> None:
    """`--ft-param-<field>` is the reference's older spelling of `--ft-<field>`: the same setting."""
    from ft_monitor.config import cli_overrides
    from ft_monitor.launcher.main import build_parser

    parser = build_parser()
    ours = cli_overrides(parser.parse_args(["--ft-rank-heartbeat-timeout", "12", "train.py"]))
    theirs = cli_overrides(parser.parse_args([spelling, "12", "--ft-param-rank-section-timeouts", "step:5",
                                              "train.py"]))  # before: "unrecognized arguments"
    assert ours == {"rank_heartbeat_timeout": "12"}
    assert theirs == {"rank_heartbeat_timeout": "12", "rank_section_timeouts": "step:5"}
    assert "--ft-param-" not in parser.format_help()  # one spelling in --help


# -- a program written for the reference -------------------------------------------------------
def _import_block() -> tuple[int, int, list[str]]:
    lines = SCRIPT.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if line.startswith("# BEGIN IMPORTS"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# END IMPORTS"))
    return begin, end, lines


def _bound(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_the_reference_style_script_differs_only_in_its_import_block() -> None:
    begin, end, lines = _import_block()
    tree = ast.parse("\n".join(lines))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        elif isinstance(node, ast.Name):
            assert node.id not in ("ft_client", "ft_monitor"), f"line {node.lineno} names our package"
            continue
        else:
            continue
        if any(m.split(".")[0] in ("ft_client", "ft_monitor") for m in modules):
            assert begin < node.lineno - 1 < end, f"line {node.lineno} imports from us outside the import block"
    block = lines[begin + 1:end]
    reference = [line.removeprefix("#").strip() for line in block if line.startswith("#   ")]
    ours = [line for line in block if not line.startswith("#")]
    reference_tree = ast.parse("\n".join(reference))
    assert all(isinstance(n, (ast.Import, ast.ImportFrom)) and (n.module or n.names[0].name).startswith(
        "nvidia_resiliency_ext") for n in reference_tree.body), reference
    assert _bound(reference_tree) == _bound(ast.parse("\n".join(ours)))


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_reference_style_script_runs_against_ours(workdir: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), str(workdir)], capture_output=True, text=True, cwd=ROOT,
                         timeout=170)
    result_lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and result_lines, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    result = json.loads(result_lines[-1].removeprefix("RESULT "))
    assert result == {"ranks": [0, 123], "monitors": [0, 0]}, out.stderr  # rank 1 ended by its monitor
    seen = [json.loads((workdir / f"rank{r}.json").read_text()) for r in (0, 1)]
    for key in ("hb", "sections", "calculated_sections", "out_of_section", "calc"):
        assert seen[0][key] == seen[1][key], key  # the collectives agreed
    s = seen[0]
    assert s["loaded_hb"] == [120.0, 30.0, True] and s["loaded_step"] == 12.0  # the reference's checkpoint
    initial, subsequent, calculated = s["hb"]
    assert calculated and 60 < initial < 120 and 15 < subsequent < 30  # averaged with the loaded values
    assert 6 < s["sections"]["step"] < 12 and s["sections"]["hang"] == 1.0 and s["calculated_sections"] == ["step"]
    assert 20 < s["out_of_section"] < 40
    assert s["calc"] == {"sections": {"one": 1.0, "two": 4.0}, "out_of_section": 11.0,
                         "merged": {"one": 2.0, "two": 4.0}, "merged_out_of_section": 11.0,
                         "hb_merged": [20.5, 14.5]}
    assert s["is_initialized"] is True
    (report,) = (workdir / "reports").glob("rank1-*-hang.json")
    data = json.loads(report.read_text())
    assert (data["section"], data["terminated_by"]) == ("hang", "SIGUSR1")
    assert "rank_main" in Path(data["stack_dump"]).read_text()
