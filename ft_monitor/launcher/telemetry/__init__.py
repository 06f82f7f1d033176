"""Telemetry: what the launcher tells people and machines. The events file (events), the
metrics and their HTTP endpoint (metrics, metrics_http), goodput, slow ranks, torch's own
events (torch_events), the closing summary (summary_text) and the telemetry that ties them
(telemetry).

May import: incident (what it reports), store, rdzv, the hall vocabulary, core, ft_client."""
