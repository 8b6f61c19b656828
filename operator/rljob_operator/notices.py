"""Checkpoint news as Events (pure): the driver's status.checkpoint, .export, .resumedFrom and
.checkpointFailure in, the Events not posted yet and the status.announced keys that say so out.

The operator posts each once: the key of what it announced is written to status.announced with
the write that precedes the Event, so a re-read of the same status, or an operator restart,
finds nothing new (docs/checkpoints.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rljob.api import REASON_CHECKPOINT_FAILED, CheckpointFailure
from rljob.report import bytes_text

REASON_CHECKPOINT_WRITTEN = "CheckpointWritten"
REASON_RESUMED = "ResumedFromCheckpoint"
REASON_EXPORT_WRITTEN = "ExportWritten"


@dataclass(frozen=True)
class Notice:
    """One Event to post: its status.announced key and value, type, reason and message."""

    key: str
    value: str
    type: str
    reason: str
    message: str


def _checkpoint(cp: Mapping[str, Any]) -> Notice:
    return Notice(
        "checkpoint",
        f"{cp['iteration']}/{cp.get('completedAt', '')}",
        "Normal",
        REASON_CHECKPOINT_WRITTEN,
        f"checkpoint of iteration {cp['iteration']} complete in {cp['path']} "
        f"({bytes_text(int(cp.get('bytes') or 0))}, {float(cp.get('seconds') or 0):.2f} s)",
    )


def _resumed(point: Mapping[str, Any]) -> Notice:
    attempt = point.get("attempt")
    return Notice(
        "resumedFrom",
        f"{attempt or '-'}/{point['iteration']}/{point['path']}",
        "Normal",
        REASON_RESUMED,
        (f"attempt {attempt} " if attempt else "")
        + f"resumed from the checkpoint of iteration {point['iteration']} ({point['path']})",
    )


def _export(export: Mapping[str, Any]) -> Notice:
    return Notice(
        "export",
        f"{export['iteration']}/{export['path']}",
        "Normal",
        REASON_EXPORT_WRITTEN,
        f"the policy after iteration {export['iteration']} exported to {export['path']}",
    )


def _failed(failure: Mapping[str, Any]) -> Notice:
    described = CheckpointFailure.model_validate(failure)
    return Notice(
        "checkpointFailure",
        f"{described.attempt or '-'}/{described.iteration}",
        "Warning",
        REASON_CHECKPOINT_FAILED,
        described.describe(),
    )


def pending(status: Mapping[str, Any]) -> list[Notice]:
    """The checkpoint news in `status` that status.announced does not hold yet."""
    announced = dict(status.get("announced") or {})
    found = []
    if status.get("resumedFrom"):
        found.append(_resumed(status["resumedFrom"]))
    if status.get("checkpoint"):
        found.append(_checkpoint(status["checkpoint"]))
    if status.get("export"):
        found.append(_export(status["export"]))
    if status.get("checkpointFailure"):
        found.append(_failed(status["checkpointFailure"]))
    return [n for n in found if announced.get(n.key) != n.value]


def announced_after(status: Mapping[str, Any], notices: list[Notice]) -> dict[str, str]:
    """status.announced once `notices` are posted (absent keys stay absent: an empty map is
    never written, so a job without checkpoints costs no write for it)."""
    return {**dict(status.get("announced") or {}), **{n.key: n.value for n in notices}}
