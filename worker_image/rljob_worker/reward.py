"""Scoring responses: the builtin rewards (rewards.py) in this process, a user's function in a
child process (reward_child.py) that a timeout can end, and spec.reward.onError.

Every function has verl's signature (data_source, solution_str, ground_truth, extra_info) and
returns a number or {"score": number, ...}. A call that raises, hangs past timeoutSeconds or
returns anything else either fails the job (RewardError, naming the row and the response) or,
with onError Zero, scores 0 and is counted.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Any, Protocol

from rljob.api import RewardOnError, RewardSpec
from rljob_worker.rewards import BUILTINS, RewardValueError, score_of
from rljob_worker.task import Problem

# Importing a user's module (sympy, math_verify) can take far longer than one call.
LOAD_TIMEOUT_SECONDS = 120.0
EXCERPT_CHARACTERS = 160


class RewardError(RuntimeError):
    """A reward call failed with spec.reward.onError Fail; one line (the job's status shows the
    last line of a rank's error): the row, the response's excerpt and what went wrong."""


class RewardLoadError(ValueError):
    """spec.reward.function cannot be loaded (missing file, module or name)."""


@dataclass(frozen=True)
class Scored:
    """A call's outcome: a score (and its extra metrics), or why there is none."""

    score: float = 0.0
    extras: dict[str, float] | None = None
    error: str | None = None


class RewardCaller(Protocol):
    def __call__(self, data_source: str, solution: str, truth: Any, extra: Any) -> Scored: ...

    def close(self) -> None: ...


class InProcess:
    """A builtin: ours, bounded and fast, so no process and no timeout."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, data_source: str, solution: str, truth: Any, extra: Any) -> Scored:
        try:
            score, extras = score_of(self.function(data_source, solution, truth, extra))
        except Exception as error:  # the builtins raise on a ground truth they cannot read
            return Scored(error=f"{type(error).__name__}: {error}")
        return Scored(score, extras)

    def close(self) -> None:
        pass


class ChildProcess:
    """A user function in its own process, so that a call past its deadline can be ended (a
    thread cannot be; a regex that backtracks holds the GIL, so even the deadline would wait),
    and so that its crash, exit or prints do not touch the rank. One per rank, restarted after
    a timeout or a death; arguments and results travel pickled over a socket pair."""

    def __init__(self, function: str, timeout_seconds: float) -> None:
        self.function, self.timeout_seconds = function, timeout_seconds
        self.process: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = Pipe(duplex=True)
        # The child imports modules from this rank's path (the image's packages, Ray's
        # working_dir), not only from its own default path.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        child_end = theirs.fileno()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rljob_worker.reward_child", str(child_end), self.function],
            pass_fds=(child_end,),
            env=env,
        )
        theirs.close()
        self.conn = ours
        reply = self._reply(LOAD_TIMEOUT_SECONDS)
        if reply is None or reply[0] != "ready":
            self.close()
            why = reply[1] if reply else f"it did not load within {LOAD_TIMEOUT_SECONDS:.0f} s"
            raise RewardLoadError(f"spec.reward.function {self.function}: {why}")

    def _reply(self, timeout: float) -> tuple[Any, ...] | None:
        """The child's next message; None past `timeout`; ('died', why) when it is gone."""
        assert self.conn is not None and self.process is not None
        try:
            if not self.conn.poll(timeout):
                return None
            reply: tuple[Any, ...] = self.conn.recv()
            return reply
        except (EOFError, OSError):
            code = self.process.wait(timeout=10)
            return ("died", f"the reward process exited with code {code}")

    def __call__(self, data_source: str, solution: str, truth: Any, extra: Any) -> Scored:
        if self.process is None or self.process.poll() is not None:
            self._start()
        assert self.conn is not None
        try:
            self.conn.send((data_source, solution, truth, dict(extra)))
        except (BrokenPipeError, OSError):
            reply: tuple[Any, ...] | None = ("died", "the reward process is gone")
        else:
            reply = self._reply(self.timeout_seconds)
        if reply is None:
            self.close()  # ended, not waited for; the next call starts a fresh one
            return Scored(error=f"timed out after {self.timeout_seconds:g} s "
                                "(spec.reward.timeoutSeconds)")  # fmt: skip
        if reply[0] == "ok":
            return Scored(reply[1], reply[2])
        if reply[0] == "died":
            self.close()
        return Scored(error=reply[1])

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def make_caller(reward: RewardSpec) -> RewardCaller:
    """A builtin by name, else FILE_OR_MODULE:callable loaded in a child (RewardLoadError)."""
    if reward.function in BUILTINS:
        return InProcess(BUILTINS[reward.function])
    return ChildProcess(reward.function, reward.timeout_seconds)


def excerpt(text: str, limit: int = EXCERPT_CHARACTERS) -> str:
    """The response, shortened to its start and end, quoted on one line."""
    if len(text) > limit:
        text = f"{text[: limit * 2 // 3]} [...] {text[-limit // 3 :]}"
    return repr(text)


@dataclass(frozen=True)
class RewardBatch:
    scores: list[float]
    errors: int  # calls scored 0 under onError Zero


class Scorer:
    """spec.reward applied to a rollout's responses: a user function over parallelCalls child
    processes, each call taking whichever is free (a call that hangs holds one process up to
    timeoutSeconds, not the others)."""

    def __init__(self, reward: RewardSpec) -> None:
        self.spec = reward
        count = 1 if reward.function in BUILTINS else reward.parallel_calls
        self.callers: list[RewardCaller] = []
        self._pool: ThreadPoolExecutor | None = None
        if count == 1:
            self.callers.append(make_caller(reward))
            return
        self._pool = ThreadPoolExecutor(count, thread_name_prefix="rljob-reward")
        started = [self._pool.submit(make_caller, reward) for _ in range(count)]
        failed: BaseException | None = None
        for future in started:  # every child loads at once; all are closed if one fails
            try:
                self.callers.append(future.result())
            except BaseException as error:
                failed = failed or error
        if failed is not None:
            self.close()
            raise failed
        self._idle: queue.SimpleQueue[RewardCaller] = queue.SimpleQueue()
        for caller in self.callers:
            self._idle.put(caller)

    def _one(self, problem: Problem, response: str) -> Scored:
        caller = self._idle.get()
        try:
            return caller(problem.data_source, response, problem.answer, problem.extra_info)
        finally:
            self._idle.put(caller)

    def _failed(self, problem: Problem, response: str, scored: Scored) -> RewardError:
        return RewardError(
            f"spec.reward.function {self.spec.function} failed on {problem.where}, "
            f"response {excerpt(response)}: {' '.join(str(scored.error).split())} "
            "(spec.reward.onError: Zero would score it 0 and count it)"
        )

    def _scored(self, problems: Sequence[Problem], responses: Sequence[str]) -> list[Scored]:
        """Every response's outcome, in order. With onError Fail the first failure ends the
        batch at once: the calls not yet begun are not made (those running end within their
        timeoutSeconds)."""
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems for {len(responses)} responses")
        fail = self.spec.on_error is RewardOnError.FAIL
        if self._pool is None:
            [call] = self.callers
            outcomes = []
            for problem, response in zip(problems, responses, strict=True):
                scored = call(problem.data_source, response, problem.answer, problem.extra_info)
                if fail and scored.error is not None:
                    raise self._failed(problem, response, scored)
                outcomes.append(scored)
            return outcomes
        futures = {
            self._pool.submit(self._one, problem, response): index
            for index, (problem, response) in enumerate(zip(problems, responses, strict=True))
        }
        done: dict[int, Scored] = {}
        try:
            for future in as_completed(futures):  # the first failure to end, not the first row
                index, scored = futures[future], future.result()
                if fail and scored.error is not None:
                    raise self._failed(problems[index], responses[index], scored)
                done[index] = scored
        finally:
            for future in futures:
                future.cancel()  # a no-op once all have ended
        return [done[index] for index in range(len(problems))]

    def __call__(self, problems: Sequence[Problem], responses: Sequence[str]) -> RewardBatch:
        outcomes = self._scored(problems, responses)  # raises at once with onError Fail
        scores = [0.0 if s.error is not None else s.score for s in outcomes]
        return RewardBatch(scores, sum(s.error is not None for s in outcomes))

    def close(self) -> None:
        for caller in self.callers:
            caller.close()
        if self._pool is not None:
            self._pool.shutdown()


__all__ = ["RewardBatch", "RewardError", "RewardLoadError", "RewardValueError", "Scorer"]
