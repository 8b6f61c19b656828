"""The operator's per-RLJob memory in one process: a deleted RLJob leaves none of it behind
(its lock, the mirrored RayJob state), and the others keep theirs. Metrics: test_metrics.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rljob_operator import handlers

pytestmark = pytest.mark.unit


def _rayjob(uid: str) -> dict[str, object]:
    return {"metadata": {"name": "j", "uid": uid}, "status": {"jobStatus": "RUNNING"}}


def test_a_deleted_rljob_leaves_no_per_job_state_behind() -> None:
    for name in ("gone", "kept"):
        handlers._job_lock("ns", name)
        handlers.MIRRORED.remember("ns", name, _rayjob(name))
        handlers.CAUSES.observe("ns", name, f"pod/{name}-head", [])

    # kopf's decorator types the handler as its callback protocol (every kwarg required).
    changed: Any = handlers.rljob_changed
    changed(type="DELETED", body={}, name="gone", namespace="ns", logger=logging.getLogger("t"))

    assert ("ns", "gone") not in handlers._LOCKS
    assert not handlers.MIRRORED.holds("ns", "gone", _rayjob("gone"))
    assert handlers.CAUSES.current("ns", "gone") is None
    assert handlers.CAUSES.current("ns", "kept") == []
    assert ("ns", "kept") in handlers._LOCKS
    assert handlers.MIRRORED.holds("ns", "kept", _rayjob("kept"))
    # A lock taken again after the delete (a late event) is a fresh one, not an error.
    assert handlers._job_lock("ns", "gone") is handlers._LOCKS[("ns", "gone")]
