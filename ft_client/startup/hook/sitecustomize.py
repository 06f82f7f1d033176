"""ft-monitor's start-up hook: arms the start-up stack dump before the worker's script runs.

Python imports ``sitecustomize`` at start-up from the first directory on sys.path that
has one; ft-launcher (and ``ft-monitor serve -- CMD``) put this directory first on the
worker's PYTHONPATH when ``startup_timeout`` is set. This module

1. arms faulthandler on the monitor's dump signal (`ft_client.startup.arm`) and takes
   its own traces out of the environment, so the worker's children do not arm too;
2. takes its directory off ``sys.path``, so the script sees the path it would have had;
3. runs the ``sitecustomize`` it shadows, if there is one further along the path (a
   distribution's or a site's), so that one still takes effect.

Nothing here may stop the worker from starting: a failure is one line on stderr.
"""

import os
import sys


def _ft_startup_hook() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from ft_client import startup

        startup.arm()
    except Exception as e:  # noqa: BLE001 - never stop the worker from starting
        sys.stderr.write(f"ft-monitor start-up hook: no start-up stack dump for pid {os.getpid()}: {e}\n")
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import importlib.machinery
        import importlib.util

        spec = importlib.machinery.PathFinder.find_spec(__name__, sys.path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules[__name__] = module  # the import that runs us returns what is there now
            spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - as Python itself does for a failing sitecustomize
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}\n")


_ft_startup_hook()
