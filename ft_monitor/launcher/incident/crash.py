"""The root of a crash, decided once: which failed rank failed first on its own, and which
failed only because of it.

torch reports every worker that failed in an attempt at once. A rank killed from outside (the
OOM killer, ``kill -9``, a segfault in an extension) never raises; its peers' collectives then
fail ("Connection reset by peer", NCCL's remote-exit error) and they raise, often before torch
sees the killed one gone. So the first rank that raised is not the root. The rule:

- a **victim** failed because of another rank: its error is a communication failure caused by a
  peer's death or by the store going away (`peer_failure`), or it was stopped with SIGTERM;
- of the others, the **root** is the one whose fault came first: when it raised (its monitor's
  EXITING), or when its process went (its monitor's connection closed) for a rank that never
  raised; a rank whose time is not known comes after those whose time is; among those, a death
  by signal before an exit without an exception before an exception before a SIGABRT (which
  a rank often dies of in its own teardown once a peer is gone);
- when every failed rank is a victim, the root is not here: the message says it is on another
  node or unknown, and lists the ranks here as what they are, ranks that lost a peer
  (`CrashVerdict.root_seen` False; `root` is then the earliest of them, for ordering only, and
  no output names it as the root). The agent then looks for another node's crash record
  (`on_another_node`), which names the root.

Pure: it takes what torch and the monitors said and returns the verdict that the restart line,
the summary, summary.json, error.json, the events and the report page all take.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass

from ft_client.errors import FtError
from ft_monitor.launcher.exit_codes import how

PEER_FAILURES = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "connectfullmesh failed",
    "remote process exited",
    "ncclremoteerror",
    "network error",
    "communicator was aborted",
    "watchdog caught collective operation timeout",
    "timed out waiting",
    "distnetworkerror",
    "diststoreerror",
    "failed to recv",
    "socket timeout",
    "process group was aborted",
)
"""Lowercase parts of the errors a rank gets when a peer (or the store) is gone: gloo's pair
errors, NCCL's remote-exit and watchdog errors, torch's store errors."""

UNSEEN = "the root of the failure is on another node or unknown"
"""What a node whose failed ranks all lost a peer says of the root, until another node's record names it."""


class CrashError(FtError, ValueError):
    """`decide_crash` asked about no failed rank at all (a caller's bug)."""


VICTIM, SIGNAL, EXIT, RAISED = "victim", "signal", "exit", "raised"
_PRIORITY = {SIGNAL: 0, EXIT: 1, RAISED: 2, VICTIM: 4}
_ABORT_PRIORITY = 3
"""Where neither time is known, SIGABRT comes after an exception: a rank whose peer died often
aborts in its own teardown (a communication thread's std::terminate, NCCL's watchdog)."""


def peer_failure(error: str) -> bool:
    """Whether ``error`` (an exception's text) is a communication failure caused by a peer."""
    text = error.lower()
    return any(p in text for p in PEER_FAILURES)


@dataclass(frozen=True, slots=True)
class FailedRank:
    """One failed worker, as torch and its monitor saw it."""

    rank: int
    pid: int
    exitcode: int
    error: str | None = None
    """What it raised (its EXITING reason or its error file's message); None: it raised nothing."""
    raised_at: float | None = None
    """When it said it was exiting with ``error`` (the host's monotonic clock)."""
    gone_at: float | None = None
    """When its monitor saw its process go (the same clock)."""
    timestamp: float = 0.0
    """torch's: its error file's, else when torch saw it failed."""

    @property
    def kind(self) -> str:
        """victim, signal (killed by a signal other than SIGTERM), exit (exited without an
        exception) or raised."""
        if self.error is not None and peer_failure(self.error):
            return VICTIM
        if self.exitcode == -signal.SIGTERM:
            return VICTIM
        if self.error is not None:
            return RAISED
        return SIGNAL if self.exitcode < 0 else EXIT

    @property
    def at(self) -> float | None:
        """When its fault happened: when it raised, else when it went."""
        return self.raised_at if self.error is not None and self.raised_at is not None else self.gone_at

    def describe(self) -> str:
        raised = f"raised {clip(self.error, MAX_ERROR)} and " if self.error else ""
        return f"rank {self.rank} (pid {self.pid}) {raised}{how(self.exitcode)}"


