"""The incident: what went wrong and who it was. The hang's verdict (decide) and the crash's
(crash), torchelastic's error.json (rootcause), the roll call and its wire (rollcall,
rollcall_wire, diagnosis), the records exchanged with the other nodes (crossnode), progress
across restarts (progress) and the restart's timing (restarts).

May import: store, rdzv, the hall vocabulary, forensics, core, ft_client."""
