"""spec.rollout.multiTurn.partialRollout through the loop (2 ranks on gloo, torch engine,
staged): every iteration trains exactly its prompts' groups, the groups a rollout left under way
are paused and carried, and a checkpoint keeps them: a run resumed from it carries on with the
same conversations as the straight run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from support.model_cache import fresh_model_cache

from rljob.api import RLJobSpec, parse_manifest
from rljob_worker.checkpoint import ROLLOUT_KEY, checkpoint_dir
from rljob_worker.driver.local import LocalRun, run_local

REPO = Path(__file__).resolve().parents[2]
ITERATIONS, STOP = 3, 2


def _spec(root: Path, iterations: int) -> RLJobSpec:
    doc = yaml.safe_load((REPO / "examples" / "multi-turn-tools.yaml").read_text())
    spec = doc["spec"]
    spec["algorithm"]["iterations"] = iterations
    spec["data"].pop("validation")
    # 2 prompts a rank trained, 1 group more under way (0.5 x 2): with 8 conversations at once
    # the third group of each rollout waits, and the stop finds it not yet started.
    spec["rollout"]["multiTurn"]["partialRollout"] = {"overSample": 0.5}
    spec["checkpoint"] = {"path": str(root / "ckpt"), "everyIterations": 1, "keep": 10}
    return parse_manifest(doc)[1]


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from fresh_model_cache(tmp_path_factory)


def _state(root: Path, iteration: int, rank: int) -> dict[str, Any]:
    own = torch.load(checkpoint_dir(root / "ckpt", iteration) / f"rng-rank{rank}.pt",
                     weights_only=False)  # fmt: skip
    state: dict[str, Any] = own[ROLLOUT_KEY]
    return state


def _kept(state: dict[str, Any]) -> tuple[int, list[tuple[int, int, int]]]:
    return state["nextConversation"], [
        (t.conversation, t.group, len(t.response_ids)) for t in state["carried"]
    ]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LocalRun]:
    root = tmp_path_factory.mktemp("straight")
    run = run_local(_spec(root, ITERATIONS), 2, "cpu")
    assert run.ok, run.errors
    return root, run


def test_each_iteration_trains_its_groups_and_carries_the_rest(
    straight: tuple[Path, LocalRun],
) -> None:
    root, run = straight
    reports = sorted(run.reports, key=lambda r: r.iteration)
    assert [r.iteration for r in reports] == list(range(ITERATIONS + 1))
    for iteration in range(ITERATIONS + 1):
        # 2 prompts x groups of 4 a rank: exactly the trained groups, never the carried ones.
        ranks = [i for i in run.iterations if i.iteration == iteration]
        assert sorted(i.rank for i in ranks) == [0, 1]
        assert all(i.reward_count == 8 for i in ranks)
    # The first rollout left its third groups (4 conversations a rank) paused.
    first = reports[0].multi_turn
    assert first is not None and first.paused == 8
    for rank in (0, 1):
        following, carried = _kept(_state(root, 1, rank))
        assert carried and following > max(c for c, _, _ in carried)
        assert len({g for _, g, _ in carried}) == 1  # one group of 4 carried
        assert len(carried) == 4


def test_a_resumed_run_carries_on_with_the_checkpoints_conversations(
    straight: tuple[Path, LocalRun], tmp_path: Path
) -> None:
    straight_root, _ = straight
    first = run_local(_spec(tmp_path, STOP), 2, "cpu")
    assert first.ok, first.errors
    second = run_local(_spec(tmp_path, ITERATIONS), 2, "cpu")
    assert second.ok, second.errors
    assert second.resumed_from == STOP
    for rank in (0, 1):
        # What the resumed run's next checkpoint kept follows from what it resumed with, as in
        # the straight run: the same conversations carried, numbered from the same point (a run
        # that resumed without them starts over at 0 and carries others).
        assert _kept(_state(tmp_path, STOP, rank)) == _kept(_state(straight_root, STOP, rank))
        assert _kept(_state(tmp_path, ITERATIONS, rank)) == _kept(
            _state(straight_root, ITERATIONS, rank)
        )
