"""What the worker template imports, and what it knows of itself: `preload` imports the modules
asked for and notes those that started a thread or initialised CUDA at import (the template then
refuses to fork); the threads (`thread_names`), CUDA (`cuda_initialized`) and memory (`rss_kb`)
its status reports; the signals it inherited ignored (`ignored_signals`); and `say`, its line on
stderr (the template's log).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

_LOG = "ft-monitor template"


def say(text: str) -> None:
    """One line of the template's log (its stderr), with its pid."""
    sys.stderr.write(f"{_LOG} (pid {os.getpid()}): {text}\n")
    sys.stderr.flush()


def thread_names() -> list[str]:
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for t in sorted(tasks):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip() or "?")
        except OSError:
            names.append("?")
    return names


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support, half imported: not initialised
        return False


def rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def preload(names: list[str]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Import each module; those that fail are one line on stderr each, and left out. Also
    returns the modules seen starting a thread or initialising CUDA at import (the template
    will refuse to fork: the refusal names them)."""
    done: list[str] = []
    failed: dict[str, str] = {}
    unsafe: dict[str, str] = {}
    for name in names:
        threads, cuda = len(thread_names()), cuda_initialized()
        try:
            importlib.import_module(name)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a module may even sys.exit() at import: go on without it
            why = f"{type(e).__name__}: {e}".strip()
            failed[name] = why
            say(f"preload {name} failed, going on without it: {why}")
            continue
        finally:
            did = []
            started = len(thread_names()) - threads
            if started > 0:
                did.append(f"started {started} thread(s)")
            if cuda_initialized() and not cuda:
                did.append("initialised CUDA")
            if did:
                unsafe[name] = " and ".join(did)
                say(f"preload {name} {unsafe[name]} at import: the template cannot fork")
        done.append(name)
    return done, failed, unsafe


def ignored_signals() -> frozenset[int]:
    """The signals this process ignores now. Read at the template's start, before it changes any:
    those it inherited ignored from the launcher (``nohup`` ignores SIGHUP, a background shell
    SIGINT and SIGQUIT), which an exec'd worker inherits ignored too (exec keeps SIG_IGN)."""
    found = set()
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                found.add(int(sig))
        except (OSError, ValueError):
            continue
    return frozenset(found)
