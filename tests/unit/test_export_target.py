"""Where an export may not go (export.export_target_problem): at or above the checkpoints, the
model's directory or the data file, however the path is spelled or linked, since an export
replaces its directory whole at the job's end."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob.api import RLJobSpec
from rljob_worker.export import export_target_problem

pytestmark = pytest.mark.unit


def _spec(
    export: str, checkpoint: str | None = None, data: str = "builtin:arithmetic"
) -> RLJobSpec:
    fields: dict[str, object] = {"export": {"path": export}, "data": {"source": data}}
    if checkpoint is not None:
        fields["checkpoint"] = {"path": checkpoint}
    return RLJobSpec.model_validate(fields)


def test_an_export_over_what_the_job_keeps_or_reads_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "volume" / "models" / "qwen"
    model.mkdir(parents=True)
    data = tmp_path / "volume" / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (tmp_path / "link").symlink_to(tmp_path / "volume")
    refused = {
        # spellings admission cannot compare (relative against absolute, through a link) that
        # resolve to the checkpoints' directory or one above it
        (str(tmp_path / "out"), "out/ckpt"): "spec.checkpoint.path",
        ("link/ckpt", str(tmp_path / "volume" / "ckpt")): "spec.checkpoint.path",
        # the base model a resume reloads, and the data file
        (str(tmp_path / "volume" / "models"), None): "the model's directory",
        ("link/data", None): "spec.data.source",
    }
    for (export, checkpoint), what in refused.items():
        problem = export_target_problem(_spec(export, checkpoint, str(data)), model)
        assert problem is not None and what in problem, (export, checkpoint, problem)
    allowed = [
        ("out/export", "out/ckpt"),
        ("out/ckpt/final", "out/ckpt"),  # below the checkpoints is fine
        (str(tmp_path / "volume" / "models" / "qwen-trained"), None),
    ]
    for export, checkpoint in allowed:
        assert export_target_problem(_spec(export, checkpoint, str(data)), model) is None
    # A hub id is no directory here: nothing to guard.
    assert export_target_problem(_spec(str(tmp_path)), "Qwen/Qwen2.5-0.5B-Instruct") is None
