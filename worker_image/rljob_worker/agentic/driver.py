"""The multi-turn rollout: many conversations at once with asyncio over engines that take token
ids and give back token ids with their log-probs (base.AsyncGenerate).

A trajectory is token ids from the start: the prompt's, then each model turn's sampled ids (loss
mask 1, with their log-probs) and each tool turn's ids (mask 0). Every conversation ends with an
answer (a turn that calls no tool), or is cut off at maxResponseLength, at maxTurns or where the
model's context is full, and trained with what it has: none is dropped, and when run() returns no request is in flight, so the
engine may sleep (sglang refuses to release memory while a request is queued or running).

run_partial() (spec.rollout.multiTurn.partialRollout) does not wait for the slowest
conversations: once enough whole groups have ended it stops the engines' requests and returns the
rest paused, mid-turn or between turns, to go on in the next rollout from where they stopped
(their sampled tokens kept, with the log-probs of the policy that sampled them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.routing import EngineRouter
from rljob_worker.agentic.tool_calls import ParsedCall, parse_tool_calls
from rljob_worker.agentic.tools import ToolSet
from rljob_worker.engines.base import AsyncGenerate, Completion, SamplingParams, request_seed

log = logging.getLogger(__name__)


class Ending(StrEnum):
    ANSWER = "answer"  # a turn without a tool call
    BUDGET = "budget"  # maxResponseLength reached (cut off)
    MAX_TURNS = "maxTurns"  # still calling tools after maxTurns turns (cut off)
    CONTEXT = "context"  # prompt and turns fill the model's context (cut off)


@dataclass
class Trajectory:
    """One conversation as the trainer gets it. `logprobs` has one entry per sampled token
    (mask 1), in order; `response_ids` is everything after the prompt."""

    conversation: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    truncated_tool_results: int = 0
    ending: Ending | None = None
    last_turn_text: str = ""  # the final model turn, decoded: what the reward reads
    tool_results: list[str] = field(default_factory=list)  # every call's answer, in order
    # Prompt tokens sent over all turns, and those the engine had cached (None: not reported).
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    engines: list[int] = field(default_factory=list)  # the engine of each request
    seconds: float = 0.0  # from its first request to its end (over the rollouts it ran in)
    finished_seconds: float = 0.0  # from the rollout's start to its end (stragglers)
    # The partial rollout (run_partial): the prompt's group (its GRPO group: trained together),
    # the rollouts the conversation ran in (more than 1: it was paused and went on, so its
    # tokens come from more than one policy), and where a model turn a stop cut begins in
    # response_ids (None: no turn is open; the next request starts a new turn).
    group: int = 0
    rollouts: int = 0
    turn_start: int | None = None

    @property
    def cut_off(self) -> bool:
        return self.ending in (Ending.BUDGET, Ending.MAX_TURNS, Ending.CONTEXT)

    def append(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] = ()) -> None:
        self.response_ids += ids
        self.loss_mask += [1 if sampled else 0] * len(ids)
        self.logprobs += logprobs


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_response_length: int
    max_tool_response_length: int
    max_concurrent_conversations: int
    # Tokens one model turn may sample (None: what is left of max_response_length).
    max_turn_tokens: int | None = None
    # The model's context (max_position_embeddings): a request never asks past it (sglang refuses
    # one that does, failing the rollout); None: no limit.
    context_length: int | None = None

    def room(self, tokens: int) -> int | None:
        """Tokens a request of `tokens` ids may still sample within the context (None: no limit)."""
        return None if self.context_length is None else self.context_length - tokens

    def full(self, tokens: int) -> bool:
        """Whether `tokens` ids leave no room in the context for one more."""
        room = self.room(tokens)
        return room is not None and room <= 0


@dataclass(frozen=True)
class RolloutCounts:
    """One rank's multi-turn rollout in figures (status and the `rljob run` table)."""

    conversations: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    cut_off: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    # Conversations in which a tool's result was the problem's answer: the tool was called
    # correctly (what the model then wrote is the reward's business).
    answer_from_tool: int = 0
    # Partial rollout: trained conversations that ran in more than one rollout (paused, then
    # went on), and conversations left paused for the next rollout.
    resumed: int = 0
    paused: int = 0

    @classmethod
    def of(
        cls,
        trajectories: Sequence[Trajectory],
        answers: Sequence[str] | None = None,
        paused: int = 0,
    ) -> RolloutCounts:
        """The figures of `trajectories`; `answers` (one per trajectory, the ground truth as
        text) counts those a tool answered; `paused`: conversations carried to the next
        rollout (not among `trajectories`)."""
        cached = [t.cached_tokens for t in trajectories if t.cached_tokens is not None]
        if answers is not None and len(answers) != len(trajectories):
            raise ValueError(f"{len(answers)} answers for {len(trajectories)} trajectories")
        answered = sum(
            any(result.strip() == answer.strip() for result in t.tool_results)
            for t, answer in zip(trajectories, answers or (), strict=False)
        )
        return cls(
            conversations=len(trajectories),
            turns=sum(t.turns for t in trajectories),
            tool_calls=sum(t.tool_calls for t in trajectories),
            tool_errors=sum(t.tool_errors for t in trajectories),
            tool_timeouts=sum(t.tool_timeouts for t in trajectories),
            cut_off=sum(t.cut_off for t in trajectories),
            prompt_tokens=sum(t.prompt_tokens for t in trajectories),
            cached_tokens=sum(cached) if cached else None,
            answer_from_tool=answered,
            resumed=sum(t.rollouts > 1 for t in trajectories),
            paused=paused,
        )


