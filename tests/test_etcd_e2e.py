"""Issue 43, etcd for real: ft-launchers on torch's etcd rendezvous backends against a real etcd
(tests/etcd.py: Debian's etcd 3.4, its v2 API, loopback ports, a private folder).

One job per backend carries every fact of a multi-node run on etcd: a launcher SIGKILLed with
its workers is replaced by a new one that joins; a rank then hangs, and the hang exchange and
the roll call between the nodes go through torch's EtcdStore, which has no ``append`` nor
``multi_get``, so through store_board's per-key path (etcd holds the boards' counters and no
index); every output of both nodes names the hung rank; every value ft-monitor wrote in etcd
is an envelope signed with the job secret (read back over etcd's HTTP API and checked with
store_auth's own decoding), bound to its round, with the roll call's evidence sealed; a forged
value written into etcd is ignored, and the job completes.

``etcd-v2`` (torch's dynamic rendezvous over etcd) is the backend etcd users are pointed to;
``etcd`` (torch's older handler) earns its run by what only it does: its store is a bare
EtcdStore per rendezvous version, not a PrefixStore, and it has no round number of its own, so
ft-launcher numbers the rounds itself and a replacement launcher must still agree with the
survivor on the round its messages are bound to.

And the bad input: etcd killed while training runs. Before, the launcher exited 2 ("fix the
command") with ``RendezvousConnectionError: The connection to etcd has failed. See inner
exception for details.`` or ``EtcdConnectionFailed: No more machines in the cluster`` behind
8-30 lines of python-etcd's retries and, under ``etcd``, torch's traceback; now one line names
the store and exit code 6 (STORE_UNREACHABLE, rdzv/store_gone.py) says requeue."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ft_client.store.signed import RESERVED
from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.incident.crossnode import CRASH_COUNT_KEY, HANG_COUNT_KEY, HANG_INDEX_KEY, SHUTDOWN_ACK_KEY
from ft_monitor.launcher.incident.rollcall_wire import ANSWERED_COUNT_KEY, ANSWERED_KEY, ASKERS_KEY, BELL_KEY
from ft_monitor.launcher.rdzv import etcd_state, store_gone
from ft_monitor.launcher.store.step_exchange import STEP_TIMES_INDEX_KEY
from ft_monitor.launcher.store.store_auth import (
    CrashRecord,
    HangRecord,
    RollCallAnswer,
    RollCallRequest,
    RollCallVerdict,
    ShutdownRequest,
    StepTimes,
    StoreChannel,
)
from tests.etcd import Etcd, etcd_server
from tests.launchers import JOB_SECRET, Launcher
from tests.procs import launcher_summary, wait_until

pytestmark = pytest.mark.e2e

RUN = "ft-etcd"
SECRET = JOB_SECRET["FT_JOB_SECRET"].encode()
HUNG = 3
KINDS: dict[str, Any] = {m.KIND: m for m in (ShutdownRequest, HangRecord, StepTimes, RollCallRequest,
                                              RollCallAnswer, CrashRecord, RollCallVerdict)}
COUNTERS = (HANG_COUNT_KEY, CRASH_COUNT_KEY, BELL_KEY, ANSWERED_COUNT_KEY.split("{")[0], SHUTDOWN_ACK_KEY.split("{")[0])
"""Values ft-monitor keeps unsigned on purpose, as on TCPStore: counters (hints of where to
look; store_board.py) and the shutdown acknowledgements, plain numbers."""
INDEXES = (HANG_INDEX_KEY, ASKERS_KEY, ANSWERED_KEY.split("{")[0], STEP_TIMES_INDEX_KEY)
"""The boards' indexes: appended to only where the store has torch's extended API."""
FORGED_SHUTDOWN = json.dumps({"reason": "forged in etcd", "rank": 0, "host": "evil"})
FORGED_HANG = json.dumps({"v": 1, "kind": "hang", "key": "ft_launcher/hang/0", "run": RUN, "mac": "0" * 64,
                          "body": {"rank": 0, "onset_time": 0.0, "message": "forged", "host": "evil"}})


@pytest.fixture
def etcd(workdir: Path) -> Iterator[Etcd]:
    yield from etcd_server(workdir)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def store_values(server: Etcd) -> list[tuple[str, str, bytes]]:
    """(the store's prefix, the key, the value) of everything torch's EtcdStore holds in etcd, as
    etcd serves it: EtcdStore writes ``<its folder>/<base64 of the key>`` with the value in
    base64. ``etcd-v2`` has one folder for every run and round, the round in the key (its
    PrefixStore's ``torch.rendezvous.<run>.<round>/``); ``etcd`` a folder per rendezvous version."""
    out = []
    for path, value in server.keys().items():
        folder, _, name = path.rpartition("/")
        if folder == "/torch/elastic/store":
            prefix, _, key = base64.b64decode(name).decode().partition("/")
        elif folder.endswith("/kv"):
            prefix, key = folder, base64.b64decode(name).decode()
        else:
            continue
        out.append((prefix, key, base64.b64decode(value)))
    return out


def forge(server: Etcd, rounds: int) -> None:
    """What anyone who reaches etcd's port can write: an unsigned workload shutdown and hang
    records with a made-up mac, at the keys of the ``etcd-v2`` rounds the job will have."""
    for r in range(rounds):
        prefix = f"torch.rendezvous.{RUN}.{r}/"
        server.put(f"/torch/elastic/store/{_b64(prefix + 'ft_launcher/shutdown')}", _b64(FORGED_SHUTDOWN))
        for node in range(2):
            server.put(f"/torch/elastic/store/{_b64(prefix + f'ft_launcher/hang/{node}')}", _b64(FORGED_HANG))


def check_signed(values: list[tuple[str, str, bytes]]) -> int:
    """Every value ft-monitor wrote is a signed envelope of this job for its key (store_auth's
    own decoding, with the binding fields the envelope names), bound to its round where the
    key names one; counters and acknowledgements are plain numbers; no index was kept. The
    number of envelopes."""
    signed = 0
    channel: Any = StoreChannel(SECRET, RUN)  # the round is checked below, against the key's
    for prefix, key, raw in values:
        if not key.startswith("ft_launcher/") or raw in (FORGED_SHUTDOWN.encode(), FORGED_HANG.encode()):
            continue
        assert not key.startswith(INDEXES), (key, "an index on a store without append")
        if key.startswith(COUNTERS):
            assert raw.isdigit(), (key, raw)
            continue
        envelope = json.loads(raw)
        bind = {k: v for k, v in envelope.items() if k not in RESERVED}
        channel.decode(key, raw, KINDS[envelope["kind"]], bind)  # raises unless authentic
        if prefix.startswith("torch.rendezvous."):
            assert bind["round"] == int(prefix.rsplit(".", 1)[1]), (prefix, key, bind)
        if envelope["kind"] == RollCallAnswer.KIND:  # the evidence travels sealed: who answered, not what
            assert b"write_metrics_to_stuck_filesystem" not in raw and envelope["body"]["sealed"]
        signed += 1
    return signed


def names_the_hung_rank(node: Launcher, rank: int) -> None:
    """Every output of ``node`` about the hang names ``rank``: the headline line, summary.json's
    hangs and restart, error.json, the diagnosis (this node's, or the one the node that took
    the roll call wrote), the events and the closing summary."""
    out, summary = node.output(), node.summary()
    headlines = [line.split("ft-launcher: ", 1)[1] for line in out.splitlines()
                 if "ERROR ft-launcher: rank " in line and " hung" in line]
    assert len(headlines) == 1 and headlines[0].startswith(f"rank {rank} "), headlines
    assert {h["rank"] for h in summary["hangs"]} == {rank}, summary["hangs"]
    assert [r["rank"] for r in summary["restarts"] if r["cause"] == "hang"] == [rank], summary["restarts"]
    for hang in summary["hangs"]:
        error = json.loads(Path(hang["error_file"]).read_text())["message"]["message"]
        assert error.startswith("RankHang: ") and f"rank {rank}" in error, error
        doc = json.loads(Path(hang["diagnosis"].split(" (on ")[0]).read_text())  # the other node's: " (on host)"
        assert doc["verdict"]["behind"] == [rank] and not doc["missing_ranks"], doc["verdict"]
        assert len(doc["roll_call"]["nodes_answered"]) == 2, doc["roll_call"]  # the other node answered via etcd
    events = [json.loads(line) for line in Path(summary["observability"]["events"]).read_text().splitlines()]
    # a node whose rank only waited for it records that rank, and the culprit as what it was the victim of
    assert {e.get("victim_of", e["rank"]) if e.get("victim_of") is not None else e["rank"]
            for e in events if e["kind"] in ("hang", "diagnosis", "restart") and e.get("cause") != "failure"} == {rank}
    rows = launcher_summary(out)
    assert any(k == "hung rank" and v.startswith(f"rank {rank} ") for k, v in rows), rows


def _kill_tree(node: Launcher) -> None:
    """SIGKILL the launcher and everything it started (its monitors, template and workers), as
    a node that dies takes them all."""
    for pid in node.processes():
        os.kill(pid, signal.SIGKILL)
    node.wait(30)
    wait_until(lambda: node.processes() == [], 30, "the killed node's processes to be gone")


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_two_launchers_on_etcd_a_replaced_node_then_a_hang(workdir: Path, etcd: Etcd, backend: str) -> None:
    go = workdir / "go"
    if backend == "etcd-v2":
        forge(etcd, rounds=4)  # round 0, 1 (the replacement joined), 2 (after the hang), and one more
    # a dead node is declared dead after keep_alive_interval x keep_alive_max_attempt (15 s by default)
    rdzv = ("--nnodes", "2", "--rdzv-backend", backend, "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", RUN,
            "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2")
    # attempt 0: every rank waits after step 3 until `go` exists; rank 3 hangs at step 12 of the
    # round after the replacement, wherever it lands (node A's attempt 1, or the new node's 0), and
    # after a restart starts its process group 2 s late (issue 39)
    train = ("--wait-for", str(go), "--wait-at", "3", "--late-init", f"rank={HUNG},s=2")

    def launcher(name: str, hang_attempt: int | None) -> Launcher:
        hang = ("--hang", f"rank={HUNG},step=12,attempt={hang_attempt}") if hang_attempt is not None else ()
        return Launcher(workdir, "--max-restarts", "3", train_args=(*train, *hang), name=name, env=JOB_SECRET,
                        launcher_flags=rdzv)

    a, b = launcher("nodeA", 1), launcher("nodeB", None)
    nodes = [a, b]
    try:
        wait_until(lambda: all(n.output().count("attempt 0: timeouts in force") == 2 for n in (a, b)), 120,
                   "both nodes' ranks training")
        _kill_tree(b)
        go.touch()  # node A's ranks go on into an all-reduce with node B's dead ones
        # the replacement only once node A has seen its ranks fail: arrived earlier, it is a node
        # waiting to join, and torch restarts A's still-running ranks for it without counting an
        # attempt (seen under the whole suite's load), so the scenario's attempts would differ
        wait_until(lambda: "ft-launcher: attempt 0 failed" in a.output(), 120, "node A's ranks to fail")
        c = launcher("nodeC", 0)
        nodes.append(c)
        assert a.wait() == exit_codes.SUCCESS, a.output()
        assert c.wait() == exit_codes.SUCCESS, c.output()
    finally:
        for node in nodes:
            node.kill()
    both = a.output() + c.output()
    assert "finished 30 steps" in both and "resumed at step 10" in both
    assert [r["cause"] for r in a.summary()["restarts"]] == ["failure", "hang"], a.summary()["restarts"]
    assert len(c.summary()["restarts"]) == 1  # the replacement joined the job, then restarted with it
    for node in (a, c):
        names_the_hung_rank(node, HUNG)
    values = store_values(etcd)
    assert check_signed(values) >= 8  # hang records, step times, a roll call request, answers, a verdict
    keys = {key for _, key, _ in values}
    assert {HANG_COUNT_KEY, BELL_KEY, "ft_launcher/hang/0", "ft_launcher/hang/1"} <= keys, keys
    if backend == "etcd-v2":
        assert "ignored a shutdown message in the rendezvous store" in a.output()
        assert "ignored a shutdown message in the rendezvous store" in c.output()
        assert "workload shutdown requested" not in both


@pytest.mark.parametrize(("backend", "sig"), [("etcd-v2", signal.SIGKILL), ("etcd", signal.SIGTERM)],
                         ids=["etcd-v2-SIGKILL", "etcd-SIGTERM"])
def test_etcd_gone_mid_job_one_line_and_exit_6(workdir: Path, etcd: Etcd, backend: str, sig: signal.Signals) -> None:
    """etcd stopped while the ranks train (killed, or asked to stop: either way its port is
    closed): torch's agent meets it at its next look at the rendezvous. One line names the store
    and the endpoint, exit code 6, within seconds, nothing left running. The two backends fail
    differently (torch's RendezvousConnectionError around python-etcd's error; python-etcd's
    own, and torch's traceback of the failed shutdown)."""
    la = Launcher(workdir, "--max-restarts", "2", train_args=("--steps", "100000"), env=JOB_SECRET,
                  launcher_flags=("--nnodes", "1", "--rdzv-backend", backend, "--rdzv-endpoint", etcd.endpoint,
                                  "--rdzv-id", RUN))
    try:
        wait_until(lambda: la.output().count("attempt 0: timeouts in force") == 2, 120, "the ranks training")
        before = len(la.output())
        t0 = time.monotonic()
        etcd.kill(sig)
        assert la.wait(60) == exit_codes.STORE_UNREACHABLE, la.output()
        took = time.monotonic() - t0
        wait_until(lambda: la.processes() == [], 30, "the launcher's processes to be gone")
    finally:
        la.kill()
    line = f"the rendezvous store (etcd at {etcd.endpoint}, --rdzv-backend {backend}) is unreachable: Connection refused"
    after = la.output()[before:].split("ft-launcher summary:")[0].splitlines()
    said = [x for x in after if x.strip() and not x.startswith("[rank ") and "closing signal SIGTERM" not in x]
    assert len(said) == 1 and said[0].endswith(f"ERROR ft-launcher: {line}"), after
    assert "Traceback" not in la.output()
    assert la.summary()["exit_code"] == exit_codes.STORE_UNREACHABLE and la.summary()["outcome"] == line
    assert ("stopped", line) in launcher_summary(la.output())
    assert took < 30, took  # torch's agent looks at the rendezvous every monitor interval


def test_store_gone_decision() -> None:
    """The pure part: which errors mean the store went away, the line, the code before and after
    the workers started, and which log records only repeat it."""
    class RendezvousConnectionError(Exception):
        pass

    class EtcdConnectionFailed(Exception):
        def __init__(self, message: str, cause: BaseException) -> None:
            super().__init__(message)
            self.cause = cause

    refused = ConnectionRefusedError(111, "Connection refused")
    inner = EtcdConnectionFailed("No more machines in the cluster", cause=refused)
    outer = RendezvousConnectionError("The connection to etcd has failed. See inner exception for details.")
    outer.__cause__ = inner
    for error in (outer, inner):
        got = store_gone.outcome(error, "etcd-v2", "10.0.0.1:2379", started=True)
        assert got == ("the rendezvous store (etcd at 10.0.0.1:2379, --rdzv-backend etcd-v2) is unreachable: "
                       "Connection refused", exit_codes.STORE_UNREACHABLE), got
    bare = store_gone.outcome(RendezvousConnectionError("The connection to the C10d store has failed. See inner "
                                                        "exception for details."), "c10d", "h:29500", started=False)
    assert bare == ("the rendezvous store (c10d at h:29500, --rdzv-backend c10d) is unreachable: The connection to "
                    "the C10d store has failed", exit_codes.LAUNCHER_ERROR), bare
    lost = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")
    lost.__cause__ = RuntimeError("Connection reset by peer\nException raised from recvBytes at ...")
    assert store_gone.outcome(lost, "c10d", "h:29500", started=True) == (
        "the rendezvous store (c10d at h:29500, --rdzv-backend c10d) is unreachable: Connection reset by peer",
        exit_codes.STORE_UNREACHABLE)
    assert store_gone.outcome(RuntimeError("x"), "etcd", "h:1", started=True) is None
    loop = RuntimeError("a cycle")
    loop.__context__ = loop
    assert store_gone.outcome(loop, "etcd", "h:1", started=True) is None  # a cycle in the chain ends
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError  # etcd-v2's, c10d's: a state

    corrupt = RendezvousStateError("The state object is corrupt. See inner exception for details.")
    corrupt.__cause__ = ValueError("Incorrect padding")  # that cannot be parsed, before or after the start
    assert store_gone.outcome(corrupt, "etcd-v2", "h:2379", started=False) == (
        "the rendezvous store (etcd at h:2379, --rdzv-backend etcd-v2) holds a rendezvous state that cannot be "
        "parsed: The state object is corrupt (ValueError: Incorrect padding)", exit_codes.STORE_UNREACHABLE)
    quiet = store_gone.QuietClient()

    def record(name: str, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None,
                                 (type(exc), exc, None) if exc is not None else None)

    assert not quiet.filter(record("torch.distributed.elastic.rendezvous.etcd_rendezvous", "Shutdown failed", inner))
    assert not quiet.filter(record("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "The node 'n' has "
                                   "failed to shutdown the rendezvous 'r' due to an error of type "
                                   "RendezvousConnectionError."))
    assert quiet.filter(record("torch.distributed.elastic.rendezvous.etcd_rendezvous", "Shutdown failed",
                               ValueError("else")))
    retry = record("urllib3.connectionpool", "Retrying (Retry(total=2)) after connection broken")
    assert not quiet.filter(retry) and retry.levelno == logging.DEBUG


def test_the_round_under_torchs_etcd_handler_is_its_rendezvous_version() -> None:
    """The replaced node's bug above, in small: torch's ``etcd`` handler has no round number, so
    ft-launcher counted its own rendezvous (0 on the new node, 1 on the survivor); the version in
    the round's store folder is the same on every node."""
    from types import SimpleNamespace

    from ft_monitor.launcher.rdzv.rounds import rendezvous_round

    classic = SimpleNamespace(_rdzv_impl=object())
    store = SimpleNamespace(prefix="/torchelastic/p2p/run_job/rdzv/v_7/kv/")
    assert rendezvous_round(classic, 0, store) == rendezvous_round(classic, 3, store) == 7
    assert rendezvous_round(classic, 2, SimpleNamespace(prefix="/elsewhere/v_7/kv2/")) == 2
    assert rendezvous_round(classic, 2, SimpleNamespace(prefix=b"/rdzv/v_7/kv")) == 2
    dynamic = SimpleNamespace(_state_holder=SimpleNamespace(state=SimpleNamespace(round=4)))
    assert rendezvous_round(dynamic, 0, store) == 4  # the dynamic handler's own round first


def test_etcd_state_that_cannot_be_parsed_is_one_line_naming_the_key_and_exit_6(workdir: Path, etcd: Etcd) -> None:
    """torch's ``etcd`` handler keeps its rendezvous state as JSON at one key and parses it at
    every look (each monitor tick: ``num_nodes_waiting``; its shutdown: ``set_closed``). That key
    overwritten mid-job with 200,000 ``[`` (json's RecursionError): before, exit 2 ("configuration
    error, not requeued") behind tracebacks naming neither etcd nor the key; now one line names
    the backend, the endpoint and the key, exit 6 (requeue), no traceback on the console."""
    la = Launcher(workdir, "--max-restarts", "2", train_args=("--steps", "100000"), env=JOB_SECRET,
                  launcher_flags=("--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint,
                                  "--rdzv-id", RUN))
    key = f"/torchelastic/p2p/run_{RUN}/rdzv/active_version"
    try:
        wait_until(lambda: la.output().count("attempt 0: timeouts in force") == 2, 120, "the ranks training")
        assert json.loads(etcd.keys(key)[key])["status"] == "final"  # the key the handler parses
        before = len(la.output())
        etcd.put(key, "[" * 200_000)
        assert la.wait(60) == exit_codes.STORE_UNREACHABLE, la.output()
        wait_until(lambda: la.processes() == [], 30, "the launcher's processes to be gone")
    finally:
        la.kill()
    after = la.output()[before:].split("ft-launcher summary:")[0].splitlines()
    said = [x for x in after if x.strip() and not x.startswith("[rank ") and "closing signal SIGTERM" not in x]
    assert len(said) == 1, after
    assert said[0].endswith(f"ERROR ft-launcher: the rendezvous store (etcd at {etcd.endpoint}, --rdzv-backend etcd) "
                            f"holds a rendezvous state that cannot be parsed at {key}: not JSON: nested too deep "
                            "(200000 characters)"), said
    assert "Traceback" not in la.output() and "[[[[" not in la.output()
    line = said[0].split("ERROR ft-launcher: ", 1)[1]
    assert la.summary()["exit_code"] == exit_codes.STORE_UNREACHABLE and la.summary()["outcome"] == line
    assert ("stopped", line) in launcher_summary(la.output())


@pytest.mark.parametrize(("value", "why"), [
    ("[" * 200_000, "not JSON: nested too deep (200000 characters)"),
    ("garbage", "not JSON: Expecting value: line 1 column 1 (char 0) (7 characters)"),
    ("5", "a JSON int, not an object"),
    ('{"status": "final"}', "a final state without a valid 'version'"),
    ('{"status": "final", "version": "3", "participants": [0], "keep_alives": [], "num_workers_waiting": -1}',
     "a final state without a valid 'num_workers_waiting'"),
    ('{"status": "joinable", "version": "3", "participants": ["x"]}', "a joinable state without a valid 'participants'"),
    ('{"status": "open"}', "no status among setup, closed, joinable, frozen, final"),
    ("{" * 10, "not JSON"),
    (" " * (etcd_state.MAX_STATE_BYTES + 1), "characters (at most"),
    (None, "a value of type NoneType, not JSON text"),
])
def test_torchs_etcd_state_is_parsed_or_refused_naming_the_key(value: Any, why: str) -> None:
    """etcd_state.parse_state: what torch's ``etcd`` handler writes is parsed; anything else is
    EtcdStateError naming the key and why (a RendezvousError: torch's rendezvous re-raises it at
    once instead of retrying the same unreadable key until its timeout)."""
    key = f"/torchelastic/p2p/run_{RUN}/rdzv/active_version"
    with pytest.raises(etcd_state.EtcdStateError) as got:
        etcd_state.parse_state(value, key)
    assert got.value.key == key and why in got.value.reason and str(got.value).startswith(f"the rendezvous state at {key}")
    final = {"status": "final", "version": "3", "participants": [0, 1], "keep_alives": ["/k"], "num_workers_waiting": 0}
    for state in ({"status": "setup"}, {"status": "closed"}, final, {**final, "status": "closed"}):
        assert etcd_state.parse_state(json.dumps(state), key) == state
    line, code = store_gone.outcome(got.value, "etcd", "h:2379", started=False) or ("", 0)
    assert code == exit_codes.STORE_UNREACHABLE and line.startswith(
        f"the rendezvous store (etcd at h:2379, --rdzv-backend etcd) holds a rendezvous state that cannot be parsed "
        f"at {key}: ") and "\n" not in line


def test_torchs_etcd_rendezvous_refuses_an_unparsable_state_at_once_and_its_shutdown_log_is_held_back() -> None:
    """torch's own EtcdRendezvous (its barrier and shutdown), its client a stand-in holding garbage:
    before, the barrier retried every second until the rendezvous timeout (600 s by default)."""
    import etcd
    from torch.distributed.elastic.rendezvous.etcd_rendezvous import EtcdRendezvous, EtcdRendezvousHandler

    class Client:
        def write(self, *args: Any, **kwargs: Any) -> Any:
            raise etcd.EtcdAlreadyExist("exists")

        def get(self, key: str) -> Any:
            return type("Result", (), {"value": "[" * 200_000, "etcd_index": 1})()

    impl = EtcdRendezvous.__new__(EtcdRendezvous)
    impl.client, impl._prefix, impl._run_id, impl._timeout = Client(), "/torchelastic/p2p/", RUN, 600
    impl._lease_this_rank_stop = impl._lease_run_id_stop = None
    handler = EtcdRendezvousHandler(impl, None)
    assert etcd_state.guard(handler) and not etcd_state.guard(object())
    t0 = time.monotonic()
    with pytest.raises(etcd_state.EtcdStateError, match="nested too deep"):
        impl.rendezvous_barrier()
    assert time.monotonic() - t0 < 5  # at once: torch's barrier re-raises a RendezvousError
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("torch.distributed.elastic.rendezvous.etcd_rendezvous")
    catch = logging.Handler()
    catch.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(catch)
    try:
        with store_gone.quiet_client("etcd"):
            assert handler.shutdown() is False  # torch logs "Shutdown failed" with its traceback: held back
    finally:
        logger.removeHandler(catch)
    assert not [r for r in records if r.getMessage() == "Shutdown failed"], records
