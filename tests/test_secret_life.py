"""Issue 49, "the secret has one life": a real worker under a real ft-launcher, run as the job's
user without privilege (where the tests run as root: root without CAP_SYS_PTRACE, dropped from
the job's bounding set with `setpriv`; with it, root reads every process's memory), tries
every way that user's processes have to the job secret (tests/workers/secret_probe.py): the
launcher's environment block and memory, the environment of the process that started it (as
the Slurm recipe's ``srun ... bash -c`` wrapper), the file $FT_JOB_SECRET_FILE named, and its
own environment and memory. None may yield it; every worker stays dumpable (the roll call
takes its stacks with py-spy).

Two runs, each checking every fact once: the secret handed over in a file made for this
launch ($FT_JOB_SECRET_FILE_ONCE=1, as the Slurm recipe does) with workers that are new
interpreters, started by a bash wrapper that keeps the file's name in its environment; and
the secret in $FT_JOB_SECRET with workers forked from the launcher's worker template (a fork
of the launcher: it held what the launcher held).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ft_client.store.signed import derive_key
from ft_monitor.launcher import exit_codes
from tests.launchers import FT_FLAGS, launcher_argv
from tests.procs import ROOT, slack

pytestmark = pytest.mark.e2e

SECRET = "one-life-" + "5f3c9a0e7d21b4c6" * 3
PROBE = str(ROOT / "tests" / "workers" / "secret_probe.py")


def run_job(tmp_path: Path, *, warm: bool) -> tuple[str, list[dict[str, Any]], Path]:
    """One launcher with 2 probe workers, run as this user without CAP_SYS_PTRACE; its output, the
    probes' results and the secret file's path."""
    work = tmp_path / ("warm" if warm else "cold")
    private = work / "private"
    private.mkdir(parents=True)
    private.chmod(0o700)
    secret_file = private / "secret.0"
    if not warm:
        secret_file.write_text(SECRET + "\n")
        secret_file.chmod(0o600)
    argv = launcher_argv("--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                         "--log-dir", str(work / "logs"), "--ft-summary-json", str(work / "summary.json"), *FT_FLAGS,
                         *(("--ft-warm-start",) if warm else ()), PROBE, SECRET[::-1], str(secret_file))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_JOB_SECRET", "PYTEST", "FT_TEST"))}
    env["HOME"] = str(work)
    if warm:  # the secret itself, in the launcher's environment
        env["FT_JOB_SECRET"] = SECRET
        cmd = argv
    else:  # a wrapper that lives for the whole run, the file's name in its environment (the worst case)
        env.update(FT_JOB_SECRET_FILE=str(secret_file), FT_JOB_SECRET_FILE_ONCE="1")
        cmd = ["bash", "-c", '"$@"; rc=$?; exit "$rc"', "wrapper", *argv]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set=-sys_ptrace", *cmd]  # the job's own user, without root's override
    out = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=240 * slack())
    assert out.returncode == exit_codes.SUCCESS, out.stdout
    probes = [json.loads(m) for m in re.findall(r"secret-probe (\{.*\})", out.stdout)]
    assert sorted(p["rank"] for p in probes) == ["0", "1"], out.stdout
    return out.stdout, probes, secret_file


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="as root, needs setpriv")
@pytest.mark.parametrize("warm", [False, True], ids=["file-once-cold", "env-forked"])
def test_no_process_of_the_job_reaches_the_secret(tmp_path: Path, warm: bool) -> None:
    # before: the wrapper's environment named the file and the worker read the secret from it; the
    # launcher's memory held copies that a worker of the same user read through /proc/PID/mem (the
    # launcher was dumpable); a worker forked from the template found the secret in the launcher's
    # module it inherited (`secret_env._taken`) and in `posix.environ`
    output, probes, secret_file = run_job(tmp_path, warm=warm)
    for probe in probes:
        mine = probe["own"]
        assert not (mine["environ"] or mine["posix_environ"] or mine["block"] or mine["launcher_module"]), probe
        assert mine["forked"] is warm, probe  # the warm run's workers are forks of the launcher's template
        assert mine["dumpable"] == 1, probe
        assert mine["key"] == derive_key(SECRET.encode(), "inprocess", mine["run"]).hex(), probe  # the secret was used
    (rank0,) = [p for p in probes if p["rank"] == "0"]
    launcher = rank0["launcher_environ"]
    # non-dumpable: another uid, or this one without privilege, reads neither its memory nor (as non-root) its
    # environment block; root without CAP_SYS_PTRACE still reads the block, where the secret is overwritten
    assert launcher["read"] in ("ok", "PermissionError") and not launcher["secret"], rank0
    assert launcher["read"] == "PermissionError" or os.geteuid() == 0, rank0
    assert rank0["launcher_mem"] == {"read": "PermissionError", "copies": 0}, rank0
    if not warm:
        parent = rank0["parent_environ"]
        assert parent["read"] == "ok" and parent["file_named"] and not parent["secret"], rank0
        assert parent["file"] == "FileNotFoundError", rank0  # removed once read, before any worker started
    assert rank0["secret_file"] == "FileNotFoundError", rank0
    assert not secret_file.exists()
    assert SECRET not in output
