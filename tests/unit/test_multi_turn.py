"""Multi-turn rollout (issue 32): tool-call parsing, tools, routing, the driver's trajectories
(ids, loss mask, budgets, cut-offs) and the policy update on masked trajectories, by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.bigram import Bigram
from support.scripted_engine import ScriptedEngine

from rljob.api import MultiTurnSpec, RLJobSpec
from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.driver import Ending, Limits, MultiTurnRollout, RolloutCounts
from rljob_worker.agentic.routing import EngineRouter, Routing
from rljob_worker.agentic.tool_calls import CallProblem, ToolCall, parse_tool_calls
from rljob_worker.agentic.tools import ToolSet, calculate, make_tools
from rljob_worker.engines.base import SamplingParams
from rljob_worker.model import TINY_QWEN2, load_tokenizer, resolve_model_path
from rljob_worker.policy_update import Experience, PolicyUpdate, response_batch

TOOLS = ["calculator", "python"]


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# -- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 5", []),
        (call("calculator", expression="2*3"), [ToolCall("calculator", {"expression": "2*3"})]),
        (
            "first " + call("calculator", expression="1+1") + " then "
            + call("python", expression="sum(range(4))"),
            [
                ToolCall("calculator", {"expression": "1+1"}),
                ToolCall("python", {"expression": "sum(range(4))"}),
            ],
        ),
        (  # arguments sent as a JSON string (some models do)
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7\\"}"}</tool_call>',
            [ToolCall("calculator", {"expression": "7"})],
        ),
        (
            "<tool_call>{name: calculator}</tool_call>",
            [CallProblem("Error: the tool call is not valid JSON (Expecting property name "
                         "enclosed in double quotes).")],
        ),
        (
            call("search", query="x"),
            [CallProblem("Error: unknown tool 'search'; the tools are: calculator, python.")],
        ),
        (
            '<tool_call>["calculator"]</tool_call>',
            [CallProblem('Error: a tool call is {"name": TOOL, "arguments": {...}}.')],
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            [CallProblem("Error: the tool call's arguments must be a JSON object.")],
        ),
        (
            call("calculator", expression="1") + ' <tool_call>{"name": "calc',
            [
                ToolCall("calculator", {"expression": "1"}),
                CallProblem("Error: <tool_call> without </tool_call>."),
            ],
        ),
    ],
    ids=["none", "one", "two-in-one-turn", "string-arguments", "malformed-json", "unknown-tool",
         "not-an-object", "arguments-not-object", "unclosed"],
)  # fmt: skip
def test_tool_calls_are_parsed_from_one_turns_text(text: str, expected: list[Any]) -> None:
    assert parse_tool_calls(text, TOOLS) == expected


# -- tools -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [("964*60+7890*3-365", 81145), ("(2+3)*4", 20), ("7/2", 3.5), ("-2**3", -8), ("17//5", 3)],
)
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [("__import__('os')", "not arithmetic"), ("9**9**9", "exponent"), ("1+", "not an arith")],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        calculate(expression)


def _run(tools: ToolSet, text: str) -> list[Any]:
    async def go() -> list[Any]:
        return [await tools.run(c) for c in parse_tool_calls(text, tools.names)]

    return asyncio.run(go())


def test_tool_errors_and_timeouts_become_the_models_answer() -> None:
    tools = make_tools(
        MultiTurnSpec(tools=["builtin:calculator", "builtin:python"], tool_timeout_seconds=1.0,
                      tool_memory_megabytes=256)
    )  # fmt: skip
    started = time.perf_counter()
    ok, div, slow, big, escape = _run(
        tools,
        call("python", expression="sorted([3, 1, 2])")
        + call("calculator", expression="1/0")
        + call("python", expression="sum(range(10**12))")
        + call("python", expression="[0] * 10**9")
        + call("python", expression="open('/etc/passwd').read()"),
    )
    assert ok.text == "[1, 2, 3]" and not ok.error
    assert div.error and div.text == "Error: ZeroDivisionError: division by zero"
    assert slow.error and slow.timed_out and "took longer than 1 s" in slow.text
    assert big.error and not big.timed_out and "MemoryError" in big.text  # the address-space cap
    assert escape.error and "NameError" in escape.text  # no open() among the builtins
    assert time.perf_counter() - started < 8  # the timeout stopped the slow one


def test_user_tools_load_from_a_file_and_their_failures_are_answers(tmp_path: Path) -> None:
    source = tmp_path / "my_tools.py"
    source.write_text(
        "import time\n"
        "def lookup(word):\n    'Look a word up.'\n    return {'word': word, 'length': len(word)}\n"
        "def broken(x):\n    raise KeyError(x)\n"
        "async def slow(x):\n    import asyncio\n    await asyncio.sleep(30)\n"
    )
    tools = make_tools(
        MultiTurnSpec(tools=[f"{source}:lookup", f"{source}:broken", f"{source}:slow"],
                      tool_timeout_seconds=0.5)
    )  # fmt: skip
    assert tools.names == ["lookup", "broken", "slow"]
    assert tools.schemas[0]["function"]["description"] == "Look a word up."
    found, broken, slow = _run(
        tools, call("lookup", word="abc") + call("broken", x="k") + call("slow", x=1)
    )
    assert json.loads(found.text) == {"word": "abc", "length": 3}
    assert broken.error and broken.text == "Error: KeyError: 'k'"
    assert slow.timed_out
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        make_tools(MultiTurnSpec(tools=[f"{source}:nothing"]))


# -- routing -----------------------------------------------------------------------------------


def test_first_turns_go_to_the_least_loaded_engine_and_later_turns_stay() -> None:
    router = EngineRouter(["a", "b", "c"])
    first = [router.acquire(conversation)[0] for conversation in range(3)]
    assert first == [0, 1, 2]  # each went to an idle engine
    router.release(1)  # engine 1 is now the least loaded
    assert router.acquire(7)[0] == 1
    for _turn in range(3):  # every later turn of conversation 0 goes back to engine 0,
        assert router.acquire(0)[0] == 0  # loaded or not
    router.forget(7)
    assert router.in_flight == [4, 1, 1]


def test_random_routing_spreads_a_conversations_turns() -> None:
    router = EngineRouter(["a", "b"], routing=Routing.RANDOM, seed=3)
    engines = {router.acquire(0)[0] for _ in range(20)}
    assert engines == {0, 1}
    with pytest.raises(RuntimeError, match="released more"):
        EngineRouter(["a"]).release(0)


# -- the driver --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_path(TINY_QWEN2))


def _rollout(
    tokenizer: Any,
    engines: list[ScriptedEngine],
    limits: Limits,
    tool_timeout_seconds: float = 5.0,
    routing: Routing = Routing.STICKY,
) -> MultiTurnRollout:
    tools = make_tools(MultiTurnSpec(tools=["builtin:calculator", "builtin:python"],
                                     tool_timeout_seconds=tool_timeout_seconds))  # fmt: skip
    return MultiTurnRollout(
        EngineRouter(engines, routing),  # type: ignore[arg-type]
        ChatFormat(tokenizer, tools.schemas),
        tools,
        limits,
        [tokenizer.eos_token_id],
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


LIMITS = Limits(max_turns=4, max_response_length=4000, max_tool_response_length=8,
                max_concurrent_conversations=3)  # fmt: skip
SAMPLING = SamplingParams(max_new_tokens=1, temperature=1.0, seed=5)


def _encode(tokenizer: Any) -> Any:
    return lambda text: list(tokenizer(text, add_special_tokens=False).input_ids)


def _prompts(tokenizer: Any, count: int) -> list[tuple[int, ...]]:
    return [tuple(_encode(tokenizer)(f"<|user|>\nq{i}: 12*{i}+5?\n<|assistant|>\n"))
            for i in range(count)]  # fmt: skip


def test_trained_ids_are_the_sampled_ids_and_the_mask_covers_exactly_them(tokenizer: Any) -> None:
    # Many conversations of one to four turns, several calls in a turn, errors among them.
    prompts = _prompts(tokenizer, 24)
    scripts = []
    for i in range(24):
        turns = [call("calculator", expression=f"12*{i}+5")] * (i % 3)
        if i % 4 == 0:
            turns.append(call("python", expression="1/0") + call("calculator", expression="2"))
        scripts.append([*turns, f"Answer: {12 * i + 5}"])
    engine = ScriptedEngine(_encode(tokenizer), dict(zip(prompts, scripts, strict=True)),
                            tokenizer.eos_token_id, delay_seconds=0.001)  # fmt: skip
    rollout = _rollout(tokenizer, [engine], LIMITS)
    trajectories = asyncio.run(rollout.run([list(p) for p in prompts], SAMPLING))

    sampled: dict[tuple[int, ...], list[int]] = {}
    for prompt, ids in engine.answers:
        sampled.setdefault(prompt, []).extend(ids)
    for t, script in zip(trajectories, scripts, strict=True):
        assert t.ending is Ending.ANSWER and t.turns == len(script)
        trained = [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
        assert trained == sampled[tuple(t.prompt_ids)]  # exactly what the engine sampled
        assert len(t.logprobs) == sum(t.loss_mask) == len(trained)
        # Every request was the trajectory so far: token in, token out, no re-templating.
        requests = [
            r for r, _ in engine.requests if tuple(r[: len(t.prompt_ids)]) == tuple(t.prompt_ids)
        ]
        assert all(
            t.prompt_ids + t.response_ids[: len(r) - len(t.prompt_ids)] == r for r in requests
        )
        # The masked-out runs are the tool turns: the template's text and the tool results.
        masked = tokenizer.decode(
            [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if not m]
        )
        assert masked.count("<|tool|>") == t.tool_calls
        assert t.last_turn_text == script[-1]
    counts = RolloutCounts.of(trajectories)
    assert counts.turns == sum(len(s) for s in scripts)
    assert counts.tool_calls == sum(i % 3 for i in range(24)) + 2 * 6
    assert counts.tool_errors == 6 and counts.tool_timeouts == 0 and counts.cut_off == 0
    assert engine.max_in_flight <= LIMITS.max_concurrent_conversations
    assert rollout.router.requests_in_flight == 0


def test_every_turn_of_every_ranks_conversations_samples_with_a_seed_of_its_own(
    tokenizer: Any,
) -> None:
    # The loop's batch seeds of neighbouring ranks differ by 1 (loop.py). Seeds of the form
    # batch + k * conversation + turn gave rank r's turn t + 1 rank r + 1's turn t's seed: the
    # same random stream on two ranks.
    prompts = _prompts(tokenizer, 6)
    scripts = [[call("calculator", expression="2")] * (i % 3) + ["Answer: 2"] for i in range(6)]
    seeds: list[int] = []
    for batch_seed in (5, 6, 7):  # three ranks of one iteration
        engine = ScriptedEngine(_encode(tokenizer), dict(zip(prompts, scripts, strict=True)),
                                tokenizer.eos_token_id)  # fmt: skip
        rollout = _rollout(tokenizer, [engine], LIMITS)
        asyncio.run(
            rollout.run(
                [list(p) for p in prompts], SamplingParams(1, temperature=1.0, seed=batch_seed)
            )
        )
        assert len(engine.requests) == sum(len(s) for s in scripts)
        seeds += [sampling.seed for _, sampling in engine.requests if sampling.seed is not None]
    assert len(seeds) == 3 * sum(len(s) for s in scripts)
    assert len(set(seeds)) == len(seeds)


def test_the_budget_cuts_a_trajectory_off_and_it_keeps_what_it_has(tokenizer: Any) -> None:
    (prompt,) = _prompts(tokenizer, 1)
    long_answer = "Answer: " + "9" * 300
    engine = ScriptedEngine(_encode(tokenizer), {prompt: [call("calculator", expression="2+2"),
                            long_answer]}, tokenizer.eos_token_id)  # fmt: skip
    limits = Limits(max_turns=4, max_response_length=160, max_tool_response_length=8,
                    max_concurrent_conversations=1)  # fmt: skip
    (t,) = asyncio.run(_rollout(tokenizer, [engine], limits).run([list(prompt)], SAMPLING))
    assert t.ending is Ending.BUDGET and t.cut_off and t.tool_calls == 1 and t.turns == 2
    assert len(t.response_ids) == 160 == len(t.loss_mask)  # exactly the budget, no more
    # The second turn was asked for what was left of the budget, and got no more.
    first_turn = len(engine.answers[0][1])
    asked = engine.requests[1][1].max_new_tokens
    assert asked == 160 - (len(engine.requests[1][0]) - len(prompt)) and asked < 160 - first_turn
    assert t.response_ids[-asked:] == engine.answers[1][1] and t.loss_mask[-asked:] == [1] * asked


def test_no_request_asks_past_the_models_context_and_a_full_context_ends_the_conversation(
    tokenizer: Any,
) -> None:
    # sglang refuses a request whose ids plus max_new_tokens pass the model's context (the
    # builtin model's is 256), failing the whole rollout: the driver must ask for less, and end
    # the conversation where the context is full.
    prompts = _prompts(tokenizer, 2)
    context = len(prompts[0]) + 200  # room for the call (about 60 tokens) and its tool turn
    engine = ScriptedEngine(_encode(tokenizer), {
        prompts[0]: [call("calculator", expression="2+2"), "Answer: " + "9" * 300],
        prompts[1]: ["9" * 300],  # its first turn alone fills the context
    }, tokenizer.eos_token_id)  # fmt: skip
    limits = Limits(max_turns=4, max_response_length=4000, max_tool_response_length=8,
                    max_concurrent_conversations=1, context_length=context)  # fmt: skip
    calling, filling = asyncio.run(
        _rollout(tokenizer, [engine], limits).run([list(p) for p in prompts], SAMPLING)
    )
    for ids, sampling in engine.requests:
        assert len(ids) + sampling.max_new_tokens <= context
    # The first request of each: the whole room, 200 tokens (not the 4000 of the budget).
    first = {tuple(ids): s.max_new_tokens for ids, s in engine.requests}
    assert first[tuple(prompts[0])] == first[tuple(prompts[1])] == 200
    assert filling.ending is Ending.CONTEXT and filling.cut_off and filling.turns == 1
    assert len(filling.prompt_ids) + len(filling.response_ids) == context
    assert filling.loss_mask == [1] * 200 and len(filling.logprobs) == 200
    # The call's turn fitted; the answer after the tool result got what was left, then ended.
    assert calling.ending is Ending.CONTEXT and calling.tool_calls == 1 and calling.turns == 2
    assert len(calling.prompt_ids) + len(calling.response_ids) == context
    (ids, last), *_ = [
        r for r in engine.requests[::-1] if tuple(r[0][: len(prompts[0])]) == prompts[0]
    ]
    assert last.max_new_tokens == context - len(ids) < 200
    assert calling.loss_mask[-last.max_new_tokens :] == [1] * last.max_new_tokens
    counts = RolloutCounts.of([calling, filling])
    assert counts.cut_off == 2


def test_a_tool_turn_that_would_fill_the_context_ends_the_conversation(tokenizer: Any) -> None:
    (prompt,) = _prompts(tokenizer, 1)
    first = call("calculator", expression="2+2")
    first_ids = len(_encode(tokenizer)(first)) + 1  # with EOS
    # Room for the first turn and less than its tool turn: the tool tokens are not appended.
    context = len(prompt) + first_ids + 3
    engine = ScriptedEngine(_encode(tokenizer), {prompt: [first, "Answer: 4"]},
                            tokenizer.eos_token_id)  # fmt: skip
    limits = Limits(max_turns=4, max_response_length=4000, max_tool_response_length=8,
                    max_concurrent_conversations=1, context_length=context)  # fmt: skip
    (t,) = asyncio.run(_rollout(tokenizer, [engine], limits).run([list(prompt)], SAMPLING))
    assert t.ending is Ending.CONTEXT and t.turns == 1 and len(engine.requests) == 1
    assert t.response_ids == engine.answers[0][1] and t.loss_mask == [1] * first_ids


def test_max_turns_and_tool_timeouts_end_or_continue_as_documented(tokenizer: Any) -> None:
    prompts = _prompts(tokenizer, 2)
    slow = call("python", expression="sum(range(10**12))")
    engine = ScriptedEngine(_encode(tokenizer), {
        prompts[0]: [call("calculator", expression="1+1")] * 5,  # never answers
        prompts[1]: [slow, "Answer: 2"],  # times out, then goes on
    }, tokenizer.eos_token_id)  # fmt: skip
    limits = Limits(max_turns=3, max_response_length=1000, max_tool_response_length=64,
                    max_concurrent_conversations=2)  # fmt: skip
    looping, waiting = asyncio.run(
        _rollout(tokenizer, [engine], limits, tool_timeout_seconds=0.5).run(
            [list(p) for p in prompts], SAMPLING
        )
    )
    assert looping.ending is Ending.MAX_TURNS and looping.turns == 3 and looping.tool_calls == 2
    assert waiting.ending is Ending.ANSWER and waiting.tool_timeouts == 1 and waiting.turns == 2
    assert "took longer than 0.5 s" in tokenizer.decode(
        [tok for tok, m in zip(waiting.response_ids, waiting.loss_mask, strict=True) if not m]
    )


def test_a_conversation_counts_as_answered_by_a_tool_only_when_a_result_is_the_answer(
    tokenizer: Any,
) -> None:
    # 12*3+5 = 41: right call; a wrong expression; no call; a failing call then the right one.
    prompts = _prompts(tokenizer, 4)
    engine = ScriptedEngine(_encode(tokenizer), {
        prompts[0]: [call("calculator", expression="12*3+5"), "Answer: 41"],
        prompts[1]: [call("calculator", expression="12*3+6"), "Answer: 42"],
        prompts[2]: ["Answer: 41"],
        prompts[3]: [call("calculator", expression="12*"), call("python", expression="12*3+5"),
                     "Answer: 41"],
    }, tokenizer.eos_token_id)  # fmt: skip
    trajectories = asyncio.run(
        _rollout(tokenizer, [engine], LIMITS).run([list(p) for p in prompts], SAMPLING)
    )
    assert [t.tool_results[-1:] for t in trajectories] == [["41"], ["42"], [], ["41"]]
    counts = RolloutCounts.of(trajectories, ["41"] * 4)
    assert counts.answer_from_tool == 2 and counts.tool_calls == 4 and counts.tool_errors == 1
    assert RolloutCounts.of(trajectories).answer_from_tool == 0  # no answers given: none known
    with pytest.raises(ValueError, match="3 answers for 4 trajectories"):
        RolloutCounts.of(trajectories, ["41"] * 3)


def test_long_tool_results_are_cut_to_their_token_budget(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, [])
    end = chat.token_text(tokenizer.eos_token_id)
    turn = chat.tool_turn(["1234567890" * 10, "7"], sampled_end=end, max_result_tokens=3)
    assert turn.truncated_results == 1
    text = tokenizer.decode(turn.ids)
    assert text.startswith("\n<|tool|>\n") and text.endswith("\n7\n<|assistant|>\n")
    assert len(tokenizer("1234567890" * 10, add_special_tokens=False).input_ids) > 3


QWEN_LIKE = (  # Qwen2.5's structure: tool results inside one user turn, <|im_end|> ends a turn
    r"{% for m in messages %}{% if m['role'] == 'tool' %}"
    r"{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}"
    r"{% endif %}{{ '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    r"{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}"
    r"{% endif %}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    r"{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_chatml_template_gives_the_tool_turn_after_the_sampled_end_of_turn(
    tokenizer: Any,
) -> None:
    class ChatML:  # the real tokenizer with Qwen's template and end-of-turn token text
        chat_template = QWEN_LIKE
        eos_token = "<|im_end|>"

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            kwargs.pop("tools", None)
            return str(tokenizer.apply_chat_template(messages, chat_template=QWEN_LIKE, **kwargs))

        def __call__(self, text: str, add_special_tokens: bool) -> Any:
            return tokenizer(text, add_special_tokens=add_special_tokens)

    chat = ChatFormat(ChatML(), [])
    after_eos = tokenizer.decode(chat.tool_turn(["84", "45"], "<|im_end|>", 16).ids)
    assert after_eos == ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n"
                         "<tool_response>\n45\n</tool_response><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    # A turn that did not sample the end of turn (the budget cut it) gets it from the template.
    assert tokenizer.decode(chat.tool_turn(["84"], "", 16).ids).startswith("<|im_end|>\n")
    # Nor one that another stop token ended: its text is not the end of turn's.
    assert tokenizer.decode(chat.tool_turn(["84"], "<|endoftext|>", 16).ids).startswith(
        "<|im_end|>\n"
    )


END_OF_TURN_IS_EOS = QWEN_LIKE.replace("<|im_end|>", "<|endoftext|>")


def test_a_turn_another_stop_id_ended_still_gets_the_templates_end_of_turn(
    tokenizer: Any,
) -> None:
    # Qwen2.5-Instruct stops on its eos_token <|im_end|> (the template's end of turn) and on
    # <|endoftext|>. Here the builtin's <|endoftext|> plays <|im_end|> and <|pad|> the other
    # stop id. A tool call that the other stop id ended has not closed its turn: the tool turn
    # must close it; only an end of turn the model sampled is left out of it.
    class EndOfTurnIsEos:
        chat_template = END_OF_TURN_IS_EOS
        eos_token, eos_token_id = tokenizer.eos_token, tokenizer.eos_token_id

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            kwargs.pop("tools", None)
            return str(
                tokenizer.apply_chat_template(messages, chat_template=END_OF_TURN_IS_EOS, **kwargs)
            )

        def __call__(self, text: str, add_special_tokens: bool) -> Any:
            return tokenizer(text, add_special_tokens=add_special_tokens)

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    other_stop = tokenizer.convert_tokens_to_ids("<|pad|>")
    (prompt,) = _prompts(tokenizer, 1)

    def tool_turn_after(stop_id: int) -> str:
        script = {prompt: [call("calculator", expression="2+2"), "Answer: 4"]}
        engine = ScriptedEngine(_encode(tokenizer), script, stop_id)
        tools = make_tools(MultiTurnSpec(tools=["builtin:calculator"]))
        rollout = MultiTurnRollout(
            EngineRouter([engine]),  # type: ignore[list-item]
            ChatFormat(EndOfTurnIsEos(), tools.schemas),
            tools,
            LIMITS,
            [tokenizer.eos_token_id, other_stop],
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        (t,) = asyncio.run(rollout.run([list(prompt)], SAMPLING))
        assert t.ending is Ending.ANSWER and t.tool_calls == 1
        return str(
            tokenizer.decode([tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True)
                              if not m])
        )  # fmt: skip

    assert tool_turn_after(tokenizer.eos_token_id).startswith("\n<|im_start|>user\n")
    assert tool_turn_after(other_stop).startswith("<|endoftext|>\n<|im_start|>user\n")


def test_sticky_routing_keeps_prefixes_cached_where_random_does_not(tokenizer: Any) -> None:
    prompts = _prompts(tokenizer, 8)
    script = [
        call("calculator", expression="1+1"),
        call("calculator", expression="2+2"),
        "Answer: 4",
    ]

    def hit_rate(routing: Routing) -> float:
        engines = [ScriptedEngine(_encode(tokenizer), {p: list(script) for p in prompts},
                                  tokenizer.eos_token_id, cached_tokens=True) for _ in range(2)]  # fmt: skip
        # The fake's script is per engine: one turn counter shared by both (a conversation's
        # turns may go to either engine under random routing).
        shared: dict[tuple[int, ...], int] = {}
        for engine in engines:
            engine._seen = shared
        rollout = _rollout(tokenizer, engines, LIMITS, routing=routing)
        counts = RolloutCounts.of(asyncio.run(rollout.run([list(p) for p in prompts], SAMPLING)))
        assert counts.turns == 24 and counts.cached_tokens is not None
        return counts.cached_tokens / counts.prompt_tokens

    sticky, scattered = hit_rate(Routing.STICKY), hit_rate(Routing.RANDOM)
    assert sticky > scattered and sticky > 0.5


def test_turn_by_turn_gives_the_same_trajectories_as_async(tokenizer: Any) -> None:
    prompts = _prompts(tokenizer, 6)
    scripts = {p: [call("calculator", expression=f"{i}*3")] * (i % 3) + [f"Answer: {i * 3}"]
               for i, p in enumerate(prompts)}  # fmt: skip

    def trajectories(turn_by_turn: bool) -> list[tuple[list[int], list[int]]]:
        engine = ScriptedEngine(_encode(tokenizer), scripts, tokenizer.eos_token_id)
        rollout = _rollout(tokenizer, [engine], LIMITS)
        run = rollout.run_turn_by_turn if turn_by_turn else rollout.run
        ended = asyncio.run(run([list(p) for p in prompts], SAMPLING))
        assert rollout.router.conversations == 0  # every ended conversation forgotten
        return [(t.response_ids, t.loss_mask) for t in ended]

    assert trajectories(True) == trajectories(False)


# -- the partial rollout ---------------------------------------------------------------------------


def test_a_partial_rollout_trains_whole_groups_and_resumes_the_rest_token_for_token(
    tokenizer: Any,
) -> None:
    # 8 groups of 2; conversation i calls the calculator i % 3 times, then answers. Each
    # rollout keeps 4 groups under way (the carried ones first, then new ones) and trains 2.
    prompts = _prompts(tokenizer, 16)
    scripts = {p: [call("calculator", expression=f"{i}*7")] * (i % 3) + [f"Answer: {i * 7}"]
               for i, p in enumerate(prompts)}  # fmt: skip
    # Requests of different lengths, so that a stop finds some of them under way.
    delays = {p: 0.01 * (1 + i % 4) for i, p in enumerate(prompts)}
    engine = ScriptedEngine(_encode(tokenizer), scripts, tokenizer.eos_token_id, delays=delays)
    limits = Limits(max_turns=4, max_response_length=4000, max_tool_response_length=8,
                    max_concurrent_conversations=16)  # fmt: skip
    rollout = _rollout(tokenizer, [engine], limits)
    fresh = rollout.start([list(p) for p in prompts], group_size=2)
    carried: list[Any] = []
    trained: list[Any] = []
    rollouts = 0
    while len(trained) < 16 and rollouts < 12:
        under_way = len({t.group for t in carried})
        new, fresh = fresh[: 2 * (4 - under_way)], fresh[2 * (4 - under_way) :]
        under_way = len({t.group for t in [*carried, *new]})
        result = asyncio.run(rollout.run_partial([*carried, *new], SAMPLING, min(2, under_way)))
        rollouts += 1
        assert rollout.router.requests_in_flight == 0 and engine.in_flight == 0
        groups = sorted({t.group for t in result.trained})
        assert len(result.trained) == 2 * len(groups) and all(t.ending for t in result.trained)
        # The oldest ended groups are trained; no ended group older than them is carried.
        ended_carried = {t.group for t in result.carried
                         if all(u.ending for u in result.carried if u.group == t.group)}  # fmt: skip
        assert all(g > max(groups) for g in ended_carried)
        assert result.paused == sum(t.ending is None for t in result.carried)
        trained += result.trained
        carried = result.carried
    assert sorted(t.conversation for t in trained) == list(range(16))
    assert engine.aborted > 0  # the stops cut requests mid-turn
    assert any(t.rollouts > 1 for t in trained)  # and those went on in a later rollout
    counts = RolloutCounts.of(trained)
    assert counts.resumed == sum(t.rollouts > 1 for t in trained) > 0

    sampled: dict[tuple[int, ...], list[int]] = {}
    for prompt, ids in engine.answers:
        sampled.setdefault(prompt, []).extend(ids)
    for t in trained:
        script = scripts[tuple(t.prompt_ids)]
        assert t.ending is Ending.ANSWER and t.turns == len(script)
        assert t.last_turn_text == script[-1]
        trained_ids = [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
        # Exactly what the engine sampled, the aborted requests' tokens included, in order.
        assert trained_ids == sampled[tuple(t.prompt_ids)]
        assert len(t.logprobs) == sum(t.loss_mask)
        # The same tokens an uninterrupted rollout gives: a stop changes no token.
        eos = tokenizer.eos_token_id
        whole = [tok for text in script for tok in [*_encode(tokenizer)(text), eos]]
        assert trained_ids == whole
        # Every request, the continuations of cut turns too, was the trajectory so far.
        for request, _ in engine.requests:
            if tuple(request[: len(t.prompt_ids)]) == tuple(t.prompt_ids):
                assert t.prompt_ids + t.response_ids[: len(request) - len(t.prompt_ids)] == request


def test_a_partial_rollout_with_enough_ended_groups_sends_nothing(tokenizer: Any) -> None:
    prompts = _prompts(tokenizer, 4)
    engine = ScriptedEngine(_encode(tokenizer), {p: ["Answer: 1"] for p in prompts},
                            tokenizer.eos_token_id)  # fmt: skip
    rollout = _rollout(tokenizer, [engine], LIMITS)
    first = asyncio.run(rollout.run_partial(rollout.start([list(p) for p in prompts], 2),
                                            SAMPLING, groups=1))  # fmt: skip
    # Nothing was aborted (every answer is one short turn): both groups may have ended.
    assert [t.group for t in first.trained] == [0, 0]
    requests = len(engine.requests)
    if first.carried and all(t.ending for t in first.carried):
        again = asyncio.run(rollout.run_partial(first.carried, SAMPLING, groups=1))
        assert len(engine.requests) == requests and again.trained == first.carried
    with pytest.raises(ValueError, match="2 groups to train from 1 groups"):
        asyncio.run(rollout.run_partial(first.trained, SAMPLING, groups=2))


def test_an_abort_no_stop_asked_for_ends_the_turn_with_what_it_has(tokenizer: Any) -> None:
    # An engine that aborts on its own (sglang's scheduler can) outside a partial rollout: the
    # turn ends with its tokens, as any short answer would; nothing is sent again.
    prompts = _prompts(tokenizer, 4)
    script = ["The sum of one and one, worked out step by step, is two. Answer: 2"]
    engine = ScriptedEngine(_encode(tokenizer), {p: list(script) for p in prompts},
                            tokenizer.eos_token_id, delay_seconds=0.05)  # fmt: skip
    rollout = _rollout(
        tokenizer, [engine], dataclasses.replace(LIMITS, max_concurrent_conversations=4)
    )

    async def scenario() -> list[Any]:
        running = asyncio.ensure_future(rollout.run([list(p) for p in prompts], SAMPLING))
        await asyncio.sleep(0.01)
        engine.abort_requests()
        return list(await running)

    trajectories = asyncio.run(scenario())
    assert engine.aborted == 4 and len(engine.requests) == 4  # one request each, cut
    whole = len(_encode(tokenizer)(script[0])) + 1
    for t in trajectories:  # the turn ended with the half it had, not sent again
        assert t.ending is Ending.ANSWER and t.turns == 1 and t.turn_start is None
        assert 0 < len(t.response_ids) < whole


@pytest.mark.parametrize("partial", [True, False], ids=["run_partial", "run"])
def test_a_failing_conversation_stops_the_others(tokenizer: Any, partial: bool) -> None:
    prompts = _prompts(tokenizer, 4)

    class Failing(ScriptedEngine):
        async def async_generate(self, input_ids: Any, sampling: SamplingParams) -> Any:
            if tuple(input_ids[: len(prompts[0])]) == prompts[0]:
                raise RuntimeError("engine died")
            return await super().async_generate(input_ids, sampling)

    engine = Failing(_encode(tokenizer), {p: ["Answer: 1"] for p in prompts},
                     tokenizer.eos_token_id, delay_seconds=0.2)  # fmt: skip
    rollout = _rollout(tokenizer, [engine], LIMITS)

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match="engine died"):
            if partial:
                trajectories = rollout.start([list(p) for p in prompts], 2)
                await rollout.run_partial(trajectories, SAMPLING, 1)
            else:
                await rollout.run([list(p) for p in prompts], SAMPLING)
        await asyncio.sleep(0.3)  # nothing of the failed rollout goes on running

    asyncio.run(scenario())
    assert engine.in_flight == 0 and rollout.router.requests_in_flight == 0
    assert not engine.answers  # the others were stopped, not answered after the failure
    assert not rollout._stopping  # the next rollout is not stopped before it starts


def test_the_groups_under_way_round_up_what_overSample_says() -> None:
    from rljob.api import PartialRolloutSpec

    assert PartialRolloutSpec(over_sample=0.07).groups_under_way(100) == 107
    assert PartialRolloutSpec(over_sample=0.25).groups_under_way(2) == 3
    assert PartialRolloutSpec(over_sample=0.5).groups_under_way(32) == 48


# -- the policy update on masked trajectories, by hand --------------------------------------------

EPS_ADV = 1e-6
A = 0.5 / (0.5 + EPS_ADV)


def test_the_batch_mask_marks_only_the_sampled_tokens() -> None:
    # Prompt [5, 6]; response [7, 8, 9, 4] with 8 and 9 from a tool (mask 0): positions 1 and 4
    # predict the sampled 7 and 4; positions 2 and 3 (predicting 8, 9) are not trained.
    experience = Experience([[5, 6]], [[7, 8, 9, 4]], [1.0], [0], loss_masks=[[1, 0, 0, 1]])
    batch = response_batch(experience, [0], pad_id=0, device=torch.device("cpu"))
    assert batch.mask.tolist() == [[False, True, False, False, True]]
    assert experience.trained_tokens == 2
    with pytest.raises(ValueError, match="3 loss-mask entries for 4 tokens"):
        response_batch(Experience([[5]], [[7, 8, 9, 4]], [1.0], [0], loss_masks=[[1, 0, 0]]),
                       [0], 0, torch.device("cpu"))  # fmt: skip


def test_a_masked_update_by_hand() -> None:
    # The bigram of test_rl_math's hand-checked step, with tool tokens inserted that must not
    # count: response 0 = [1, 2 | 2, 0, 1] with the last three from a tool (mask 0), reward 1;
    # response 1 = [2], reward 0. The trained tokens are (0 -> 1, A+), (1 -> 2, A+), (0 -> 2, A-),
    # exactly test_rl_math's, so the loss is -A/3, the norm sqrt(24/81) A and the table
    # [[0, 1/3, -1/3], [-1/9, -1/9, 2/9], [0, 0, 0]] A. Unmasked, the tool tokens would add
    # (2 -> 2), (2 -> 0), (0 -> 1) with A+ and change all three.
    spec = RLJobSpec.model_validate({"algorithm": {"klCoef": 0, "clipRatio": 0.2}})
    masked = Experience([[0], [0]], [[1, 2, 2, 0, 1], [2]], [1.0, 0.0], [0, 0],
                        [[-1.0, -1.0], [-1.0]], [[1, 1, 0, 0, 0], [1]])  # fmt: skip
    model = Bigram()
    update = PolicyUpdate(spec, model, None, torch.optim.SGD(model.parameters(), lr=1.0), 0,
                          torch.device("cpu"))  # fmt: skip
    stats = update.run(masked)
    assert stats.token_steps == 3 and stats.response_tokens == 3
    assert stats.loss == pytest.approx(-A / 3, abs=1e-6)
    assert stats.grad_norm == pytest.approx(math.sqrt(24 / 81) * A, abs=1e-6)
    assert stats.logprob_mismatch_sum == pytest.approx(3 * (math.log(3) - 1), abs=1e-5)
    expected = torch.tensor([[0.0, 1 / 3, -1 / 3], [-1 / 9, -1 / 9, 2 / 9], [0.0, 0.0, 0.0]])
    assert torch.allclose(model.table.detach(), expected * A, atol=1e-6)


# -- the memory plan ---------------------------------------------------------------------------

QWEN_05B_SHAPE = {"hiddenSize": 896, "intermediateSize": 4864, "numHiddenLayers": 24,
                  "numAttentionHeads": 14, "numKeyValueHeads": 2, "vocabSize": 151936,
                  "tieWordEmbeddings": True}  # fmt: skip


def _multi_turn_spec(concurrent: int, length: int) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "dtype": "bfloat16", "shape": QWEN_05B_SHAPE},
        "data": {"source": "builtin:calculator", "trainBatchSize": 16, "maxPromptLength": 256},
        "algorithm": {"groupSize": 8},
        "rollout": {"engine": "sglang", "memFractionStatic": 0.5, "mode": "multiTurn",
                    "multiTurn": {"maxResponseLength": length, "maxConcurrentConversations": concurrent}},
        "resources": {"gpusPerWorker": 1},
    })  # fmt: skip


def _chosen(spec: RLJobSpec) -> Any:
    from rljob.plan import plan, shape_for

    shape = shape_for(spec)
    assert shape is not None
    return plan(spec, shape, 80 * 2**30, 1).chosen


def test_the_plan_reserves_kv_for_the_concurrent_full_length_trajectories() -> None:
    from rljob.plan import rollout_kv_tokens

    # 16 prompts x 8 = 128 conversations on the one rank, at most 64 at once: 64 x (256 + 4096).
    spec = _multi_turn_spec(64, 4096)
    assert rollout_kv_tokens(spec, 1) == 64 * (256 + 4096)
    fits = _chosen(spec)
    assert fits.parts.kv_tokens_needed == 278_528 and fits.kv_holds_rollout
    # 128 at once (capped by the 128 conversations there are) of 256 + 65536 tokens: 8.4M
    # tokens, more than half an 80 GiB card holds for a 0.5B model.
    big = _multi_turn_spec(4096, 65536)
    short = _chosen(big)
    assert short.parts.kv_tokens_needed == 128 * (256 + 65536)
    assert not short.kv_holds_rollout and not short.fits
    assert "concurrent full-length trajectories need 8421376" in short.misfit_text()
    # A single-turn job asks the pool for one full-length request (the engine queues the rest).
    single = RLJobSpec.model_validate(
        {"model": {"path": "Qwen/Qwen2.5-0.5B", "shape": QWEN_05B_SHAPE}}
    )
    one = single.data.max_prompt_length + single.data.max_response_length
    assert _chosen(single).parts.kv_tokens_needed == one
