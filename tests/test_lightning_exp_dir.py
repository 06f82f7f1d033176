"""Security round 4: the Lightning callbacks' ``exp_dir`` file under the shared-folder rule, in a
real Lightning ``fit`` (one process, CPU) whose rank talks to a real monitor daemon running in a
thread of the test (tests/test_client_states.py's `ThreadDaemon`: its process operations are
recorded, nothing is signalled). The launcher's own runs are tests/test_lightning_e2e.py.

One test, three fits, every fact checked on them: another user's file with learned heartbeat
timeouts of 1e308 is ignored with one warning and a stopped heartbeat is still caught at the
configured timeout; a symlink planted at the file's name is replaced by rank 0's write, its
target untouched; a file of the job's user that is not JSON costs one warning and the fit
finishes (before: the foreign file was put in force, the write went through the link, and
``setup`` raised JSONDecodeError)."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ft_client.env import RANK_MONITOR_SOCKET
from ft_client.integrations import lightning as ftl
from tests.procs import short_tmpdir, wait_until
from tests.test_client_states import ThreadDaemon

L = pytest.importorskip("lightning.pytorch")
pytestmark = [  # srun on PATH, few data-loader workers: advice for real jobs; Lightning's use of torch's pytree
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
]

OTHER_UID = 65534
HEARTBEAT_TIMEOUT = 2.0
CONFIG = {"initial_rank_heartbeat_timeout": 60.0, "rank_heartbeat_timeout": HEARTBEAT_TIMEOUT,
          "rank_section_timeouts": {}, "rank_out_of_section_timeout": None, "min_learned_timeout": 0.5}
OFF = {"format_version": 1, "timeouts": {"initial_rank_heartbeat_timeout": 1e308, "rank_heartbeat_timeout": 1e308,
                                         "learned": ["initial_rank_heartbeat_timeout", "rank_heartbeat_timeout"]}}
"""The planted file: learned heartbeat timeouts that switch detection off."""


class Model(L.LightningModule):  # type: ignore[misc,name-defined]
    """A linear layer; ``stall`` is called in the training step of batch ``stall_at``."""

    def __init__(self, stall_at: int = -1, stall: Any = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.stall_at, self.stall = stall_at, stall

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.stall_at:
            self.stall()
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)


def _fit(cb: ftl.FtCallback, model: Any, steps: int) -> Any:
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(model)
    return trainer


def _warnings(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root (chown)")
def test_a_foreign_linked_or_broken_exp_dir_file_is_ignored_with_one_warning_and_the_fit_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    sock_dir = short_tmpdir()
    d = ThreadDaemon(sock_dir / "m.sock", **CONFIG)
    monkeypatch.setenv(RANK_MONITOR_SOCKET, str(sock_dir / "m.sock"))
    caplog.set_level(logging.WARNING)
    try:
        # 1. a shared exp_dir (1777, the job user's): another user's file turning detection off
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        planted = shared / ftl.TIMEOUTS_FILENAME
        planted.write_text(json.dumps(OFF))
        os.chown(planted, OTHER_UID, OTHER_UID)
        caught: dict[str, float] = {}

        def stop_beating() -> None:  # a step that stops heartbeating until the monitor calls it a hang
            t0 = time.monotonic()
            assert d.daemon is not None
            wait_until(lambda: d.daemon.hangs, 30, "the monitor to catch the stopped heartbeat")  # type: ignore[union-attr]
            caught["after"] = time.monotonic() - t0

        cb = ftl.FtCallback(exp_dir=shared)
        _fit(cb, Model(stall_at=3, stall=stop_beating), steps=5)
        (warning,) = _warnings(caplog, planted)
        assert f"ignoring {planted}: {planted} belongs to uid {OTHER_UID}" in warning, warning
        assert d.daemon is not None
        (hang,) = d.daemon.hangs
        assert "heartbeat" in hang.message, hang.message
        assert HEARTBEAT_TIMEOUT <= caught["after"] < 30.0  # the configured 2 s, not 1e308
        written = json.loads(planted.read_text())  # rank 0's write replaced the other user's file
        assert os.stat(planted).st_uid == os.geteuid() and written["format_version"] == 1
        assert written["timeouts"]["rank_heartbeat_timeout"] <= 7 * 24 * 3600

        # 2. a symlink at the file's name, to a 0600 file of the job's user
        linked = tmp_path / "linked"
        linked.mkdir(mode=0o700)
        victim = tmp_path / "victim"
        victim.write_bytes(b"the job user's own file\n")
        victim.chmod(0o600)
        (linked / ftl.TIMEOUTS_FILENAME).symlink_to(victim)
        caplog.clear()
        _fit(ftl.FtCallback(exp_dir=linked), Model(), steps=3)
        assert victim.read_bytes() == b"the job user's own file\n"
        mode = os.lstat(linked / ftl.TIMEOUTS_FILENAME).st_mode
        assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600  # replaced by a file of ours
        (warning,) = _warnings(caplog, linked / ftl.TIMEOUTS_FILENAME)
        assert "is a symbolic link; refusing to follow it" in warning

        # 3. the job user's own file that is not JSON; the reference's name and class
        broken_dir = tmp_path / "broken"
        broken_dir.mkdir(mode=0o700)
        broken = broken_dir / ftl.FaultToleranceCallback.TIMEOUTS_FILENAME
        broken.write_text("{not json")
        broken.chmod(0o600)
        caplog.clear()
        trainer = _fit(ftl.FaultToleranceCallback(autoresume=False, calculate_timeouts=True, exp_dir=broken_dir),
                       Model(), steps=3)
        assert trainer.global_step == 3
        (warning,) = _warnings(caplog, broken)
        assert f"ignoring {broken}: {broken} is not JSON" in warning
    finally:
        d.stop()
