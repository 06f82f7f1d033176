"""Plays ft-launcher for the worker template's tests: a child subreaper that starts
templates (`ft_monitor.launcher.warm.forked.Template`) and asks them to fork workers.

Reads one JSON command a line on stdin, answers one JSON line on stdout::

    {"cmd": "start", "name", "dir", "preload": [...], "path": [...], "env": {...}|null}
                                                            -> {"pid"} | {"error"}
    {"cmd": "status", "name"}                               -> the status | {"error"}
    {"cmd": "spawn", "name", "argv", "env", "cwd", "stdout": path|null, "stderr": path|null}
                                                            -> {"pid"} | {"refused"} | {"error"}
    {"cmd": "poll"|"wait", "pid", "seconds"}                -> {"returncode"} | {"timeout": true}
    {"cmd": "signal", "pid", "sig"}  (ForkedProcess.send_signal), {"cmd": "killpg", "pid", "sig"}
    {"cmd": "ids", "pid"}                                   -> {"sid", "pgid", "ppid"}
    {"cmd": "latency", "name", "argv", "cwd"}               -> {"forked", "cold"}: seconds to the first line
    {"cmd": "close", "name"}, {"cmd": "exit"}

Prints {"ready": true, "pid", "subreaper"} first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ft_monitor.launcher.warm.forked import ForkedProcess, Template, TemplateError, TemplateRefused, set_child_subreaper

templates: dict[str, Template] = {}
procs: dict[int, ForkedProcess] = {}


def first_line_after(fd: int, t0: float) -> float:
    data = b""
    while b"\n" not in data:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return time.monotonic() - t0


def handle(c: dict[str, Any]) -> dict[str, Any]:
    cmd = c["cmd"]
    if cmd == "start":
        env = c.get("env") or dict(os.environ)
        t = Template.start(Path(c["dir"]), c.get("preload", []), env, sys_path=c.get("path", []))
        templates[c["name"]] = t
        try:
            t.wait_ready(c.get("seconds", 60))
        except TemplateError as e:
            return {"error": str(e), "pid": t.pid}
        return {"pid": t.pid, "socket": str(t.socket_path)}
    if cmd == "status":
        try:
            return templates[c["name"]].status()
        except TemplateError as e:
            return {"error": str(e)}
    if cmd == "spawn":
        files = [open(p, "w") if p else None for p in (c.get("stdout"), c.get("stderr"))]  # noqa: SIM115
        try:
            p = templates[c["name"]].spawn(c["argv"], c["env"], c["cwd"], files[0], files[1])
        except TemplateRefused as e:
            return {"refused": e.why}
        except TemplateError as e:
            return {"error": str(e)}
        finally:
            for f in files:
                if f is not None:
                    f.close()
        procs[p.pid] = p
        return {"pid": p.pid}
    if cmd in ("poll", "wait"):
        p = procs[c["pid"]]
        if cmd == "poll":
            return {"returncode": p.poll()}
        try:
            return {"returncode": p.wait(c.get("seconds"))}
        except subprocess.TimeoutExpired:
            return {"timeout": True}
    if cmd == "signal":
        procs[c["pid"]].send_signal(c["sig"])
        return {}
    if cmd == "killpg":
        os.killpg(c["pid"], c["sig"])
        return {}
    if cmd == "ids":
        pid = c["pid"]
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        return {"sid": os.getsid(pid), "pgid": os.getpgid(pid), "ppid": ppid}
    if cmd == "latency":
        r, w = os.pipe()
        with os.fdopen(w, "w") as out:
            t0 = time.monotonic()
            p = templates[c["name"]].spawn(c["argv"], dict(os.environ), c["cwd"], out, None)
        forked = first_line_after(r, t0)
        p.wait(30)
        os.close(r)
        t0 = time.monotonic()
        cold = subprocess.run([sys.executable, "-c", "import torch; print('first', flush=True)"],
                              stdout=subprocess.PIPE, check=True, timeout=120)
        assert cold.stdout
        return {"forked": forked, "cold": time.monotonic() - t0}
    if cmd == "close":
        t = templates.pop(c["name"])
        t.close()
        return {"returncode": t.proc.returncode}
    raise ValueError(f"unknown command {cmd}")


def main() -> None:
    subreaper = set_child_subreaper()
    print(json.dumps({"ready": True, "pid": os.getpid(), "subreaper": subreaper}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "exit":
            break
        try:
            answer = handle(c)
        except Exception as e:  # noqa: BLE001 - the test reads it
            answer = {"exception": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
    for t in templates.values():
        t.close()


if __name__ == "__main__":
    main()
