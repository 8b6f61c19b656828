"""spec.checkpoint and spec.export: where and how often a job saves what a resumed run
needs, and where the trained policy is exported.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from rljob.api._base import _Spec, _with_rules
from rljob.api.volumes import NO_DOT_COMPONENTS_RULE

# A directory spelled one way only: no empty ('//'), '.' or '..' components, so that the rule
# keeping an export off the checkpoints (spec.py) compares what the worker's pathlib will open.
# '/data//ckpt' or '/data/ckpt/.' passed that rule as strings and named checkpoint.path itself.
DIRECTORY_PATTERN = r"^(?:/|/?[^/]+(?:/[^/]+)*/?)$"
Directory = Annotated[
    str,
    Field(pattern=DIRECTORY_PATTERN, min_length=1, max_length=4096),
    *_with_rules(NO_DOT_COMPONENTS_RULE),
]


class ResumeMode(StrEnum):
    AUTO = "Auto"
    NEVER = "Never"


class CheckpointMode(StrEnum):
    ASYNC = "Async"
    SYNC = "Sync"


class CheckpointSpec(_Spec):
    """Where and how often the job saves what a resumed run needs (docs/checkpoints.md)."""

    path: Directory = Field(
        description="A directory (in a mounted volume on a cluster): each checkpoint is a "
        "subdirectory iteration-NNNNNNNN, complete once its COMPLETE marker is written.",
    )
    every_iterations: int = Field(
        default=1, ge=1, description="Save after the train stage of every N-th iteration."
    )
    keep: int = Field(
        default=2,
        ge=1,
        description="The newest N complete checkpoints stay; an older one is deleted only after "
        "a newer one is complete.",
    )
    resume: ResumeMode = Field(
        default=ResumeMode.AUTO,
        description="Auto: a new attempt (or run) continues from the newest complete checkpoint "
        "under path. Never: always start at iteration 0.",
    )
    mode: CheckpointMode = Field(
        default=CheckpointMode.ASYNC,
        description="Async: the loop stops only to copy the training state to host memory; the "
        "files are written behind the next stages, complete once every rank's part and the "
        "marker are durable (the next save and the job's end wait for it). Sync: the checkpoint "
        "stage ends with the checkpoint complete.",
    )


class ExportSpec(_Spec):
    """The trained policy as a Hugging Face directory (safetensors, config.json, tokenizer)."""

    path: Directory = Field(
        description="Directory written at the end of the run (replaced atomically); with "
        "withCheckpoints, also as iteration-NNNNNNNN/ under it with each checkpoint. Not "
        "checkpoint.path nor a directory above it (the export would delete the checkpoints).",
    )
    with_checkpoints: bool = Field(
        default=False, description="Also export the policy with every checkpoint."
    )
