"""bench/converging/multi_turn_warmstart.py builds what the rollout would record: the task's
prompt ids, the model's turns (loss on them only), the tool turn ChatFormat makes, and labels
that train exactly the model's turns."""

from __future__ import annotations

import random
from typing import Any

import pytest
from support.scripts import bench_module

from rljob.api import BUILTIN_CALCULATOR, DataSpec, MultiTurnSpec
from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.tool_calls import ToolCall, parse_tool_calls
from rljob_worker.agentic.tools import calculate, make_tools
from rljob_worker.model import TINY_QWEN2, load_tokenizer, resolve_model_path
from rljob_worker.task import CALCULATOR_INSTRUCTIONS, make_task


def _warmstart() -> Any:
    return bench_module("converging/multi_turn_warmstart.py", "multi_turn_warmstart")


@pytest.fixture(scope="module")
def warmstart() -> Any:
    return _warmstart()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_path(TINY_QWEN2))


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """The response cut into runs of equal mask: [(mask, ids), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(ids, mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


@pytest.mark.parametrize("kind", ["correct", "wrong-expression"])
def test_a_calling_conversation_is_the_rollouts_prompt_call_tool_turn_and_answer(
    warmstart: Any, tokenizer: Any, kind: str
) -> None:
    tools = make_tools(MultiTurnSpec(tools=warmstart.TOOLS, max_response_length=256))
    chat = ChatFormat(tokenizer, tools.schemas)
    data = DataSpec(source=BUILTIN_CALCULATOR, max_prompt_length=200)
    (problem,) = make_task(data, 3, tokenizer, tools.schemas).sample(1, salt=0)
    eos = tokenizer.eos_token_id
    c = warmstart.conversation(problem, chat, tools, eos, kind, random.Random(0))

    # The prompt is the task's, which is ChatFormat's first prompt of the same message.
    question = problem.where.removeprefix(f"{BUILTIN_CALCULATOR} ").strip("'")
    messages = [{"role": "user", "content": f"{question} {CALCULATOR_INSTRUCTIONS}"}]
    assert c.prompt_ids == list(problem.prompt_ids) == chat.prompt_ids(messages)

    (m1, call_ids), (m0, tool_ids), (m2, answer_ids) = _runs(c.response_ids, c.loss_mask)
    assert (m1, m0, m2) == (1, 0, 1)  # loss on the model's two turns only
    assert call_ids[-1] == eos and answer_ids[-1] == eos  # where the engine stops a turn
    (parsed,) = parse_tool_calls(tokenizer.decode(call_ids, skip_special_tokens=True), tools.names)
    assert isinstance(parsed, ToolCall) and parsed.name == "calculator"
    result = str(calculate(parsed.arguments["expression"]))
    assert (result == problem.answer) is (kind == "correct")
    # The tool turn is exactly ChatFormat's, after a turn that ended with end-of-sequence.
    sampled_end = chat.token_text(eos)
    assert tool_ids == chat.tool_turn([result], sampled_end, warmstart.MAX_TOOL_RESPONSE_LENGTH).ids
    assert tokenizer.decode(answer_ids, skip_special_tokens=True) == f"Answer:\n{result}"
    # The answer's number is the tool result's own tokens (a copy, not a translation).
    number = chat.encode(result)
    assert answer_ids[-1 - len(number) : -1] == number


def test_a_no_call_conversation_is_one_trained_answer_turn(warmstart: Any, tokenizer: Any) -> None:
    (c,) = [
        c
        for c in warmstart.conversations(tokenizer, 8, seed=1, wrong_share=0.0, no_call_share=0.5)
        if c.kind == "no-call"
    ][:1]
    assert c.loss_mask == [1] * len(c.response_ids) and c.response_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(c.response_ids, skip_special_tokens=True).startswith("Answer:\n")


def test_the_labels_train_exactly_the_model_turns_and_the_shares_are_seeded(
    warmstart: Any, tokenizer: Any
) -> None:
    data = warmstart.conversations(tokenizer, 40, seed=5, wrong_share=0.25, no_call_share=0.25)
    again = warmstart.conversations(tokenizer, 40, seed=5, wrong_share=0.25, no_call_share=0.25)
    assert [(c.kind, c.response_ids) for c in data] == [(c.kind, c.response_ids) for c in again]
    kinds = {k: sum(c.kind == k for c in data) for k in warmstart.KINDS}
    assert all(kinds.values()), kinds  # every kind drawn from 40 at these shares
    batch = data[:4]
    ids, attention, labels = warmstart.batch_tensors(batch, tokenizer.pad_token_id)
    for row, c in enumerate(batch):
        sequence = c.prompt_ids + c.response_ids
        trained = [0] * len(c.prompt_ids) + c.loss_mask
        assert ids[row, : len(sequence)].tolist() == sequence
        assert attention[row].tolist() == [1] * len(sequence) + [0] * (ids.shape[1] - len(sequence))
        expected = [t if m else -100 for t, m in zip(sequence, trained, strict=True)]
        expected += [-100] * (ids.shape[1] - len(sequence))  # padding is never trained
        assert labels[row].tolist() == expected
