"""Warm restarts: the worker template that has imported torch (template, its start; its preload
template_preload, its socket and spawns template_server, the forked worker template_worker; its
frames template_wire), the fork from the launcher (template_fork), and the workers forked from
it (forked, warm).

May import: the hall vocabulary, processes, core, ft_client."""
