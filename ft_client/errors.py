"""Errors raised by the client SDK."""

from __future__ import annotations


class RankMonitorClientError(Exception):
    """The client cannot do what was asked: not connected, bad use, daemon gone."""
