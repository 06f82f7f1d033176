"""Where the client's log lines go when the training script has not configured logging.

Python prints a library's warnings without any handler as the bare message (its "last
resort"): under torchrun every rank's lines interleave on one terminal and nothing says which
rank spoke. Installed once by the first module that takes a logger here (`logger`: importing
``ft_client`` itself does not load ``logging``), `RankPrefixed` prints the client's
WARNING and above as ``[rank 1] ft_client WARNING: ...`` (the rank from torchrun's ``RANK``)
while the root logger has no handler, and stays silent once the script configures logging
(``logging.basicConfig`` or a handler of its own): the record then goes to the script's
handlers, in the script's format, once.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = "ft_client"


class RankPrefixed(logging.StreamHandler):  # type: ignore[type-arg]
    """The client's last resort, with the rank in front."""

    def __init__(self, rank: str | None) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)
        who = f"[rank {rank}] " if rank else ""
        self.setFormatter(logging.Formatter(f"{who}%(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # the script's logging takes it (the record propagates there)
            return
        self.stream = sys.stderr  # the stderr of the moment (a test's capture, a redirected worker)
        super().emit(record)


def install(environ: dict[str, str] | None = None) -> None:
    """Give the ``ft_client`` logger its `RankPrefixed` handler, once."""
    logger = logging.getLogger(LOGGER)
    if any(isinstance(h, RankPrefixed) for h in logger.handlers):
        return
    rank = (os.environ if environ is None else environ).get("RANK")
    logger.addHandler(RankPrefixed(rank if rank and rank.isdigit() else None))


def logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` for a logger under ``ft_client``, its handler installed."""
    install()
    return logging.getLogger(name)
