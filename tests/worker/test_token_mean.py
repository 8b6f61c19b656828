"""The loss is a global token-mean across ranks: with 2 gloo ranks whose responses hold unequal
numbers of tokens, one FSDP2 step gives the weights that one process gets from the global
token-mean of all responses together (a per-rank token-mean, averaged by FSDP, would not:
it weighs each of rank 0's 3 tokens 1/6 and each of rank 1's 5 tokens 1/10).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.bigram import Bigram
from support.ranks import gloo_rank, run_ranks

from rljob.api import RLJobSpec
from rljob_worker.policy_update import Experience, PolicyUpdate

pytestmark = pytest.mark.worker

WORLD = 2
VOCAB = 4
# Rank 0: 3 response tokens; rank 1: 5. One group of two responses on each rank.
EXPERIENCES = [
    Experience([[0], [1]], [[1, 2], [3]], [1.0, 0.0], [0, 0]),
    Experience([[2], [0]], [[3, 1, 0], [2, 2]], [0.0, 1.0], [0, 0]),
]
# The same responses in one process: rank 1's group gets its own id.
TOGETHER = Experience(
    [p for e in EXPERIENCES for p in e.prompt_ids],
    [r for e in EXPERIENCES for r in e.response_ids],
    [x for e in EXPERIENCES for x in e.rewards],
    [0, 0, 1, 1],
)


def _spec() -> RLJobSpec:
    # No gradient clipping in the way, no reference model: the step is the loss's gradient.
    return RLJobSpec.model_validate(
        {"algorithm": {"klCoef": 0}, "training": {"maxGradNorm": 1000, "microBatchSize": 1}}
    )


def _model() -> Bigram:
    torch.manual_seed(0)
    model = Bigram(VOCAB)
    with torch.no_grad():
        model.table.normal_()
    return model


def _update(model: torch.nn.Module) -> PolicyUpdate:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return PolicyUpdate(_spec(), model, None, optimizer, pad_id=0, device=torch.device("cpu"))


def _rank_main(rank: int, init_method: str, world: int, results: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with gloo_rank(rank, world, init_method, results) as out:
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        stats = _update(model).run(EXPERIENCES[rank])
        table = model.table
        assert isinstance(table, DTensor)  # sharded by fully_shard
        out["table"] = table.full_tensor().tolist()
        out["loss_sum"] = stats.policy_loss_sum


def test_two_ranks_with_unequal_tokens_step_as_the_global_token_mean() -> None:
    model = _model()
    stats = _update(model).run(TOGETHER)
    expected = model.table.detach()
    results = run_ranks(_rank_main, WORLD, WORLD)
    for rank in range(WORLD):
        assert "error" not in results[rank], results[rank]
        assert torch.allclose(torch.tensor(results[rank]["table"]), expected, atol=1e-6), rank
    # The ranks' loss sums add up to the single process's (the driver's division is the same).
    assert sum(results[r]["loss_sum"] for r in range(WORLD)) == pytest.approx(
        stats.policy_loss_sum, abs=1e-5
    )
    # And the step moved the weights: equality above is not two untouched tables.
    assert not torch.allclose(expected, _model().table.detach())
