"""The worker template: a preloaded interpreter that forks the workers of the next attempt.

Runs in its own process, started by the launcher (`ft_monitor.launcher.warm.forked.Template`)::

    python -m ft_monitor.launcher.warm.template --socket PATH [--preload torch,numpy,...]
                                           [--preload-file FILE] [--parent PID] [--path DIR]...

At start it dies with the launcher (PR_SET_PDEATHSIG, SIGKILL), ignores SIGINT (the
terminal's Ctrl-C is the launcher's), imports each ``--preload`` module (one that fails
is one line on stderr and a ``failed`` entry in its status; the template goes on without
it), then serves requests on the Unix socket PATH (mode 0600), one connection and one
request at a time, blocking: no thread, no event loop, so that it can fork safely. Only
its parent (the launcher, SO_PEERCRED) is served. SIGTERM ends it cleanly. The requests
and replies are `ft_monitor.core.template_request`'s.

A spawn double-forks: the template forks a child, which forks the worker and exits; the
template reaps the child, so the worker is reparented to the nearest child subreaper (the
launcher, `forked.set_child_subreaper`), which waits for it and signals it as its own
child. The worker makes itself a session leader (``setsid``: its pgid is its pid, as
torchrun's ``Popen(start_new_session=True)`` gives), takes the passed stdout and stderr,
stdin from /dev/null, Python's default signal handlers, exactly the environment given,
the cwd, and then waits for the template's go (sent once it is the launcher's child) before
running the script as ``python script.py`` would: a fresh ``__main__`` module, ``sys.argv``,
``sys.path[0]`` (the script's real directory), ``__file__`` (absolute), exit codes and the
uncaught exception's traceback on stderr.

What a forked worker cannot have (the interpreter started before its environment existed):

* variables read when the interpreter starts: PYTHONHASHSEED (every worker has the
  template's hash seed), PYTHONOPTIMIZE, PYTHONWARNINGS, PYTHONMALLOC, PYTHONUTF8,
  PYTHONSAFEPATH, PYTHONNOUSERSITE, PYTHONHOME, ...; those applied here are PYTHONPATH
  (sys.path rebuilt), PYTHONUNBUFFERED (as ``-u``), PYTHONDONTWRITEBYTECODE (as ``-B``),
  PYTHONFAULTHANDLER and PYTHONIOENCODING. ``sitecustomize`` and ``.pth`` files ran in the
  template; ft-monitor's own start-up hook (``FT_STARTUP_DUMP``) is armed here instead;
* anything a preloaded module read at its import: BLAS thread pools (the template sets
  OPENBLAS_NUM_THREADS=1 unless given, so that loading OpenBLAS starts no thread; workers
  keep one BLAS thread), torch's import-time settings. OMP_NUM_THREADS is applied to torch
  (``torch.set_num_threads``), numpy's global random state is reseeded (Python's ``random``
  reseeds itself at fork);
* the spawn reply's ``ignored_env`` names those of the first two kinds that differ between
  the template's environment and the worker's (`ft_monitor.core.template_argv.ignored_env`).

Smaller differences from a worker started the normal way: its /proc/PID/cmdline (what
``ps`` shows) is the template's command line; stdin is /dev/null (torchrun's workers inherit
the launcher's); ``sys.flags`` are the template's (``-u`` and ``-B`` are
applied, not flagged); an uncaught KeyboardInterrupt's traceback starts in the template's
frames (the exit, by SIGINT, is the interpreter's).

Here: the command line and the template's start (`serve_template`). Its parts: the preload and
what the template knows of itself (template_preload.py), the socket and the spawns
(template_server.py), the forked worker made to look like a fresh interpreter and its script run
(template_worker.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys

from ft_client.startup.parent_death import die_with_parent
from ft_monitor.launcher.warm.template_preload import ignored_signals, preload, say
from ft_monitor.launcher.warm.template_server import Server
from ft_monitor.launcher.warm.template_worker import pythonpath_dirs, run_worker


def _parent_alive(parent: int) -> bool:
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_monitor.launcher.warm.template")
    parser.add_argument("--socket", required=True, help="the Unix socket to serve on (its directory private)")
    parser.add_argument("--preload", default="", help="modules to import, comma-separated")
    parser.add_argument("--preload-file", default=None,
                        help="a file of modules to import, one per line (the launcher's: a long list)")
    parser.add_argument("--parent", type=int, default=None, help="the launcher's pid (default: the parent's)")
    parser.add_argument("--path", action="append", default=[],
                        help="a directory put first on sys.path while preloading (the script's)")
    args = parser.parse_args(argv)
    parent = args.parent if args.parent is not None else os.getppid()
    if not die_with_parent(signal.SIGKILL):
        say("could not set PR_SET_PDEATHSIG: the template will outlive a launcher killed outright")
    if not _parent_alive(parent):
        say(f"the launcher (pid {parent}) is gone; exiting")
        return 1
    names = [n.strip() for n in args.preload.split(",") if n.strip()]
    if args.preload_file is not None:
        try:
            with open(args.preload_file) as f:
                names += [n.strip() for n in f.read().splitlines() if n.strip()]
        except (OSError, UnicodeDecodeError) as e:
            say(f"cannot read the preload list {args.preload_file}: {e}; going on without it")
    return serve_template(args.socket, parent, names, args.path)


def serve_template(socket_path: str, parent: int, names: list[str], paths: list[str]) -> int:
    """Import ``names`` (``paths`` first on sys.path meanwhile) and serve on ``socket_path`` until
    SIGTERM; in a forked worker, run its script. In the template's process: started as
    ``python -m ft_monitor.launcher.warm.template`` (`main`), or forked from the launcher
    (`ft_monitor.launcher.warm.template_fork`), whose imports it then has already."""
    inherited_ignored = ignored_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start_env = dict(os.environ)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # else loading OpenBLAS starts its thread pool
    # sys.path entries of the template's own, which a worker does not get: -m's cwd, --path, PYTHONPATH
    template_only = {sys.path[0]} if sys.path else set()
    template_only |= set(pythonpath_dirs(start_env.get("PYTHONPATH"), os.getcwd()))
    extra = [os.path.abspath(p) for p in paths]
    template_only |= set(extra)
    sys.path[:0] = extra
    preloaded, failed, unsafe = preload(names)
    # What is imported now lives as long as every worker: out of the collector's sight, so that a
    # worker's collections and its exit do not write to (and so copy) the pages it shares with the
    # template (a worker with torch exited in 0.63 s after a fork, 0.23 s with this).
    gc.collect()
    gc.freeze()
    server = Server(socket_path, parent, preloaded, failed, start_env, template_only, unsafe, inherited_ignored)
    worker = server.serve()
    if worker is None:
        say("stopped")
        return 0
    run_worker(worker)  # outside every try and with of the template's: the interpreter ends as the script's
    return 0


if __name__ == "__main__":
    sys.exit(main())
