"""How the daemon's internal command lines are spelled: shared by `ft_monitor.cli`, which
reads them, and those who start a daemon (`ft_monitor.processes.monitor_process`, the launcher's
monitors), which must not import the CLI. Constants only, so the CLI's import stays cheap."""

CHECK_SERVE = "--check-serve"
"""`ft-monitor --check-serve ARGS`: check ``serve``'s arguments in a child and print the settings."""
RUN_CHECKED = "--run-checked"
"""`ft-monitor --run-checked FILE`: serve from a ServeSpec already validated (ft-launcher)."""
