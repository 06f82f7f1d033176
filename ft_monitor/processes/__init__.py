"""Processes: what the kernel says about them (`procinfo`), waiting for their exits through
pidfds (`exits`), stopping them with a bounded grace (`escalation`), and a monitor daemon
started as a child process from a checked `ServeSpec` (`monitor_process`: what
`RankMonitorServer.run_in_subprocess` and the launcher's monitors use). Shared by the daemon,
the launcher and the embedding API; runs in whichever process calls it.

May import: the core and ft_client's vocabulary. Never the daemon, the launcher or the views.
"""