@dataclass(frozen=True)
class PartialRollout:
    """What run_partial gives: `trained`, the oldest whole groups that ended (as many as were
    asked for), and `carried`, every other conversation (paused, or of an ended group beyond
    those) for the next rollout, to be passed back in first."""

    trained: list[Trajectory]
    carried: list[Trajectory]

    @property
    def paused(self) -> int:
        return sum(t.ending is None for t in self.carried)


class MultiTurnRollout:
    """Drives conversations over the router's engines; run() (async) or run_turn_by_turn()
    (the synchronous baseline: every conversation's turn k as one batch, then its tools)."""

    def __init__(
        self,
        router: EngineRouter[AsyncGenerate],
        chat: ChatFormat,
        tools: ToolSet,
        limits: Limits,
        eos_ids: Sequence[int],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.router, self.chat, self.tools, self.limits = router, chat, tools, limits
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode
        # run_partial's stop: no conversation sends another request once it is set.
        self._stopping = False

    async def _model_turn(
        self, t: Trajectory, sampling: SamplingParams
    ) -> tuple[list[ParsedCall], bool]:
        """One model turn (or the rest of one a stop cut); the calls it makes and whether it
        ended with end-of-sequence. A request the stop aborts leaves the turn open
        (t.turn_start), its tokens kept."""
        start = len(t.response_ids) if t.turn_start is None else t.turn_start
        had = len(t.response_ids) - start  # sampled before a stop cut this turn
        remaining = self.limits.max_response_length - len(t.response_ids)
        turn_tokens = self.turn_tokens(t)
        if turn_tokens is not None:
            remaining = min(remaining, turn_tokens - had)
        input_ids = t.prompt_ids + t.response_ids
        room = self.limits.room(len(input_ids))
        if room is not None:
            remaining = min(remaining, room)
        if remaining <= 0 and had == 0:  # a prompt that fills the context on its own
            t.ending, t.turn_start = Ending.CONTEXT, None
            return [], False
        answer = Completion([], [])  # a cut turn that had all its tokens: nothing to ask
        if remaining > 0:
            seed = None
            # A stream of its own per (batch seed, conversation, turn).
            if sampling.seed is not None:
                seed = request_seed(sampling.seed, t.conversation * self.limits.max_turns + t.turns)
            request = dataclasses.replace(sampling, max_new_tokens=remaining, seed=seed)
            index, engine = self.router.acquire(t.conversation)
            try:
                answer = await engine.async_generate(input_ids, request)
            finally:
                self.router.release(index)
            t.engines.append(index)
            if not (answer.aborted and not answer.token_ids):  # one aborted before its prefill
                t.prompt_tokens += len(input_ids)  # sent no prompt through the engine
                if answer.cached_tokens is not None:
                    t.cached_tokens = (t.cached_tokens or 0) + answer.cached_tokens
        ids = list(answer.token_ids[: max(remaining, 0)])
        t.append(ids, sampled=True, logprobs=answer.logprobs[: len(ids)])
        # Cut by run_partial's stop: the next rollout goes on from here. An abort nobody asked
        # for (the engine's own) ends the turn with what it has, as before the partial rollout.
        cut = answer.aborted and self._stopping
        if cut and len(ids) < remaining and not (ids and ids[-1] in self.eos_ids):
            t.turn_start = start
            return [], False
        t.turn_start = None
        turn = t.response_ids[start:]
        t.turns += 1
        ended_with_eos = bool(turn) and turn[-1] in self.eos_ids
        t.last_turn_text = self.decode(turn)  # decoded once: parsed and (last turn) rewarded
        if len(t.response_ids) >= self.limits.max_response_length and not ended_with_eos:
            t.ending = Ending.BUDGET
            return [], ended_with_eos
        if self.limits.full(len(t.prompt_ids) + len(t.response_ids)) and not ended_with_eos:
            t.ending = Ending.CONTEXT
            return [], ended_with_eos
        calls = self.calls_of(t)
        if not calls:
            t.ending = Ending.ANSWER
        elif t.turns >= self.limits.max_turns:
            t.ending = Ending.MAX_TURNS
        return calls, ended_with_eos

    def turn_tokens(self, t: Trajectory) -> int | None:
        """Tokens the next turn of `t` may sample, besides the budget (the bench varies it)."""
        return self.limits.max_turn_tokens

    def calls_of(self, t: Trajectory) -> list[ParsedCall]:
        """The tool calls of the turn just sampled (the bench overrides it to fix turn counts)."""
        return parse_tool_calls(t.last_turn_text, self.tools.names)

    async def _tool_turn(
        self, t: Trajectory, calls: list[ParsedCall], ended_with_eos: bool
    ) -> None:
        outcomes = await asyncio.gather(*(self.tools.run(c) for c in calls))
        t.tool_calls += len(calls)
        t.tool_results += [o.text for o in outcomes]
        t.tool_errors += sum(o.error for o in outcomes)
        t.tool_timeouts += sum(o.timed_out for o in outcomes)
        # The template's end of turn is left out only as far as the model sampled it.
        sampled_end = self.chat.token_text(t.response_ids[-1]) if ended_with_eos else ""
        turn = self.chat.tool_turn(
            [o.text for o in outcomes], sampled_end, self.limits.max_tool_response_length
        )
        t.truncated_tool_results += turn.truncated_results
        # Room for the tool turn and at least one more sampled token, or the conversation ends
        # here (the tool tokens would only be masked out).
        if len(t.response_ids) + len(turn.ids) >= self.limits.max_response_length:
            t.ending = Ending.BUDGET
            return
        if self.limits.full(len(t.prompt_ids) + len(t.response_ids) + len(turn.ids)):
            t.ending = Ending.CONTEXT
            return
        t.append(turn.ids, sampled=False)

    async def _conversation(
        self,
        t: Trajectory,
        sampling: SamplingParams,
        slots: asyncio.Semaphore,
        began: float,
        ended: Callable[[Trajectory], None] | None = None,
    ) -> Trajectory:
        """`t` to its end, or (run_partial) to the stop: paused within a model turn or before
        the next one (a tool turn under way finishes first)."""
        async with slots:
            if self._stopping:
                return t
            t.rollouts += 1
            start = time.perf_counter()
            try:
                while t.ending is None and not self._stopping:
                    calls, ended_with_eos = await self._model_turn(t, sampling)
                    if t.ending is None and t.turn_start is None:
                        await self._tool_turn(t, calls, ended_with_eos)
            finally:
                self.router.forget(t.conversation)
                end = time.perf_counter()
                t.seconds += end - start
                t.finished_seconds = end - began
            if t.ending is not None and ended is not None:
                ended(t)
        return t

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        group_size: int = 1,
        first: int = 0,
        first_group: int | None = None,
    ) -> list[Trajectory]:
        """New conversations of `prompts`, numbered from `first` (a number is its identity: its
        sticky engine, its requests' seeds), `group_size` consecutive ones a group, the groups
        numbered from `first_group` (None: first // group_size)."""
        base = first // group_size if first_group is None else first_group
        return [
            Trajectory(first + i, list(p), group=base + i // group_size)
            for i, p in enumerate(prompts)
        ]

    async def run(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Trajectory]:
        """Every conversation to its end, at most maxConcurrentConversations at a time."""
        slots = asyncio.Semaphore(self.limits.max_concurrent_conversations)
        trajectories = self.start(prompts)
        began = time.perf_counter()
        try:
            await self._all([self._conversation(t, sampling, slots, began) for t in trajectories])
        finally:
            self._stopping = False
        self._check_idle()
        return trajectories

    async def _all(self, conversations: Sequence[Awaitable[Trajectory]]) -> None:
        """Await every conversation. If one fails, stop the others before raising (abort their
        requests, cancel and await them), so that none sends a request after the rollout:
        sglang's loop runs what is left of its tasks again at its next call. The caller resets
        the stop flag this sets."""
        tasks = [asyncio.ensure_future(c) for c in conversations]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            self._stopping = True
            self._abort(self._engines())
            for conversation in tasks:
                conversation.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def run_partial(
        self, trajectories: Sequence[Trajectory], sampling: SamplingParams, groups: int
    ) -> PartialRollout:
        """The partial rollout: run the conversations of `trajectories` (the previous run's
        carried ones first, then new ones from start()) until `groups` whole groups have ended,
        then stop the rest: the engines abort their requests (each keeps the tokens it has
        sampled), tool turns under way finish, and no new request is sent. Returns the
        `groups` oldest ended groups to train and everything else to carry. No request is in
        flight when it returns."""
        members: dict[int, list[Trajectory]] = {}
        for t in trajectories:
            members.setdefault(t.group, []).append(t)
        if groups > len(members):
            raise ValueError(f"{groups} groups to train from {len(members)} groups")
        open_ = {g: sum(t.ending is None for t in ts) for g, ts in members.items()}
        ended_groups = sum(n == 0 for n in open_.values())
        self._stopping = ended_groups >= groups
        stopper: list[asyncio.Task[None]] = []

        def ended(t: Trajectory) -> None:
            nonlocal ended_groups
            open_[t.group] -= 1
            if open_[t.group] == 0:
                ended_groups += 1
                if ended_groups >= groups and not self._stopping:
                    self._stopping = True
                    stopper.append(asyncio.ensure_future(self._abort_until_idle()))

        slots = asyncio.Semaphore(self.limits.max_concurrent_conversations)
        began = time.perf_counter()
        try:
            await self._all([
                self._conversation(t, sampling, slots, began, ended)
                for t in trajectories
                if t.ending is None
            ])  # fmt: skip
        finally:
            for stop in stopper:
                stop.cancel()
            self._stopping = False
        self._check_idle()
        done = sorted(g for g, n in open_.items() if n == 0)[:groups]
        chosen = set(done)
        trained = [t for g in done for t in members[g]]
        carried = [t for t in trajectories if t.group not in chosen]
        return PartialRollout(trained, carried)

    async def _abort_until_idle(self) -> None:
        """The stop: abort every engine's requests, and again every 50 ms for any request sent
        just before the stop that an engine had not yet registered when the abort came."""
        engines = self._engines()
        while True:
            self._abort(engines)
            await asyncio.sleep(0.05)
            if not self.router.requests_in_flight:
                return

    def _engines(self) -> list[AsyncGenerate]:
        return list({id(e): e for e in self.router.engines}.values())

    @staticmethod
    def _abort(engines: Sequence[AsyncGenerate]) -> None:
        for engine in engines:
            try:
                engine.abort_requests()
            except Exception:  # the stop goes on: each conversation then ends its own turn
                log.exception("abort_requests() of %r failed", engine)

    async def run_turn_by_turn(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Trajectory]:
        """spec.rollout.multiTurn.schedule turnByTurn (and the bench's baseline): turn k of the
        open conversations, maxConcurrentConversations at a time, each group's answers and then
        its tools before the next group; turn k+1 once every group has had turn k."""
        trajectories = self.start(prompts)
        start = time.perf_counter()
        size = self.limits.max_concurrent_conversations
        while open_ := [t for t in trajectories if t.ending is None]:
            for part in range(0, len(open_), size):
                batch = open_[part : part + size]
                turns = await asyncio.gather(*(self._model_turn(t, sampling) for t in batch))
                await asyncio.gather(
                    *(
                        self._tool_turn(t, calls, eos)
                        for t, (calls, eos) in zip(batch, turns, strict=True)
                        if t.ending is None
                    )
                )
                now = time.perf_counter()
                for t in batch:
                    if t.ending is not None and not t.seconds:
                        t.seconds = t.finished_seconds = now - start
                        self.router.forget(t.conversation)
        self._check_idle()
        return trajectories

    def _check_idle(self) -> None:
        # What staged awake relies on: the engines may sleep once the rollout returns.
        if self.router.requests_in_flight:
            raise RuntimeError(
                f"multi-turn rollout ended with {self.router.requests_in_flight} requests in "
                "flight; the engine must not sleep now"
            )


def run_on(engine: Any, coroutine: Any) -> Any:
    """Run the rollout's coroutine to its end from the stage machine's (blocking) code: on the
    engine's own event loop where it has one (sglang's tokenizer manager lives on it)."""
    runner = getattr(engine, "run_async", None)
    if runner is not None:
        return runner(coroutine)
    return asyncio.run(coroutine)
