"""Micro-batches packed by length (policy_update.pack_rows, split_to): every row once, within
the padded-token budget, longest first, and cut to the count the ranks agreed on."""

from __future__ import annotations

import pytest
import torch

from rljob.api import RLJobSpec
from rljob_worker.policy_update import Experience, PolicyUpdate, pack_rows, split_to

LENGTHS = [7, 3, 3, 2, 9, 1, 3, 2]


def _padded(batch: list[int]) -> int:
    return len(batch) * max(LENGTHS[row] for row in batch)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        # Longest first; a micro-batch closes when one more row would pad past the budget.
        (9, [[4], [0], [1, 2, 6], [3, 7, 5]]),
        (18, [[4, 0], [1, 2, 6, 3, 7, 5]]),
        # A row longer than the budget goes alone, and the rest still pack.
        (4, [[4], [0], [1], [2], [6], [3, 7], [5]]),
    ],
)
def test_rows_pack_longest_first_within_the_budget(budget: int, expected: list[list[int]]) -> None:
    packed = pack_rows(LENGTHS, range(len(LENGTHS)), budget)
    assert packed == expected
    assert sorted(r for batch in packed for r in batch) == list(range(len(LENGTHS)))
    assert all(_padded(b) <= budget for b in packed if len(b) > 1)


def test_split_to_halves_the_fullest_until_the_agreed_count() -> None:
    packed = pack_rows(LENGTHS, range(len(LENGTHS)), 18)  # [[4, 0], [1, 2, 6, 3, 7, 5]]
    split = split_to(packed, LENGTHS, 4)
    # [1, 2, 6, 3, 7, 5] pads 18 tokens, [4, 0] 18 too: the first of them halves first, then the
    # fullest of what is left.
    assert split == [[4], [0], [1, 2, 6], [3, 7, 5]]
    assert split_to(packed, LENGTHS, 2) == packed
    with pytest.raises(ValueError, match="cannot make 9 micro-batches"):
        split_to(packed, LENGTHS, 9)


def _update(micro: int, pack: bool) -> PolicyUpdate:
    spec = RLJobSpec.model_validate({"training": {"microBatchSize": micro}})
    model = torch.nn.Linear(1, 1)
    return PolicyUpdate(spec, model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                        pad_id=0, device=torch.device("cpu"), pack=pack)  # fmt: skip


def test_budget_is_micro_batch_size_rows_of_the_rollouts_longest() -> None:
    # Lengths (prompt + response) 6, 2, 2, 2, 2, 2: microBatchSize 2 allows 12 padded tokens.
    experience = Experience([[1]] * 6, [[1] * 5] + [[1]] * 5, [0.0] * 6, [0, 0, 1, 1, 2, 2])
    rows = [list(range(6))]
    assert _update(2, pack=True).micro_batches(experience, rows) == [[[0, 1], [2, 3, 4, 5]]]
    assert _update(2, pack=False).micro_batches(experience, rows) == [[[0, 1], [2, 3], [4, 5]]]
    # Equal lengths: packed or not, microBatchSize rows each (what the memory plan assumes).
    equal = Experience([[1]] * 4, [[1, 1]] * 4, [0.0] * 4, [0, 0, 1, 1])
    assert _update(2, pack=True).micro_batches(equal, [[0, 1, 2, 3]]) == [[[0, 1], [2, 3]]]
