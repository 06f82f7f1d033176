"""A worker script run by the worker template's tests, forked or started cold alike.

    python -u tests/workers/template_script.py report [ARGS...]  # one JSON line: what it sees
    python -u tests/workers/template_script.py exit N            # sys.exit(N)
    python -u tests/workers/template_script.py raise             # an uncaught exception
    python -u tests/workers/template_script.py wait              # "ready PID", then waits for a signal
    python -u tests/workers/template_script.py atexit            # an atexit handler, unflushed output

``report`` prints how the process sees itself (argv, ``__file__``, sys.path[0], cwd, env,
ids, signal handlers, stdio, ``__main__``'s attributes) on stdout and one line on stderr.
"""

import atexit
import ctypes
import json
import os
import signal
import sys
import time

import __main__


def report() -> None:
    pdeath = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(pdeath))  # PR_GET_PDEATHSIG

    def handler(sig: signal.Signals) -> str:
        h = signal.getsignal(sig)
        return {signal.SIG_DFL: "SIG_DFL", signal.SIG_IGN: "SIG_IGN",
                signal.default_int_handler: "default_int_handler"}.get(h, repr(h))

    pid = os.getpid()
    out = {
        "argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
        "pid": pid, "sid": os.getsid(0), "pgid": os.getpgid(0), "pdeathsig": pdeath.value,
        "handlers": {s.name: handler(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE,
                                                         signal.SIGHUP, signal.SIGQUIT)},
        "stdin": os.readlink("/proc/self/fd/0"), "write_through": sys.stdout.write_through,
        "stdout_errors": sys.stdout.errors, "stderr_errors": sys.stderr.errors,
        "stdout_encoding": sys.stdout.encoding,
        "line_buffering": [sys.stdout.line_buffering, sys.stderr.line_buffering],
        "main": sorted(k for k in vars(__main__) if k.startswith("__")),
        "main_loader": type(__main__.__loader__).__name__, "main_spec": __main__.__spec__,
        "name": __name__, "sys_main_is_this": sys.modules["__main__"].__dict__ is globals(),
        "path_has_template_dir": any(p.endswith("template_only_dir") for p in sys.path),
        "tasks": len(os.listdir("/proc/self/task")), "sys_path": sys.path,
    }
    print(json.dumps(out))
    print("to stderr", file=sys.stderr)


def main() -> None:
    mode = sys.argv[1]
    if mode == "report":
        report()
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise RuntimeError("boom from the script")
    elif mode == "wait":
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(60)
    elif mode == "atexit":
        atexit.register(lambda: print("atexit ran"))
        sys.stdout.write("unflushed line\n")
    elif mode == "first":
        print("first", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
