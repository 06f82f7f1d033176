"""Errors raised by the client SDK."""

from __future__ import annotations


class FtError(Exception):
    """The base of every exception ft_client and ft_monitor raise."""


class RankMonitorClientError(FtError):
    """The client cannot do what was asked: not connected, bad use, daemon gone."""
