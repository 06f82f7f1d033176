"""ft-launcher: torchrun with a monitor daemon beside every rank.

Built on torch.distributed.elastic, not a fork of it: torchrun's own argument
parser and launch path (`torch.distributed.run`), with one `LocalElasticAgent`
subclass (`agent.FtLocalElasticAgent`) swapped in. Rendezvous, process start and
stop, the worker environment, the log layout and `@record` error files are
torch's. The subclass adds what the monitors need:

* one `ft-monitor serve` daemon per local rank, started before the workers and
  kept across restarts (`monitors.MonitorPool`);
* a launcher socket where daemons report hangs and ranks send workload control
  requests (`control.LauncherServer`);
* on a hang, a torchelastic error.json whose timestamp is the hang onset, so the
  root cause names the hung rank (`rootcause`), and a restart through the
  normal elastic path; what to do is decided by pure functions (`decide`), the
  agent only gathers their inputs and carries out the result;
* a restart budget that stops early when restarts make no progress (`progress`).

The launcher and its daemons run with the same typed settings
(`ft_monitor.core.settings.Settings`, validated once by `ft_monitor.config`).

Everything here runs in the launcher's process (`main` is ft-launcher's entry point), but
`template`, which is the worker template's own process (started by `forked.Template`). May
import: the core, forensics and processes rooms, and ft_client; never the daemon (daemons
are reached over their sockets and started through `ft_monitor.processes.monitor_process`)
nor the views (only `main`, the entry point, shows the live view).

Usage is torchrun's, plus ``--ft-<field>`` flags and ``--ft-cfg-path``::

    ft-launcher --nproc-per-node 8 --max-restarts 3 --ft-cfg-path ft.yaml train.py
"""
