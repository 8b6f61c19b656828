"""A FAKE rollout engine for the multi-turn driver's unit tests: it answers each conversation's
turns from a script (text encoded with the real tokenizer), so tool calls, budgets and timeouts
happen when a test needs them. The real engines' async paths run in tests/worker (torch) and
tests/gpu (sglang)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from rljob_worker.engines.base import Completion, SamplingParams


class ScriptedEngine:
    """Answers `replies[prompt][k]` to the k-th request whose input starts with `prompt`."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        replies: dict[tuple[int, ...], list[str]],
        eos_id: int,
        delay_seconds: float = 0.0,
        cached_tokens: bool = False,
        delays: dict[tuple[int, ...], float] | None = None,
    ) -> None:
        self.encode, self.replies, self.eos_id = encode, replies, eos_id
        self.delay_seconds = delay_seconds
        self.delays = delays or {}  # per prompt, instead of delay_seconds
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.answers: list[tuple[tuple[int, ...], list[int]]] = []  # (prompt, sampled ids)
        self.in_flight = 0
        self.max_in_flight = 0
        self._seen: dict[tuple[int, ...], int] = {}
        self._cached_tokens = cached_tokens
        self._served: list[list[int]] = []
        # abort_requests(): a request sent before it and still in its delay answers the first
        # half of what is left of its reply, aborted; the next request of that turn the rest.
        self._aborts = 0
        self._given: dict[tuple[int, ...], int] = {}  # of the current turn's reply, per prompt
        self.aborted = 0

    def abort_requests(self) -> None:
        self._aborts += 1

    def _prompt_of(self, input_ids: Sequence[int]) -> tuple[int, ...]:
        matches = [p for p in self.replies if tuple(input_ids[: len(p)]) == p]
        if not matches:
            raise AssertionError("a request that starts with no scripted prompt")
        return max(matches, key=len)

    async def async_generate(
        self, input_ids: Sequence[int], sampling: SamplingParams
    ) -> Completion:
        self.requests.append((list(input_ids), sampling))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt = self._prompt_of(input_ids)
            delay = self.delays.get(prompt, self.delay_seconds)
            sent_at, waited, aborted = self._aborts, 0.0, False
            while True:
                await asyncio.sleep(min(0.001, delay - waited))
                waited += 0.001
                aborted = self._aborts > sent_at
                if aborted or waited >= delay:
                    break
            turn = self._seen.get(prompt, 0)
            reply = [*self.encode(self.replies[prompt][turn]), self.eos_id]
            rest = reply[self._given.get(prompt, 0) :]
            if aborted:
                ids = rest[: len(rest) // 2][: sampling.max_new_tokens]
                self._given[prompt] = self._given.get(prompt, 0) + len(ids)
                self.aborted += 1
            else:
                ids = rest[: sampling.max_new_tokens]
                self._seen[prompt] = turn + 1
                self._given.pop(prompt, None)
            self.answers.append((prompt, ids))
            cached = None
            if self._cached_tokens:  # the longest prefix this engine has served before
                cached = max((_common(s, input_ids) for s in self._served), default=0)
                self._served.append(list(input_ids) + ids)
            return Completion(ids, [-0.25] * len(ids), cached, aborted=aborted)
        finally:
            self.in_flight -= 1


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
