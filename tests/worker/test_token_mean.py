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
from rljob_worker.policy_update import Experience, PolicyUpdate, pack_rows

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


# Micro-batches packed by length (PolicyUpdate.micro_batches), microBatchSize 1: rank 0's rows
# are all 2 tokens long (4 micro-batches of one row), rank 1's are 4, 2, 2, 2 (its budget is one
# row of 4: [4], [2, 2], [2], 3 micro-batches). The counts are agreed (4 each), since FSDP2
# runs collectives per micro-batch.
PACKED = [
    Experience([[0], [1], [2], [3]], [[1], [2], [3], [0]], [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1]),
    Experience(
        [[2], [0], [1], [3]], [[3, 1, 0], [2], [1], [3]], [0.0, 1.0, 1.0, 0.0], [0, 0, 1, 1]
    ),
]
PACKED_TOGETHER = Experience(
    [p for e in PACKED for p in e.prompt_ids],
    [r for e in PACKED for r in e.response_ids],
    [x for e in PACKED for x in e.rewards],
    [0, 0, 1, 1, 2, 2, 3, 3],
)


def _packed_rank_main(rank: int, init_method: str, world: int, results: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with gloo_rank(rank, world, init_method, results) as out:
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        update = _update(model)
        mine = PACKED[rank]
        lengths = mine.sequence_lengths()
        out["local"] = len(pack_rows(lengths, range(4), max(lengths)))  # microBatchSize 1
        out["agreed"] = len(update.micro_batches(mine, [[0, 1, 2, 3]])[0])  # collective
        forwards = []
        model.register_forward_hook(lambda *_: forwards.append(1))
        update.run(PACKED[rank])
        table = model.table
        assert isinstance(table, DTensor)
        out["table"] = table.full_tensor().tolist()
        out["forwards"] = len(forwards)


def test_ranks_packing_unequal_lengths_run_as_many_micro_batches_and_step_as_one() -> None:
    model = _model()
    unpacked = PolicyUpdate(
        _spec(), model, None, torch.optim.SGD(model.parameters(), lr=0.5),
        pad_id=0, device=torch.device("cpu"), pack=False,
    )  # fmt: skip
    unpacked.run(PACKED_TOGETHER)
    expected = model.table.detach()
    results = run_ranks(_packed_rank_main, WORLD, WORLD)
    for rank in range(WORLD):
        assert "error" not in results[rank], results[rank]
        assert torch.allclose(torch.tensor(results[rank]["table"]), expected, atol=1e-6), rank
    # Packed alone, the ranks would disagree (4 against 3): they ran the agreed count, twice
    # (the old log-probs' pass and the step's), and the step is the unpacked one's.
    assert [results[r]["local"] for r in range(WORLD)] == [4, 3]
    assert [results[r]["agreed"] for r in range(WORLD)] == [4, 4]
    assert [results[r]["forwards"] for r in range(WORLD)] == [8, 8]
    assert not torch.allclose(expected, _model().table.detach())


def test_right_padded_rows_need_no_attention_mask() -> None:
    """forward_logprobs gives the model no mask (so SDPA can take its causal kernel): on the
    tiny Qwen2, every real token's log-prob equals the masked forward's, and a left-padded row
    (where the mask matters) would not."""
    from rljob_worker.model import load_causal_lm, resolve_model_path
    from rljob_worker.policy_update import forward_logprobs, response_batch
    from rljob_worker.rl_math import token_logprobs

    model = load_causal_lm(resolve_model_path("builtin:tiny-qwen2"), torch.float32).eval()
    experience = Experience([[5, 6, 7], [8]], [[9, 10, 11, 12], [13, 14]], [1.0, 0.0], [0, 0])
    batch = response_batch(experience, [0, 1], pad_id=0, device=torch.device("cpu"))
    assert batch.attention[1].tolist() == [1, 1, 1, 0, 0, 0, 0]  # row 1 is right-padded
    with torch.no_grad():
        unmasked = forward_logprobs(model, batch, temperature=0.7).logprobs
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits
        masked = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], 0.7).logprobs
        assert torch.allclose(unmasked[batch.mask], masked[batch.mask], atol=1e-5)
        # The same row padded on the left is another computation without its mask.
        left = torch.tensor([[0, 0, 0, 8, 13, 14]])
        with_mask = model(input_ids=left, attention_mask=(left != 0).long()).logits[0, -1]
        without = model(input_ids=left).logits[0, -1]
        assert not torch.allclose(with_mask, without, atol=1e-3)
