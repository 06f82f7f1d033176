"""The daemon's log line format, shared by its stderr log and per-session log files."""

LOG_FORMAT = "%(asctime)s ft-monitor[%(process)d] %(levelname)s %(message)s"
