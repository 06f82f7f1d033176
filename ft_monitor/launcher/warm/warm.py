"""Warm process restarts (``--ft-warm-restart``): the next attempt's workers are forked
from a per-node template that has already imported torch and the training code's modules
(docs/launcher.md, "Warm restarts").

`WarmStarts` owns the template (`forked.Template`, started when the launcher starts and
kept warm) and decides, for each attempt torch starts, whether its workers are forked or
started as usual:

* attempt 0 starts as usual (the template serves restarts only), unless ``--ft-warm-start``
  asks for its workers to be forked too: it then waits for the template's imports (up to
  `READY_WAIT`), so that a node imports torch once instead of once per worker;
* a restart's workers are forked when the template is alive and has finished its imports;
  anything else (it is still importing, it died, it refuses: threads, CUDA, an entry point
  it cannot run) starts them as usual, with one line saying why (`fallbacks`): a restart
  never waits for imports, so it is never slower than a cold one;
* with ``--ft-preload auto``, the template is made again, once, with the top-level modules
  the first attempt's workers had loaded (each writes them to a file named by
  `MODULES_FILE_ENV` when it starts monitoring: read from the workers, not guessed); until
  that one is ready, restarts fork from the first one, and one line says so.

The fork goes through torch's own start: during `forking`, torch's `get_subprocess_handler`
makes `ForkedHandler`s, whose `_popen` asks the template instead of `subprocess.Popen`;
torch's SubprocessContext then watches, signals and reaps the workers as its own
children (the launcher is their child subreaper).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ft_client.safefiles import read_bounded
from ft_client.startup import loaded_modules
from ft_monitor.core.preload import modules_from_file

log = logging.getLogger("ft_monitor.launcher")

MODULES_FILE_ENV = loaded_modules.MODULES_FILE_ENV
"""Where a worker writes the top-level modules it has loaded (``--ft-preload auto``)."""
READY_WAIT = 60.0
"""Seconds attempt 0 waits, under ``--ft-warm-start``, for a template that is still importing
(its workers would each import as much when started as usual). A restart never waits: it
forks from a template that is ready, or starts its workers as usual (a cold start is never
slower than waiting for imports to finish)."""


PAUSE_LIMIT = 60.0
"""Seconds at most a template that is importing stays paused for a restart (`resume`)."""
ANSWER_WAIT = 5.0
"""Seconds a restart waits for a template that has finished its imports (its socket is there)
to answer: on a busy machine an answer can take more than a moment."""


class WarmStarts:
    """The template of one node and the decision to fork from it."""

    def __init__(self, directory: Path, preload: list[str], auto: bool, env: Mapping[str, str] | None = None,
                 sys_path: Sequence[str] = (), first_attempt: bool = False, template: Any = None) -> None:
        """``template``: one forked from the launcher at its start (`template_fork`), adopted by
        `start` instead of starting one."""
        self.directory = directory
        self._adopted = template
        self.first_attempt = first_attempt
        """``--ft-warm-start``: attempt 0's workers are forked too."""
        self.preload = preload
        self.auto = auto
        self.env = dict(os.environ if env is None else env)
        self.sys_path = list(sys_path)
        """Put first on the template's sys.path while it imports: the script's directory (its own modules)."""
        self.template: Any = None
        self._pending: Any = None
        """With ``auto``: the template made again with the workers' modules, until it answers."""
        self._retired: list[Any] = []
        self._paused: list[Any] = []
        """Templates stopped while a restart's workers start (`_pause_importing`)."""
        self._paused_at = 0.0
        self._ready = False
        self._auto_done = not auto
        self.fallbacks: list[str] = []
        self.forked: dict[int, list[int]] = {}
        """attempt -> the pids forked for it."""

    # -- the template -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the template (not waiting for its imports); one line if it cannot start."""
        from ft_monitor.launcher.warm.forked import set_child_subreaper

        if not set_child_subreaper():
            self._say("the launcher cannot become its workers' child subreaper (prctl refused)")
            if self._adopted is not None:
                self._adopted.close()
            return
        self.template = self._adopted if self._adopted is not None else self._launch(self.preload)
        self._adopted = None
        self._ready = False

    def _launch(self, names: list[str]) -> Any:
        """A new template importing ``names`` (the script's directory first on its path), or None
        after one line saying why."""
        from ft_monitor.launcher.warm.forked import Template, TemplateError

        try:
            return Template.start(self.directory, names, self.env, sys_path=self.sys_path)
        except (OSError, TemplateError) as e:
            self._say(f"the worker template did not start: {e}")
            return None

    def modules_file(self, local_rank: int) -> str | None:
        """The file a worker writes its modules to (``auto`` only, until the template is made again)."""
        if self._auto_done:
            return None
        return str(self.directory / f"modules-{local_rank}.json")

    def poll(self) -> None:
        """From the agent's monitor loop: with ``auto``, once the first worker has written its
        modules, make the template again with them; the old one serves until the new one
        answers (`_adopt`). A template paused for a restart past `PAUSE_LIMIT` goes on."""
        self.resume()
        self._paused = [t for t in self._paused if t.alive()]
        if self._pending not in self._paused:  # a paused one cannot answer: adopted once it goes on
            self._adopt(0.0, restarting=False)
        if self._auto_done:
            return
        found: set[str] = set()
        for p in self.directory.glob("modules-*.json"):
            try:
                found.update(modules_from_file(read_bounded(str(p), 1 << 20)))
            except OSError:
                continue
        if not found:
            return
        self._auto_done = True
        wanted = self.preload + sorted(found - set(self.preload))
        log.info("ft-launcher: --ft-preload auto: the workers loaded %d modules; the template imports them for "
                 "the next restart", len(wanted))
        self._pending = self._launch(wanted)

    def _adopt(self, wait: float, restarting: bool = True) -> None:
        """The template made again replaces the old one once it answers (waiting up to ``wait`` s);
        the old one is asked to stop without being waited for (`close` reaps it). One that exits
        or does not answer in time leaves the old one serving: said once, by the restart that
        forks from the old one (``restarting``), not by every poll of the monitor loop."""
        from ft_monitor.launcher.warm.forked import TemplateError

        new = self._pending
        if new is None:
            return
        try:
            new.wait_ready(wait)
        except TemplateError as e:
            if not new.alive():
                self._pending = None
                self._retired.append(new)
                log.warning("ft-launcher: warm restart: the template made again with the workers' modules "
                            "exited; the first one goes on serving: %s", e)
            elif restarting and self.template is not None and self._ready:
                log.info("ft-launcher: warm restart: the template made again with the workers' modules (pid %d) "
                            "is still importing; this restart forks from the ready one (pid %d, %s)", new.pid,
                            self.template.pid, ", ".join(self.preload) or "no module")
            return
        old, self.template, self._pending = self.template, new, None
        self._mark_ready(new)
        log.info("ft-launcher: warm restart: the template made again with the workers' modules (pid %d) is ready; "
                 "restarts fork from it", new.pid)
        if old is not None:
            old.terminate()
            self._retired.append(old)

    def _mark_ready(self, t: Any) -> None:
        """``t`` answers: what it really imported becomes `preload` (what the summary reports)."""
        from ft_monitor.launcher.warm.forked import TemplateError

        self._ready = True
        try:
            self.preload = list(t.status()["preloaded"])
        except (TemplateError, KeyError, TypeError):
            pass

    def _ready_now(self, wait: float) -> str | None:
        """None when a template answers; else why not (after waiting up to ``wait`` s while it imports)."""
        from ft_monitor.launcher.warm.forked import TemplateError

        self._adopt(wait)
        t = self.template
        if t is None:
            return "no worker template is running"
        if self._ready and t.alive():
            return None
        if not t.alive():
            return f"the worker template (pid {t.pid}) has exited"
        if wait <= 0 and t.socket_path.exists():  # its imports are done (it listens after them): let a busy
            wait = ANSWER_WAIT                    # machine's template answer
        try:
            t.wait_ready(wait)
        except TemplateError as e:
            if wait <= 0:
                return f"the worker template (pid {t.pid}) is still importing; a restart does not wait for it"
            return f"the worker template is not ready: {e}"
        self._mark_ready(t)
        return None

    def _pause_importing(self) -> None:
        """A restart's workers start now: a template still importing (made again with the
        workers' modules, or the first one when this restart starts cold) is stopped until every
        rank steps again (`resume`), so that its imports never take the CPU the workers need
        (with a 5 s import beside them a warm restart was slower than a cold one)."""
        importing = [t for t in (self._pending, None if self._ready else self.template)
                     if t is not None and t.alive() and t not in self._paused]
        for t in importing:
            t.pause(True)
            self._paused.append(t)
            log.info("ft-launcher: warm restart: the template still importing (pid %d) is paused until every rank "
                     "steps again", t.pid)
        if importing:
            self._paused_at = time.monotonic()

    def resume(self, force: bool = False) -> None:
        """Every rank steps again (the agent), or a paused template waited `PAUSE_LIMIT`: the
        templates paused for the restart import on."""
        if not self._paused or (not force and time.monotonic() - self._paused_at < PAUSE_LIMIT):
            return
        for t in self._paused:
            t.pause(False)
        self._paused = []

    def close(self) -> None:
        self._paused = []
        for t in (self.template, self._pending, *self._retired):
            if t is not None:
                t.close()
        self.template = self._pending = None
        self._retired = []

    def _say(self, why: str) -> None:
        text = f"ft-launcher: warm restart: {why}; starting the workers as usual"
        if text not in self.fallbacks:
            log.warning("%s", text)
        self.fallbacks.append(text)

    # -- the fork, inside torch's start --------------------------------------------------------
    @contextlib.contextmanager
    def forking(self, attempt: int) -> Iterator[list[int]]:
        """While torch starts attempt ``attempt``'s workers: fork them from the template when
        it can (the pids forked are appended to the yielded list)."""
        pids: list[int] = []
        if attempt == 0 and not self.first_attempt:
            yield pids
            return
        why = self._ready_now(READY_WAIT if attempt == 0 else 0.0)
        if attempt > 0:
            self._pause_importing()
        if why is not None:
            self._say(why)
            yield pids
            return
        import torch.distributed.elastic.multiprocessing.api as api

        original = getattr(api, "get_subprocess_handler")  # torch internals: checked at start (torch_support)
        said: list[str] = []

        def get_subprocess_handler(**kwargs: Any) -> Any:
            if not said:
                try:
                    handler = ForkedHandler(self.template, **kwargs)
                    pids.append(handler.proc.pid)
                    return handler
                except Exception as e:  # noqa: BLE001 - any refusal: this attempt starts as usual
                    said.append(str(e))
                    self._say(str(e))
            return original(**kwargs)

        setattr(api, "get_subprocess_handler", get_subprocess_handler)
        try:
            yield pids
        finally:
            setattr(api, "get_subprocess_handler", original)
            if pids:
                self.forked[attempt] = list(pids)


def _forked_handler_base() -> Any:
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    return SubprocessHandler


class ForkedHandler(_forked_handler_base()):  # type: ignore[misc]
    """torch's SubprocessHandler, whose process is forked from the template instead of
    started by Popen; torch opens the log files and builds the environment as for any worker."""

    def __init__(self, template: Any, **kwargs: Any) -> None:
        self._template = template
        self._started_at = time.monotonic()
        super().__init__(**kwargs)

    def _popen(self, args: Sequence[str], env: dict[str, str]) -> Any:
        # without torch's redirects a worker writes where the launcher does, as Popen's would
        out: IO[Any] = self._stdout if self._stdout is not None else sys.stdout
        err: IO[Any] = self._stderr if self._stderr is not None else sys.stderr
        try:
            return self._template.spawn([str(a) for a in args], env, os.getcwd(), out, err)
        except BaseException:
            for f in (self._stdout, self._stderr):
                if f is not None:
                    f.close()
            raise
