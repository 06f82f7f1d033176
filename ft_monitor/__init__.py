"""ft_monitor: the per-rank monitor daemon (`ft-monitor serve`) and, later, the launcher.

The daemon never imports torch: it must start fast and stay small beside every rank.
"""
