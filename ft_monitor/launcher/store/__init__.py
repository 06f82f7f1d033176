"""The store: what the launchers write to each other in the rendezvous store, and how it is
kept honest. Signing and round binding (store_auth), the key agreed through the rendezvous
without a job secret (agreed_key), the sealed roll-call evidence (sealed),
the notice boards and their bounded indexes (store_board), the slow-rank step-time exchange
(step_exchange), the job's identity where torch gives it none (job_identity).

May import: the launcher's hall vocabulary (exit_codes, stop_signal), ft_client, core. Nothing
above it in the launcher."""
