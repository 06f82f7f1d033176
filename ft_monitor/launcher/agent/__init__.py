"""The agent and its runtime: torch's LocalElasticAgent with a monitor beside every rank
(agent, hangs, observed), the run's state (runtime), the workers' environment (worker_env,
secret_env), the monitors, process groups and the launcher's socket (monitors, groups,
control), the in-process restarts seen from the launcher (inprocess, inprocess_watch), and
the torch internals it relies on (torch_support).

May import: every launcher room below it (store, rdzv, incident, telemetry, warm), the hall
vocabulary, core, forensics, processes, ft_client. Only the hall (main, early_check) is above it."""