MAX_ERROR = 200
"""The characters of a rank's exception text a verdict quotes (its error file has it whole)."""


def clip(text: str, limit: int) -> str:
    """``text``, or its first words within ``limit`` characters and an ellipsis: never a word
    cut in two ("Check the logs o and was killed by SIGTERM")."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:.") + "…"


@dataclass(frozen=True, slots=True)
class CrashVerdict:
    root: int
    """The root; where every failed rank is a victim (``root_seen`` False), the earliest of them,
    which is not the root and is named as none (`named`)."""
    root_seen: bool
    """False: every failed rank here failed because of a peer (the root is elsewhere or unseen)."""
    how: str
    """How the rank named ended (`FailedRank.describe`)."""
    victims: tuple[int, ...]
    """The ranks that failed because of another, earliest first."""
    others: tuple[int, ...]
    """Other ranks that failed on their own after the root, earliest first."""
    others_how: str
    """How the others ended, earliest first ("" when none)."""
    victims_how: str
    """How the victims ended, earliest first ("" when none)."""
    message: str
    """The one line every output takes."""
    host: str | None = None
    """The root's host when it was on another node (that node's crash record), else None."""
    raised: bool = False
    """The root raised an exception (its error file, where it wrote one, has the traceback)."""

    @property
    def named(self) -> int | None:
        """The root as the outputs name it: None where it was not seen (on another node, or unknown)."""
        return self.root if self.root_seen else None

    def row(self) -> dict[str, object]:
        """The fields a failure's summary row, its event and its report entry take."""
        return {"root_seen": self.root_seen, "how": self.how, "victims": list(self.victims),
                "others": list(self.others), "others_how": self.others_how, "victims_how": self.victims_how,
                "root_host": self.host}


def decide_crash(failed: Iterable[FailedRank]) -> CrashVerdict:
    """The verdict on one failed attempt's ranks (this node's): the root, then the ranks that
    failed on their own after it, then the victims (the rule is the module's)."""
    ranks = list(failed)
    if not ranks:
        raise CrashError("decide_crash needs at least one failed rank")

    def key(f: FailedRank) -> tuple[object, ...]:
        at = f.at
        priority = _ABORT_PRIORITY if f.kind == SIGNAL and f.exitcode == -signal.SIGABRT else _PRIORITY[f.kind]
        return (f.kind == VICTIM, at is None, at or 0.0, priority, f.timestamp, f.rank)

    order = sorted(ranks, key=key)
    root = order[0]
    seen = root.kind != VICTIM
    victims = tuple(f.rank for f in order if f.kind == VICTIM and f is not root)
    others = tuple(f.rank for f in order[1:] if f.kind != VICTIM)
    by_rank = {f.rank: f for f in ranks}
    others_how = ", ".join(by_rank[r].describe() for r in others)
    victims_how = ", ".join(by_rank[r].describe() for r in victims)
    if not seen:
        lost = ", ".join(f.describe() for f in order)
        message = f"{UNSEEN}; every rank that failed here lost a peer: {lost}"
        return CrashVerdict(root.rank, False, root.describe(), victims, others, others_how, victims_how, message)
    message = root.describe()
    if others:
        message += f"; then {others_how}"
    if victims:
        message += f"; failed because of it: {victims_how}"
    return CrashVerdict(root.rank, seen, root.describe(), victims, others, others_how, victims_how, message,
                        raised=root.kind == RAISED)


def on_another_node(rank: int, how_: str, host: str, here: CrashVerdict | None) -> CrashVerdict:
    """The verdict when the root was on another node (its crash record: ``rank``, ``how_``,
    ``host``): every rank that failed here (``here``'s ranks, if any did) failed because of it."""
    victims = () if here is None else tuple(dict.fromkeys((here.root, *here.others, *here.victims)))
    victims_how = "" if here is None else ", ".join(x for x in (here.how, here.others_how, here.victims_how) if x)
    root = f"{how_} on {host} (another node)"
    message = root + (f"; failed because of it: {victims_how}" if victims_how else "")
    return CrashVerdict(rank, True, root, victims, (), "", victims_how, message, host)

