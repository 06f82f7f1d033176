"""Everything ft reads from a torch.distributed store (no authentication there) is signed,
bound, and parsed by a total parser; and where each signing key comes from (issue 24,
items 1 and 2 and "Secrets").

Parsers: any bytes and any JSON give a value or StoreMessageError, nothing else, for every
launcher message (store_auth) and every in-process record (ft_client/inprocess/store.py).
The in-process store protocol on a HashStore: forged values, counts and replays are refused
and never acted on. Keys: the choice of the in-process key on each path, with fake
environments, and the per-job key file shared by the processes of one job only.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore

from ft_client.inprocess import store as ipstore
from ft_client.inprocess.store import FaultRecord, RestartStore
from ft_client.store import jobkey
from ft_client.store.signed import Signer, StoreMessageError, derive_key
from ft_monitor.launcher.incident.decide import triage_hang
from ft_monitor.launcher.main import max_nodes
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
from tests.test_launcher_decide import KEY, NOW, WORKERS, decide, notice, signed

SECRET = b"s" * 32
LAUNCHER_KINDS = (ShutdownRequest, HangRecord, StepTimes, RollCallRequest, RollCallAnswer, CrashRecord,
                  RollCallVerdict)
NON_ASCII_MAC = json.dumps({"mac": "\u00e9"}).encode()
DEEP = b"[" * (16 * 1024)
"""The review's two values: TypeError from hmac.compare_digest(str, str), RecursionError in json.loads."""

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
"""Any JSON value (NaN and the infinities included: json.loads accepts them)."""

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the launcher's messages: total --------------------------------------------------------


@pytest.mark.parametrize("raw", [NON_ASCII_MAC, DEEP, json.dumps({"mac": "\u00e9" * 64}).encode(),
                                 json.dumps({"mac": 5}).encode(), b"\xff", b"", b"[]", b"nan"],
                         ids=["non-ascii mac", "16 KiB of [", "64 non-ascii", "int mac", "not utf-8", "empty",
                              "a list", "NaN"])
@pytest.mark.parametrize("kind", LAUNCHER_KINDS, ids=lambda k: k.KIND)
def test_a_launcher_message_that_is_not_one_is_refused_with_the_typed_error_only(kind: Any, raw: bytes) -> None:
    # before: TypeError (non-ASCII mac) and RecursionError (deep nesting) escaped decode
    with pytest.raises(StoreMessageError):
        StoreChannel(SECRET, "job-1").decode("k", raw, kind)


@FUZZ
@given(raw=st.binary(max_size=512) | json_values.map(lambda v: json.dumps(v).encode()),
       kind=st.sampled_from(LAUNCHER_KINDS))
def test_any_bytes_or_json_is_a_launcher_message_or_the_typed_refusal(raw: bytes, kind: Any) -> None:
    try:
        StoreChannel(SECRET, "job-1").decode("k", raw, kind)
    except StoreMessageError:
        pass


@FUZZ
@given(body=st.dictionaries(st.sampled_from(["rank", "onset_time", "message", "host", "reason", "section",
                                             "medians", "incident", "hung_rank", "group_rank", "budget_s",
                                             "evidence", "x"]), json_values, max_size=8),
       kind=st.sampled_from(LAUNCHER_KINDS))
def test_any_signed_body_is_a_launcher_message_or_the_typed_refusal(body: dict[str, Any], kind: Any) -> None:
    """Even a body signed with the job's secret is checked field by field (a bug in a
    sender must not crash the reader)."""
    ch = StoreChannel(SECRET, "job-1")
    raw = Signer(SECRET, "job-1").seal(kind.KIND, "k", body)
    try:
        ch.decode("k", raw, kind)
    except StoreMessageError:
        pass


def test_bound_fields_must_match() -> None:
    ch = StoreChannel(SECRET, "job-1")
    raw = ch.encode("k", HangRecord(1, 2.0, "m", "h"), bind={"round": 3})
    assert ch.decode("k", raw, HangRecord, bind={"round": 3}) == HangRecord(1, 2.0, "m", "h")
    for other in ({"round": 4}, {"round": "3"}, {"incident": 3}):
        with pytest.raises(StoreMessageError, match="written for another"):
            ch.decode("k", raw, HangRecord, bind=other)


