"""What a wrapped call leaves behind (issue 24, item 5; issue 39, item 3), with real
processes and gloo on CPU.

Each test runs 2 ranks of tests/workers/inprocess_hygiene.py (or, for the endings of issue
39, tests/workers/inprocess_endings.py): a first wrapped call that ends one way (a result,
an exception, RestartInterrupt out of a hook, RestartLimitError, RestartInterrupt raised by
the function itself, Ctrl-C in the completion wait), the exception kept by the caller as a
program that logs or stores it would, then a check that no ft thread is alive and that the
Wrapper's store port can be listened on again, then a second wrapped call in the same
processes, with a fault in it, that must restart and return.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import zygote
from tests.procs import ROOT, WORKERS, slack

pytestmark = pytest.mark.e2e
WORKER = WORKERS / "inprocess_hygiene.py"
ENDINGS_WORKER = WORKERS / "inprocess_endings.py"
"""The endings that left a watcher thread blocked on the iteration's outcome (issue 39)."""


def _free_ports() -> int:
    """A port with its next two free (MASTER_PORT, the Wrapper's store at + 1, a shared
    store at + 2), in a range and block of its own per xdist worker (test_inprocess.py
    uses 21000-22599)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    base = 24000 + 300 * worker + 150 * (os.getpid() % 2)
    for i in range(50):
        port = base + 3 * ((i + os.getpid()) % 50)
        try:
            with socket.socket() as a, socket.socket() as b, socket.socket() as c:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
                c.bind(("127.0.0.1", port + 2))
            return port
        except OSError:
            continue
    raise AssertionError("no three free consecutive ports")


def run_two_ranks(workdir: Path, worker: Path, name: str, flags: tuple[str, ...], port: int, timeout: float,
                  env: dict[str, str] | None = None) -> list[str]:
    """Ranks 0 and 1 of ``worker`` (gloo through MASTER_PORT ``port``), run to their end within
    ``timeout`` seconds (then killed); their outputs. Both must exit 0."""
    procs, logs = [], []
    for r in (0, 1):
        log = workdir / f"{name}-rank{r}.log"
        rank_env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), **(env or {})}
        with open(log, "w") as out:
            procs.append(zygote.popen([sys.executable, str(worker), name, *flags], env=rank_env, cwd=ROOT,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    try:
        for p in procs:
            p.wait(timeout * slack())
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
    outs = [log.read_text(errors="replace") for log in logs]
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}:\n" + "\n---\n".join(o[-3000:] for o in outs)
    return outs


def _run_job(workdir: Path, ending: str, *flags: str) -> list[str]:
    return run_two_ranks(workdir, ENDINGS_WORKER if ending in ENDINGS else WORKER, ending, flags, _free_ports(), 90)


ENDED: dict[str, str | tuple[str, str]] = {
    "result": r"first returned: first done in iteration 0",
    "exception": r"first ended: HealthCheckError: ",
    "interrupt": r"first ended: RestartInterrupt: interrupted while finalizing",
    "limit": r"first ended: RestartLimitError: rank \d: max_iterations = 0",
}
"""How the first call ends (on every rank, or on rank 0 and rank 1)."""
ENDINGS: dict[str, str | tuple[str, str]] = {
    "own_interrupt": r"first ended: RestartLimitError: rank \d: max_iterations = 1 in-process restarts used; last "
                     r"fault: rank \d: RestartInterrupt raised by the training function: raised by the function in "
                     r"iteration 1 \(test\)",
    "ctrl_c": (r"first ended: KeyboardInterrupt", r"first ended: (InProcessError|BarrierTimeoutError): "),
}
ENDED.update(ENDINGS)


def _check_clean(outs: list[str], ending: str) -> None:
    for r, out in enumerate(outs):
        ended = ENDED[ending]
        assert re.search(f"rank {r} " + (ended if isinstance(ended, str) else ended[r]), out), out[-3000:]
        assert f"rank {r} ft threads: []" in out, out[-3000:]
        assert f"rank {r} second returned: second done in iteration 1" in out, out[-3000:]
    assert "rank 0 store port free" in outs[0], outs[0][-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ending", ["exception", "interrupt", "limit", "own_interrupt", "ctrl_c"])
def test_after_any_ending_no_thread_is_left_the_port_is_free_and_a_second_call_works(
        workdir: Path, ending: str) -> None:
    """The Wrapper's own store (rank 0 hosts it at MASTER_PORT + 1): on main, the kept
    exception's frames held the store, so its port stayed bound (EADDRINUSE in the second
    call). ``own_interrupt`` and ``ctrl_c`` (issue 39): the iteration ended with no outcome in
    the store (the function's own RestartInterrupt was taken for the Wrapper's; Ctrl-C came
    in the completion wait), so each iteration's watcher stayed blocked on it: after a 10 s
    join each, ``the in-process ft-inprocess-watch thread is stuck; going on without it``, and
    the threads were alive after the call."""
    outs = _run_job(workdir, ending)
    _check_clean(outs, ending)
    for out in outs:
        assert "is stuck; going on without it" not in out, out[-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ending", ["result", "limit"])
def test_a_second_call_on_a_store_that_outlives_the_first_uses_keys_of_its_own(workdir: Path, ending: str) -> None:
    """A store that outlives the call (torchrun's agent store): on main the second call read
    the first call's keys (iteration 0 already ``done``), dropped its fault and hung."""
    _check_clean(_run_job(workdir, ending, "--shared-store"), ending)


REFUSAL = textwrap.dedent("""
    import torch.distributed as dist
    from ft_client.errors import FtError
    from ft_client.inprocess import Wrapper

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ran = []

    @Wrapper()
    def train(call):
        ran.append(call.iteration)

    try:
        train()
    except ValueError as e:
        print("refused", type(e).__name__, isinstance(e, FtError), ran, e)
    else:
        print("ran", ran)
""")


def test_a_wrapper_refuses_an_already_initialised_torch_distributed() -> None:
    """The reference raises ValueError; ours is an FtError too (main ran the function)."""
    done = subprocess.run([sys.executable, "-c", REFUSAL], cwd=ROOT, capture_output=True, text=True,
                          timeout=60 * slack(), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("refused DistributedInitializedError True [] "), done.stdout + done.stderr[-2000:]
    assert "torch.distributed is already initialized" in done.stdout
