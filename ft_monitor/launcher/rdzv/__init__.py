"""The rendezvous as ft-launcher shapes it around torch's: which round a node is in (rounds),
no random delay before a restart's rendezvous (rdzv_delay), a worker store of its own per
attempt under the static rendezvous (static_rdzv); a store that went away, or holds a
rendezvous state that cannot be parsed, said in one line with exit 6 (store_gone; torch's
``etcd`` state parsed by etcd_state).

May import: the hall vocabulary (exit_codes, stop_signal), ft_client, core."""