def test_a_signed_record_replayed_into_a_later_round_is_refused() -> None:
    # issue 38: node 1's signed hang record of round 0, copied into rounds 1-5 and listed on the board, made
    # node 0 decide "rank 1 hung first" in round 1 where rank 0 really hung: the signature bound the key and
    # the run id, which c10d keeps across rounds
    from ft_monitor.launcher.incident.decide import first_hang

    old = StoreChannel(SECRET, "job-1", 0).encode(KEY.format(1), HangRecord(1, NOW - 60.0, "old", "n1"))
    now = StoreChannel(SECRET, "job-1", 1)
    with pytest.raises(StoreMessageError, match="written for another"):
        now.decode(KEY.format(1), old, HangRecord)
    mine = HangRecord(0, NOW - 2.0, "section 'step' open", "n0")
    first, ignored = first_hang(mine, now, {KEY.format(1): old})
    assert first == mine and len(ignored) == 1
    assert now.decode(KEY.format(1), now.encode(KEY.format(1), mine), HangRecord) == mine  # its own round: taken


def test_the_launchers_channel_is_bound_to_the_round_it_joined() -> None:
    from types import SimpleNamespace

    from ft_monitor.launcher.incident.crossnode import NodeMessages

    nodes = NodeMessages(SECRET)
    wg = SimpleNamespace(group_world_size=2, spec=SimpleNamespace(rdzv_handler=SimpleNamespace(get_run_id=lambda: "r")))
    nodes.round = 3
    raw = nodes.channel(wg).encode("k", HangRecord(1, 2.0, "m", "h"))  # type: ignore[arg-type]
    assert StoreChannel(SECRET, "r", 3).decode("k", raw, HangRecord).rank == 1
    with pytest.raises(StoreMessageError):
        StoreChannel(SECRET, "r", 4).decode("k", raw, HangRecord)


def test_a_planted_bad_hang_record_does_not_stop_the_verdict_on_a_real_hang() -> None:
    """The code path that raised at the next real hang (_on_hang -> decide_hang ->
    first_hang -> decode): the bad values are listed as ignored, and a real record beside
    them still counts. Before: TypeError / RecursionError out of decide_hang (exit 2)."""
    peers = {KEY.format(1): NON_ASCII_MAC, KEY.format(2): DEEP,
             **dict([signed(3, HangRecord(3, NOW - 5.0, "first", "node3"))])}
    d = decide(peers=peers)
    assert d.victim_of is not None and d.victim_of.rank == 3
    assert sorted(k for k, _ in d.ignored_records) == [KEY.format(1), KEY.format(2)]
    assert triage_hang(notice(), WORKERS, "node0").act


# -- the in-process records ------------------------------------------------------------------

IP_SIGNER = Signer(b"k" * 32, "local")


def rstore(rank: int = 0, world: int = 2, base: Any = None, prefix: str = "t/", attempt: str = "0",
           signer: Signer = IP_SIGNER) -> RestartStore:
    return RestartStore(HashStore() if base is None else base, world, signer, rank=rank, prefix=prefix,
                        attempt_id=attempt)


@FUZZ
@given(raw=st.binary(max_size=512) | json_values.map(lambda v: json.dumps(v).encode())
       | st.sampled_from([NON_ASCII_MAC, DEEP, b'{"done": true}', b"forged"]))
def test_any_bytes_or_json_is_an_inprocess_record_or_refused(raw: bytes) -> None:
    s = rstore()
    for kind in (ipstore.OUTCOME, ipstore.ARRIVAL, ipstore.ALL_ARRIVED, ipstore.OUTSIDE):
        assert s.open(0, kind, "t/iter/0/outcome", raw) is None
    assert s._outcome_of(0, "t/iter/0/outcome", raw) is None
    assert s._outside_of(0, "t/iter/0/outside", raw) is None


@FUZZ
@given(body=st.dictionaries(st.sampled_from(["done", "reason", "rank", "source", "by", "time", "x"]), json_values,
                            max_size=7))
def test_any_signed_inprocess_body_is_an_outcome_or_refused(body: dict[str, Any]) -> None:
    s = rstore()
    key = "t/iter/0/outcome"
    got = s._outcome_of(0, key, s.seal(0, ipstore.OUTCOME, key, body))
    assert got is None or got is True or isinstance(got, FaultRecord)
    outside = s._outside_of(0, "t/iter/0/outside", s.seal(0, ipstore.OUTSIDE, "t/iter/0/outside", body))
    assert outside is None or isinstance(outside, int)


def test_a_forged_outcome_is_refused_once_and_replaced_by_the_real_fault(caplog: pytest.LogCaptureFixture) -> None:
    # before: b"forged" was a fault of unknown cause (every rank restarted), {"done": true}
    # ended the iteration for every rank that read it, and a real fault could not replace either
    s = rstore()
    for forged in (b"forged", b'{"done": true}', NON_ASCII_MAC):
        s.base.set("t/iter/0/outcome", forged)
        with caplog.at_level(logging.WARNING, "ft_client.inprocess"):
            assert s.outcome(0) is None and s.outcome(0) is None and s.wait_outcome(0, 0.1) is None
        assert sum("ignored a value" in r.getMessage() for r in caplog.records) == 1  # logged once
        caplog.clear()
        real = FaultRecord(f"real after {forged!r}", 1, "exception", 0, 1.0)
        assert s.report(0, real) == (True, real)
        assert s.outcome(0) == real
        s.base.delete_key("t/iter/0/outcome")


