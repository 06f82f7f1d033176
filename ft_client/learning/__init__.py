"""The room of learned timeouts: from what a run observed to the timeouts it runs with.

- `calc`: the pure math (`TimeoutsRecorder`, which `RankMonitorClient` feeds, the
  observations, the rules that turn them into timeouts); also imported by the monitor's pure
  core for its rules (the safety factor's);
- `compat`: nvidia-resiliency-ext's `TimeoutsCalc` API over that recorder (``from ft_client
  import TimeoutsCalc``);
- `state_dict`: the learned timeouts in a checkpoint, and reading them back (ours and the
  reference's format);
- `sync`: the one cross-rank reduction (element-wise MAX), the only torch.distributed call
  of the client; torch is imported inside it.

May import only the hall (``ft_client.errors``, ``ft_client.timeouts``, ``ft_client.names``).
``ft_client.timeouts_calc`` is a door kept for the path docs named before the room existed.
"""
