"""Telemetry: what the launcher tells people and machines. The events file (events), the
metrics and their HTTP endpoint (metrics, metrics_http; its request and answer
metrics_request, its cap and evictions metrics_admission, the peer's uid metrics_peer, its
sockets metrics_sockets), goodput, slow ranks (slow_ranks, judged; slow_watch, over time and
across nodes), each local rank's last word (local_ranks), torch's own events (torch_events),
the closing summary (summary_text) and the telemetry that ties them (telemetry, its events'
fields telemetry_fields).

May import: incident (what it reports), store, rdzv, the hall vocabulary, core, ft_client."""
