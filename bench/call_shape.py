"""What a part of the client costs a progress call as a mixin and as a collaborator.

`RankMonitorClient` is made of parts (ft_client/client/). A call into a mixin part is one
method looked up on the class; into a collaborator, one attribute load more and a call on
another object. Both shapes here do what the hot path does around its stores (take the
client's lock, store a word); each is timed back to back in this process (`timeit`, the
best of 5 repeats of ``n`` calls, `mode`'s number of times). The figures say whether the
shape decides anything: ft_client/client/state.py says why the parts are what they are.
"""

from __future__ import annotations

import threading
import timeit

from bench.harness import Figure, Mode


class _Part:
    __slots__ = ("lock", "words")

    def __init__(self, lock: threading.RLock, words: list[int]) -> None:
        self.lock, self.words = lock, words

    def beat(self, now: int) -> None:
        with self.lock:
            self.words[9] = now


class _Mixin:
    _lock: threading.RLock
    _words: list[int]

    def beat(self, now: int) -> None:
        with self._lock:
            self._words[9] = now


class MixinClient(_Mixin):
    def __init__(self) -> None:
        self._lock, self._words = threading.RLock(), [0] * 16

    def send_heartbeat(self) -> None:
        self.beat(1)


class CollaboratorClient:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._part = _Part(self._lock, [0] * 16)

    def send_heartbeat(self) -> None:
        self._part.beat(1)


def run(mode: Mode, loop: str | None = None) -> list[Figure]:
    n, times = mode.pick(200_000, 50_000, 2_000), mode.pick(15, 7, 2)
    how = f"timeit: best of 5 x {n} calls, {times} times"
    out = []
    for shape, client in (("mixin", MixinClient()), ("collaborator", CollaboratorClient())):
        samples = [min(timeit.repeat(client.send_heartbeat, number=n, repeat=5)) / n * 1e6 for _ in range(times)]
        out.append(Figure(id=f"client.shape.{shape}.b2b", what=f"a locked store through a {shape}, back-to-back",
                          unit="us", samples=samples, loop=loop, details={"how": how}))
    return out
