"""The pure core: what ft-monitor decides, with no I/O, no clock and no processes.

Settings and their rules (`rules`, `settings`), a rank's session and its deadlines (`state`,
`policy`, `startup`, `record_sync`, `section_stats`), the launch check of timeouts
(`timeout_order`), and the typed messages and records that cross a boundary, parsed field by
field (`notices`, `snapshot`, `status`, `report`, `server_log`'s safe text). Functions take
``now`` as an argument where time matters and are tested with a fake clock.

May import: the standard library, and from ft_client only its vocabulary (errors,
timeouts, names, timeouts_calc, the progress record's layout, collectives, startup's
constants). Never the daemon, the launcher, the views, the forensics or the processes
rooms, nor the client's connection (tests/test_architecture.py checks it).
"""