def test_a_forged_count_neither_completes_an_iteration_nor_passes_a_barrier() -> None:
    r0, r1 = rstore(0), None
    r0.base.add("t/iter/0/completed", 100)  # the count says everyone is done
    r0.complete(0)
    assert r0.outcome(0) is None  # rank 1 has not completed: no done
    r1 = rstore(1, base=r0.base)
    r1.complete(0)
    assert r0.outcome(0) is True
    r0.base.add("t/iter/1/barrier", 100)
    r0.base.set("t/iter/1/barrier_done", b"1")
    assert r0.barrier(1, "barrier", 0.2) == 1  # forged done refused: one of two arrived
    assert r1.barrier(1, "barrier", 5) is None  # the real last arrival lets both through
    assert r0.barrier(1, "barrier", 5) is None


def test_a_record_replayed_from_another_iteration_attempt_run_or_key_is_refused() -> None:
    s = rstore()
    real = FaultRecord("r", 1, "exception", 1, 1.0)
    s.report(0, real)
    raw = bytes(s.base.get("t/iter/0/outcome"))
    assert s._outcome_of(0, "t/iter/0/outcome", raw) == real
    assert s._outcome_of(1, "t/iter/1/outcome", raw) is None  # another iteration
    assert rstore(attempt="1")._outcome_of(0, "t/iter/0/outcome", raw) is None  # another attempt
    assert rstore(signer=Signer(b"k" * 32, "job-2"))._outcome_of(0, "t/iter/0/outcome", raw) is None  # run
    assert rstore(signer=Signer(b"x" * 32, "local"))._outcome_of(0, "t/iter/0/outcome", raw) is None  # key
    assert s._outcome_of(0, "t/iter/0/outside", raw) is None  # another store key


def test_a_forged_outside_claim_is_not_believed() -> None:
    s = rstore(1)
    s.base.set("t/iter/0/outside", b"7")  # before: rank 7 was named as the rank behind
    assert s.outside(0) is None
    s.claim_outside(0, reporter=False)  # the refused value does not keep a real claim out
    assert s.outside(0) == 1


# -- keys: where each comes from -------------------------------------------------------------


