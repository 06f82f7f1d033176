"""The torch versions pyproject.toml admits (issue 51), checked with pip's own resolver:
installed beside a torch of a supported minor, a pre-release or local build included (what
containers ship), ft-monitor leaves it alone; a torch outside the range makes pip want another.

pip runs for real (``install --dry-run --report``) with no index (``--no-index``, nothing is
downloaded) in this test's interpreter, whose other dependencies are installed, beside a fake
installed ``torch`` (a dist-info of the version under test, first on ``PYTHONPATH``, where pip
looks for installed distributions before the environment's own). ft-monitor is a wheel whose
metadata is pyproject.toml's; installing the checkout itself beside torch 2.6.0 and 2.14.1 was
done by hand (docs/launcher.md, "torch versions")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parent.parent

ADMITTED = ["2.6.0", "2.7.1", "2.8.0", "2.9.0a0+abc.nv25.10", "2.10.0", "2.11.0", "2.12.0", "2.13.0+cpu",
            "2.14.1", "2.14.1+cu130", "2.6.0a0+ecf3bae40a.nv25.01"]
"""Every minor 2.6-2.14, as the index serves them and as containers and local builds name them."""
REFUSED = ["2.5.1", "2.5.1+cpu", "2.15.0", "2.15.0a0+abc.nv26.01", "2.15.0.dev20260101"]


def torch_requirement() -> str:
    (spec,) = re.findall(r'"torch([<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())
    return spec


def test_the_specifier_admits_every_supported_minor_and_its_pre_releases_and_local_builds() -> None:
    spec = SpecifierSet(torch_requirement())
    assert [v for v in ADMITTED if not spec.contains(v)] == []  # pre-releases admitted: the bound names one
    assert [v for v in REFUSED if spec.contains(v, prereleases=True)] == []
    assert spec.contains("2.6.0a0+ecf3bae40a.nv25.01") and not spec.contains(Version("2.5.99"))


def _wheel(dest: Path) -> Path:
    """ft-monitor as pip resolves it: a wheel whose metadata is pyproject.toml's [project] (name,
    version, Python, dependencies), made here so that no build backend runs (the environments of
    the compatibility tier have no setuptools new enough, and an isolated build needs the index)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"].replace("-", "_"), project["version"]
    info = f"{name}-{version}.dist-info"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n",
                        f"Requires-Python: {project['requires-python']}\n",
                        *(f"Requires-Dist: {req}\n" for req in project["dependencies"])])
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{info}/METADATA", metadata)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def _fake_torch(site: Path, version: str) -> None:
    """An installed ``torch`` as pip sees one: a dist-info with its name and version."""
    info = site / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _dry_run(tmp_path: Path, torch_version: str) -> subprocess.CompletedProcess[str]:
    wheel = _wheel(tmp_path)
    site = tmp_path / "site"
    _fake_torch(site, torch_version)
    env = {**os.environ, "PYTHONPATH": str(site), "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": "",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CONFIG_FILE": os.devnull}
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--report", str(tmp_path / "report.json"),
           "--quiet", str(wheel)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("torch_version", ["2.9.0a0+abc.nv25.10", "2.6.0", "2.14.1"])
def test_pip_installs_ft_monitor_beside_a_supported_torch_and_keeps_it(tmp_path: Path, torch_version: str) -> None:
    done = _dry_run(tmp_path, torch_version)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    installing = {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}
    assert installing == {"ft-monitor": "0.1.0"}, f"pip would install {installing} beside torch {torch_version}"


def test_pip_wants_another_torch_beside_one_outside_the_range(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "2.15.0a0+abc.nv26.01")  # no index: pip cannot find the torch it wants
    assert done.returncode != 0
    assert "torch" in done.stderr and ("<2.15" in done.stderr or "No matching distribution" in done.stderr), done.stderr
