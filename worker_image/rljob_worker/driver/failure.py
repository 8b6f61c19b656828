"""Why a job failed, in one line naming rank, node, stage and iteration (pure, no Ray, no I/O).

Used by the Ray driver; what a rank sent before it failed (its stage samples, its OOM record)
is all it needs, so the local driver can use it the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from rljob.api import WakeUp
from rljob.report import OOMRecord, Stage, StageSample
from rljob_worker.stages import stage_order

FailureKind = Literal["died", "raised", "ended"]
# Which failure is the cause when several ranks fail: a rank whose actor died (killed, crashed,
# node lost) never died because of another rank, while the ranks it leaves behind raise in their
# next collective; "ended" ranks were stopped by the driver.
_CAUSE_ORDER: dict[str, int] = {"died": 0, "raised": 1, "ended": 2}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A collective that failed because a peer went away: gloo's "Read error [...]: Connection reset
# by peer" (torch 2.14, a peer process that exited mid-all_reduce), "Connection closed by
# peer", NCCL's remote errors, torch's DistBackendError/DistNetworkError. A rank that raised
# this is an echo of another's failure, not its cause.
_COLLECTIVE_ECHO = re.compile(
    r"Connection (?:reset|closed) by peer|gloo/transport|DistBackendError|DistNetworkError"
    r"|NCCL communicator was aborted|remote process exited|NCCL error",
    re.IGNORECASE,
)
# Echoes and their cause are noticed together: the driver polls the ranks every POLL_SECONDS
# and takes every rank done in one poll at once, in rank order. A cause noticed up to this
# long after an echo is still its cause.
ECHO_WINDOW_SECONDS = 10.0


def plain(text: str) -> str:
    """`text` without terminal colour codes (Ray colours its error headers)."""
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class RankFailure:
    """A rank that ended the job: its actor died, it raised, or the driver ended it."""

    rank: int
    node: str
    how: FailureKind
    error: str
    detected_seconds: float


def headline(error: str) -> str:
    """The line of an error that says what happened (a traceback's last non-empty line)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else "no error text"


def position_at_failure(
    samples: Sequence[StageSample],
    wake_up: WakeUp,
    last_iteration: int,
    *,
    raised: bool,
    checkpoint_every: int = 0,
) -> tuple[int, Stage] | None:
    """(iteration, stage) a rank was in when it failed, from the samples it sent; None when it
    had not finished a stage yet.

    A stage's sample is sent when the stage ends, also when it ends by an exception: so a rank
    that raised was in the stage of its last sample, and one that died without a word was in the
    stage after it. `checkpoint_every` (spec.checkpoint.everyIterations; 0: no checkpoints)
    says which iterations have the checkpoint stage after train: a rank that died copying the
    training state to the host sent train's sample last.
    """
    if not samples:
        return None
    last = max(samples, key=lambda s: (s.iteration, s.start_seconds))
    if raised:
        return last.iteration, last.stage
    # A checkpoint iteration has the checkpoint stage after train (stages.stage_order).
    saves = checkpoint_every > 0 and last.iteration % checkpoint_every == 0
    order = stage_order(wake_up, last.iteration, checkpoint=saves or last.stage is Stage.CHECKPOINT)
    if last.stage not in order:
        return last.iteration, last.stage  # an order this rank did not run: say where it was
    following = order.index(last.stage) + 1
    if following < len(order):
        return last.iteration, order[following]
    if last.iteration < last_iteration:
        return last.iteration + 1, stage_order(wake_up, last.iteration + 1)[0]
    return last.iteration, last.stage  # past its last stage: shutting down


def describe_position(position: tuple[int, Stage] | None) -> str:
    if position is None:
        return "setup (before its first stage finished)"
    iteration, stage = position
    return f"stage {stage} of iteration {iteration}"


def is_collective_echo(error: str) -> bool:
    """`error` says a collective failed because a peer went away (_COLLECTIVE_ECHO)."""
    return _COLLECTIVE_ECHO.search(error) is not None


def _cause(failures: Iterable[RankFailure]) -> RankFailure | None:
    """The rank that died, else the first that raised, passing over a raise that only echoes a
    peer's going away when another rank raised something else within ECHO_WINDOW_SECONDS."""
    ordered = sorted(failures, key=lambda f: (_CAUSE_ORDER[f.how], f.detected_seconds))
    if not ordered:
        return None
    first = ordered[0]
    if first.how == "raised" and is_collective_echo(first.error):
        window = first.detected_seconds + ECHO_WINDOW_SECONDS
        return next(
            (
                f
                for f in ordered
                if f.how == "raised"
                and f.detected_seconds <= window
                and not is_collective_echo(f.error)
            ),
            first,
        )
    return first


def failure_reason(
    ooms: Sequence[OOMRecord],
    failures: Iterable[RankFailure],
    samples: Iterable[StageSample],
    wake_up: WakeUp,
    last_iteration: int,
    nodes: Mapping[int, str],
    checkpoint_every: int = 0,
) -> str | None:
    """The cause of a failed job: the first OOM, else the rank that died, else the first that
    raised (the others usually fail after it, in a collective: a raise that only says a peer
    went away yields to another's, _cause). None when nothing failed."""
    if ooms:
        oom = min(ooms, key=lambda o: o.time)
        return (
            f"rank {oom.rank} (node {oom.node or nodes.get(oom.rank or 0, '?')}) ran out "
            f"of memory in stage {oom.stage} of iteration {oom.iteration}: {oom.message}"
        )
    first = _cause(f for f in failures if f.how != "ended")
    if first is None:
        return None
    own = [s for s in samples if s.rank == first.rank]
    where = describe_position(
        position_at_failure(
            own,
            wake_up,
            last_iteration,
            raised=first.how != "died",
            checkpoint_every=checkpoint_every,
        )
    )
    verb = "died" if first.how == "died" else "failed"
    return f"rank {first.rank} (node {first.node}) {verb} in {where}: {headline(first.error)}"