def test_the_inprocess_key_on_each_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    os.chmod(tmp_path, 0o700)
    secret_file = tmp_path / "secret"
    secret_file.write_text("f" * 40)
    os.chmod(secret_file, 0o600)
    one_node = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_PORT": "1234", jobkey.KEY_DIR_ENV: str(tmp_path)}
    two_nodes = {**one_node, "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    # ft-launcher: what it set, derived from the secret (or its own random key) and the run
    launcher = jobkey.launcher_inprocess_key(SECRET, None, "r1")
    assert launcher == derive_key(SECRET, "inprocess", "r1").hex() != jobkey.launcher_inprocess_key(SECRET, None, "r2")
    assert jobkey.launcher_inprocess_key(None, b"L" * 32, "r1") == derive_key(b"L" * 32, "inprocess", "r1").hex()
    assert jobkey.launcher_inprocess_key(None, None, "r1") is None
    got = jobkey.inprocess_key({**two_nodes, jobkey.INPROCESS_KEY_ENV: launcher, "FT_JOB_SECRET": "z" * 20}, "r1")
    assert got.key.hex() == launcher and got.authenticated
    with pytest.raises(jobkey.SecretError, match="64 hex digits"):
        jobkey.inprocess_key({jobkey.INPROCESS_KEY_ENV: "nothex"}, "r1")
    # plain torchrun with a job secret (file or variable): derived from it, never the secret itself
    got = jobkey.inprocess_key({**two_nodes, jobkey.SECRET_FILE_ENV: str(secret_file)}, "r1")
    assert got.key == derive_key(b"f" * 40, "inprocess", "r1") and got.origin == "derived from the job secret"
    # one node, no secret: the per-job key file
    got = jobkey.inprocess_key(one_node, "r1")
    assert got.authenticated and "per-job key file" in got.origin
    assert jobkey.inprocess_key(one_node, "r1") == got
    assert jobkey.inprocess_key({**one_node, "MASTER_PORT": "1236"}, "r1").key != got.key  # another job
    # several nodes, no secret: warned once, naming the fix; typed and bound, not authenticated
    with caplog.at_level(logging.WARNING, "ft_client.store.jobkey"):
        a = jobkey.inprocess_key(two_nodes, "r-multi")
        b = jobkey.inprocess_key(two_nodes, "r-multi")
    assert a == b and not a.authenticated
    assert [r.getMessage().count("FT_JOB_SECRET_FILE") for r in caplog.records] == [1]


def test_single_node_is_read_from_torchruns_variables_or_a_loopback_master() -> None:
    assert jobkey.single_node({})
    assert jobkey.single_node({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.1.1.1"})
    assert not jobkey.single_node({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert jobkey.single_node({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert not jobkey.single_node({"WORLD_SIZE": "2", "MASTER_ADDR": "node-a"})
    assert not jobkey.single_node({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "x"})
    assert max_nodes("1") == 1 and max_nodes("1:4") == 4 and max_nodes("x") is None


def test_the_key_directory_must_be_private(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert jobkey.key_dir({jobkey.KEY_DIR_ENV: str(d)}) == d and (os.stat(d).st_mode & 0o777) == 0o700
    os.chmod(d, 0o755)
    with pytest.raises(jobkey.SecretError, match="mode 0700"):
        jobkey.key_dir({jobkey.KEY_DIR_ENV: str(d)})
    os.chmod(d, 0o700)
    key, path = jobkey.local_job_key(d, "job")
    os.chmod(path, 0o644)
    with pytest.raises(jobkey.SecretError, match="has mode 0644"):
        jobkey.local_job_key(d, "job")


KEY_OF = ("import os, sys; from ft_client.store import jobkey; "
          "print(jobkey.inprocess_key(os.environ, os.environ.get('TORCHELASTIC_RUN_ID', 'local')).key.hex())")


def test_the_processes_of_a_job_share_its_key_and_another_job_has_another(tmp_path: Path) -> None:
    """Four processes started at once (they race to make the key file): the two of job A
    read one key, the two of job B another; none of them could read a key of another user's."""
    os.chmod(tmp_path, 0o700)
    base = {k: v for k, v in os.environ.items() if not k.startswith("FT_")}
    base.update({"PYTHONPATH": str(Path(__file__).resolve().parents[1]), jobkey.KEY_DIR_ENV: str(tmp_path / "k"),
                 "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    jobs = {"A": {"TORCHELASTIC_RUN_ID": "job-a", "MASTER_PORT": "2000"},
            "B": {"TORCHELASTIC_RUN_ID": "job-b", "MASTER_PORT": "2002"}}
    procs = [(name, subprocess.Popen([sys.executable, "-c", KEY_OF], env={**base, **env, "RANK": str(r)},
                                     stdout=subprocess.PIPE, text=True))
             for r in (0, 1) for name, env in jobs.items()]
    keys: dict[str, set[str]] = {"A": set(), "B": set()}
    for name, p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        keys[name].add(out.strip())
    assert len(keys["A"]) == 1 and len(keys["B"]) == 1 and keys["A"] != keys["B"]
    assert len(next(iter(keys["A"]))) == 64
    files = list((tmp_path / "k").iterdir())
    assert len(files) == 2 and all((f.stat().st_mode & 0o777) == 0o600 for f in files)
    assert (os.stat(tmp_path / "k").st_mode & 0o777) == 0o700


def test_step_times_ranks_must_be_ascii_digits() -> None:
    # before: a signed '²' rank passed str.isdigit() and int() raised ValueError in the reader
    raw = Signer(SECRET, "job-1").seal("step_times", "k", {"section": "step", "medians": {"\u00b2": 1.0},
                                                           "host": "h"})
    with pytest.raises(StoreMessageError, match="keyed by rank"):
        StoreChannel(SECRET, "job-1").decode("k", raw, StepTimes)


def test_ft_launcher_gives_workers_a_derived_key_and_neither_form_of_the_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ft_monitor.launcher.agent import agent

    started: list[dict[int, dict[str, str]]] = []
    monkeypatch.setattr(agent._lea, "start_processes", lambda *a, **kw: started.append(kw["envs"]))

    class Ft:
        def worker_env(self, local_rank: int) -> dict[str, str]:
            return {}

        def inprocess_key(self, run_id: str) -> str | None:
            return jobkey.launcher_inprocess_key(SECRET, None, run_id)

    envs = {0: {"TORCHELASTIC_RUN_ID": "r9", "FT_JOB_SECRET": SECRET.decode(), "FT_JOB_SECRET_FILE": "/s"}}
    with agent._worker_env(Ft()):  # type: ignore[arg-type]
        agent._lea.start_processes(envs=envs)
    assert started[0][0] == {"TORCHELASTIC_RUN_ID": "r9",
                             jobkey.INPROCESS_KEY_ENV: derive_key(SECRET, "inprocess", "r9").hex()}
