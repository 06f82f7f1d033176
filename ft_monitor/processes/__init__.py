"""Processes: what the kernel says about them (`procinfo`), waiting for their exits through
pidfds (`exits`) and stopping them with a bounded grace (`escalation`). Shared by the daemon
and the launcher.

May import: the core and ft_client's vocabulary. Never the daemon, the launcher or the views.
"""
