"""The torch versions pyproject.toml admits (issue 51), checked with pip's own resolver:
installed beside a torch of a supported minor, a pre-release or local build included (what
containers ship), ft-monitor leaves it alone; a torch outside the range makes pip want another.

pip runs for real (``install --dry-run --report``) with no index (``--no-index``, nothing is
downloaded) in this test's interpreter, whose other dependencies are installed, beside a fake
installed ``torch`` (a dist-info of the version under test, first on ``PYTHONPATH``, where pip
looks for installed distributions before the environment's own)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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


def _project_copy(dest: Path) -> Path:
    """What pip needs to read ft-monitor's metadata (pyproject.toml, the readme, the packages'
    names), outside the checkout, so that building metadata writes nothing into it."""
    dest.mkdir()
    shutil.copy(ROOT / "pyproject.toml", dest)
    shutil.copy(ROOT / "README.md", dest)
    for package in ("ft_client", "ft_monitor"):
        (dest / package).mkdir()
        (dest / package / "__init__.py").write_text("")
    return dest


def _fake_torch(site: Path, version: str) -> None:
    """An installed ``torch`` as pip sees one: a dist-info with its name and version."""
    info = site / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _dry_run(tmp_path: Path, torch_version: str) -> subprocess.CompletedProcess[str]:
    project = _project_copy(tmp_path / "project")
    site = tmp_path / "site"
    _fake_torch(site, torch_version)
    env = {**os.environ, "PYTHONPATH": str(site), "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": "",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CONFIG_FILE": os.devnull}
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
           "--report", str(tmp_path / "report.json"), "--quiet", str(project)]
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
