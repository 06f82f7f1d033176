"""Cross-rank MAX of observation vectors: 4 real gloo processes, and the no-process-group path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ft_client.learning.sync import device_type_for_backend, max_across_ranks
from tests import zygote

REPO = Path(__file__).resolve().parents[1]
WORLD = 4

RANK = str(REPO / "tests" / "workers" / "sync_rank.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    return env


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_four_gloo_ranks_agree_on_elementwise_max(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        zygote.popen(
            [sys.executable, RANK, str(rank), str(WORLD), init],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=tmp_path,
        )
        for rank in range(WORLD)
    ]
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    expected = [3.0, 10.0, 5.5, -1.0, 1e6 + 3e-9]  # float64: the 3e-9 survives
    assert results == [expected] * WORLD


@pytest.mark.compat
def test_without_process_group_values_are_returned_unchanged() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch may warn on import (e.g. numpy missing)
        import torch.distributed as dist
    assert not dist.is_initialized()
    values = [1.0, -1.0, 2.5]
    result = max_across_ranks(values)
    assert result == values
    assert result is not values


@pytest.mark.compat
@pytest.mark.timeout(60)
def test_torch_is_not_imported_when_never_used() -> None:
    code = (
        "import sys; from ft_client.learning.sync import max_across_ranks; "
        "assert max_across_ranks([1.0, -1.0]) == [1.0, -1.0]; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=50)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.compat
@pytest.mark.parametrize(
    ("backend", "device"),
    [
        ("gloo", "cpu"),
        ("cpu:gloo,cuda:nccl", "cpu"),
        ("cuda:nccl,cpu:gloo", "cpu"),
        ("nccl", "cuda"),
        ("cuda:nccl", "cuda"),
        ("mpi", "cpu"),
        ("ucc", "cpu"),
        ("xccl", "accelerator"),
    ],
)
def test_device_for_backend(backend: str, device: str) -> None:
    assert device_type_for_backend(backend) == device
