"""Which engine serves a conversation's turn: the least-loaded one for its first turn, then the
same one for every later turn (sticky), so its prefix stays in that engine's radix cache.

`random` routing (every turn anywhere) exists to measure what stickiness buys (bench/multi_turn.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import StrEnum
from typing import Generic, TypeVar

EngineT = TypeVar("EngineT")


class Routing(StrEnum):
    STICKY = "sticky"
    RANDOM = "random"


class EngineRouter(Generic[EngineT]):
    """Counts the requests in flight per engine; acquire() before a request, release() after."""

    def __init__(
        self, engines: Sequence[EngineT], routing: Routing = Routing.STICKY, seed: int = 0
    ) -> None:
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.routing = routing
        self.in_flight = [0] * len(engines)
        self.requests = [0] * len(engines)
        self._home: dict[int, int] = {}
        self._rng = random.Random(seed)

    def choose(self, conversation: int) -> int:
        if self.routing is Routing.RANDOM:
            return self._rng.randrange(len(self.engines))
        home = self._home.get(conversation)
        if home is None:
            # Least loaded now; on a tie the one with the fewest conversations, then the first.
            homes = list(self._home.values())
            home = min(
                range(len(self.engines)),
                key=lambda i: (self.in_flight[i], homes.count(i), i),
            )
            self._home[conversation] = home
        return home

    def acquire(self, conversation: int) -> tuple[int, EngineT]:
        index = self.choose(conversation)
        self.in_flight[index] += 1
        self.requests[index] += 1
        return index, self.engines[index]

    def release(self, index: int) -> None:
        if self.in_flight[index] <= 0:
            raise RuntimeError(f"engine {index}: released more requests than were acquired")
        self.in_flight[index] -= 1

    def forget(self, conversation: int) -> None:
        """The conversation ended: its engine no longer counts it."""
        self._home.pop(conversation, None)

    @property
    def conversations(self) -> int:
        """Conversations with a home engine: begun and not yet forgotten."""
        return len(self._home)

    @property
    def requests_in_flight(self) -> int:
        return sum(self.in_flight)
