"""Views: what an operator reads of a run after the fact or while it runs, `ft-monitor
report` (`report_html`) and `ft-monitor status --all` / `ft-launcher status --watch`
(`live_view`). They read what the daemon and the launcher wrote; they decide nothing.

May import: the rooms below it (core, forensics, processes, launcher), never the daemon. Nothing
imports a view except the command-line entry points (`ft_monitor.cli`, `ft_monitor.launcher.main`).
"""
