"""The daemon's log line format, shared by its stderr log and per-session log files,
and how text from a peer is made safe to put in a log line."""

LOG_FORMAT = "%(asctime)s ft-monitor[%(process)d] %(levelname)s %(message)s"


def printable(text: object) -> str:
    """``text`` as is when every character prints; else its repr, so a peer's string
    (a section name, a reason) cannot forge a log line with a newline, move the
    terminal with an escape sequence, or cut a line with a NUL."""
    s = str(text)
    return s if s.isprintable() else repr(s)
