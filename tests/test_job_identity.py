"""job_identity: the identity a job's launchers agree on through a real TCPStore where torch's
run id is the default ``none`` (every static job's was: the report merged two jobs)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft_monitor.launcher.store import job_identity
from tests.procs import free_port


def test_the_launchers_agree_through_the_store_and_a_new_store_keeps_the_identity() -> None:
    from torch.distributed import TCPStore

    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    other = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    first = job_identity.agree(host, job_identity.proposal())
    assert job_identity.agree(other, job_identity.proposal()) == first  # the second node takes the first's
    assert job_identity.run_id("none", first) == f"none-{first}" and job_identity.run_id("job7", first) == "job7"
    fresh = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))  # a later attempt's
    assert job_identity.agree(fresh, first) == first  # proposed again by a launcher that knows it
    another_job = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))
    assert job_identity.agree(another_job, job_identity.proposal()) != first
    forged = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))
    forged.set(job_identity.KEY, "<script>")  # not one of ours: the launcher keeps its own
    assert job_identity.agree(forged, first) == first


@given(st.binary(max_size=64) | st.text(max_size=64) | st.integers() | st.none())
def test_parse_never_raises(raw: object) -> None:
    got = job_identity.parse(raw)
    assert got is None or (len(got) == 16 and set(got) <= set("0123456789abcdef"))


@pytest.mark.parametrize("raw", [b"0123456789abcdef", bytearray(b"fedcba9876543210")])
def test_parse_takes_an_identity(raw: bytes) -> None:
    assert job_identity.parse(raw) == bytes(raw).decode()
