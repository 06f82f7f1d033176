"""Waiting for processes to exit, through their pidfds, on the event loop.

One loop reader per process however many wait on it (the daemon's session and a
hang task may wait at once). `forget()` must come before the handle is closed.
"""

from __future__ import annotations

import asyncio

from ft_monitor.processes.procinfo import ProcessHandle

POLL = 0.01
"""Seconds between liveness checks where a process has no pidfd to watch."""


class ExitWatch:
    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future[None]] = {}

    def exited(self, proc: ProcessHandle) -> asyncio.Future[None] | None:
        """A future done when ``proc`` exits; None where there is no pidfd to watch."""
        fd = proc.fd
        if fd is None:
            return None
        fut = self._futures.get(fd)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._futures[fd] = loop.create_future()
            if not proc.alive():
                fut.set_result(None)
            else:
                done = fut

                def ready() -> None:
                    loop.remove_reader(fd)
                    if not done.done():
                        done.set_result(None)

                loop.add_reader(fd, ready)
        return fut

    def forget(self, proc: ProcessHandle) -> None:
        fd = proc.fd
        if fd is None:
            return
        fut = self._futures.pop(fd, None)
        if fut is not None and not fut.done():
            asyncio.get_running_loop().remove_reader(fd)
            fut.cancel()

    async def wait(self, proc: ProcessHandle, timeout: float) -> bool:
        """Wait (bounded) until the process has exited; True if it did."""
        if not proc.alive():
            return True
        fut = self.exited(proc)
        if fut is not None:
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                if not fut.cancelled():  # this task was cancelled, not the watch (forget())
                    raise
            return not proc.alive()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            await asyncio.sleep(POLL)
            if not proc.alive():
                return True
        return not proc.alive()
