"""Issue 32 on the CPU: examples/multi-turn-tools.yaml under `rljob run` (2 ranks on gloo, 2
iterations, torch engine, staged awake), and the torch engine's async path under the multi-turn
driver with the real tiny model: the trained ids are the sampled ones."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from rljob.api import MultiTurnSchedule, MultiTurnSpec
from rljob.report import Stage
from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.driver import Limits, MultiTurnRollout
from rljob_worker.agentic.routing import EngineRouter
from rljob_worker.agentic.tools import make_tools
from rljob_worker.cli_run import main
from rljob_worker.engines.base import Completion, SamplingParams
from rljob_worker.engines.torch_engine import TorchEngine
from rljob_worker.model import TINY_QWEN2, load_tokenizer, resolve_model_path
from rljob_worker.task import make_task

REPO = Path(__file__).resolve().parents[2]


def test_the_multi_turn_example_runs_two_staged_iterations_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest = REPO / "examples" / "multi-turn-tools.yaml"
    assert main([str(manifest), "--out", str(out), "--ranks", "2", "--verify-weights"]) == 0
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["iteration"] == 2
    metrics = status["metrics"]
    assert [m["iteration"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        # 2 ranks x 2 prompts x groupSize 4 conversations, each at least one turn; every one
        # ended or was cut off (and counted) before the engine slept.
        turns = m["multiTurn"]
        assert turns["turnsMean"] >= 1 and turns["toolCalls"] >= 0 and turns["cutOff"] <= 16
        assert turns["toolErrors"] <= turns["toolCalls"]
        assert turns["toolTimeouts"] <= turns["toolErrors"]
        assert m["responseLengthMax"] <= 96  # rollout.multiTurn.maxResponseLength
        # The example's validation: 4 held-out problems, whole conversations, every iteration.
        validation = m["validation"]
        assert validation["prompts"] == 4
        assert 0 < validation["responseLengthMean"] <= 96
    assert all(m["policyLoss"] is not None for m in metrics[1:])  # trained on the trajectories
    reports = json.loads((out / "reports.json").read_text())
    for report in reports[1:]:
        stages = [s["stage"] for s in report["samples"] if s["rank"] == 0]
        # staged awake around the multi-turn rollout, as around a single-turn one
        assert stages == [str(s) for s in (Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER, Stage.WAKE_WEIGHTS,
                                           Stage.OFFLOAD_TRAIN, Stage.WAKE_KV_CACHE, Stage.ROLLOUT,
                                           Stage.SLEEP)]  # fmt: skip


class Recording:
    """The real TorchEngine, with every answer it gave recorded (a spy, not a fake)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.answers: list[tuple[list[int], Completion]] = []

    async def async_generate(self, input_ids: Any, sampling: SamplingParams) -> Completion:
        answer = await self.engine.async_generate(input_ids, sampling)
        self.answers.append((list(input_ids), answer))
        return answer

    def abort_requests(self) -> None:
        self.engine.abort_requests()


def test_torch_engine_trajectories_train_exactly_the_sampled_ids() -> None:
    path = resolve_model_path(TINY_QWEN2)
    tokenizer = load_tokenizer(path)
    engine = TorchEngine(path, dtype="float32", kv_capacity_tokens=8192)
    spy = Recording(engine)
    settings = MultiTurnSpec(max_turns=3, max_response_length=48, max_tool_response_length=8)
    tools = make_tools(settings)
    from rljob.api import DataSpec

    task = make_task(DataSpec(source="builtin:calculator", max_prompt_length=256), 0, tokenizer)
    # Distinct prompts: a turn's answer is found below by its input ids.
    prompts = [list(p.prompt_ids) for p in task.sample(32, salt=1)]
    assert len({tuple(p) for p in prompts}) == 32
    rollout = MultiTurnRollout(
        EngineRouter([spy]),
        ChatFormat(tokenizer, tools.schemas),
        tools,
        Limits(3, 48, 8, max_concurrent_conversations=16),
        [tokenizer.eos_token_id],
        lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
    )
    trajectories = asyncio.run(rollout.run(prompts, SamplingParams(1, temperature=1.0, seed=7)))
    assert len(trajectories) == 32
    by_input = {tuple(ids): answer for ids, answer in spy.answers}
    for t in trajectories:
        sampled: list[int] = []
        logprobs: list[float] = []
        # The turns' answers, found by their inputs, concatenated, are the mask-1 tokens.
        prefix = list(t.prompt_ids)
        position = 0
        while position < len(t.response_ids):
            answer = by_input[tuple(prefix)]
            size = len(answer.token_ids)
            assert t.response_ids[position : position + size] == answer.token_ids
            assert t.loss_mask[position : position + size] == [1] * size
            sampled += answer.token_ids
            logprobs += answer.logprobs
            position += size
            prefix = t.prompt_ids + t.response_ids[:position]
            while position < len(t.response_ids) and not t.loss_mask[position]:
                position += 1  # a tool turn
            prefix = t.prompt_ids + t.response_ids[:position]
        assert [x for x, m in zip(t.response_ids, t.loss_mask, strict=True) if m] == sampled
        assert t.logprobs == logprobs and len(t.response_ids) <= 48
    # Conversations that asked together were generated together (the batcher's batches).
    assert engine._batcher is not None and engine._batcher.batches < len(spy.answers)
    engine.shutdown()


def _example(schedule: str | None) -> Any:
    import yaml

    from rljob.api import parse_manifest

    doc = yaml.safe_load((REPO / "examples" / "multi-turn-tools.yaml").read_text())
    if schedule is not None:
        doc["spec"]["rollout"]["multiTurn"]["schedule"] = schedule
    return parse_manifest(doc)[1]


def test_the_spec_schedule_picks_how_the_rollout_stage_sends_its_turns(
    monkeypatch: Any, caplog: Any
) -> None:
    """spec.rollout.multiTurn.schedule: async (the default) drives the conversations with
    MultiTurnRollout.run, turnByTurn with run_turn_by_turn; the rollout stage of the example's
    job (its real tiny model, torch engine, tools and reward) gets the same experience from
    both (the same turns with the same seeds)."""
    from rljob_worker.loop import RankConfig, _MultiTurnRollout
    from rljob_worker.model import stop_token_ids
    from rljob_worker.reward import Scorer

    called: list[str] = []
    for name in ("run", "run_turn_by_turn"):
        original = getattr(MultiTurnRollout, name)

        def spy(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            called.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(MultiTurnRollout, name, spy)
    assert _example(None).rollout.multi_turn.schedule is MultiTurnSchedule.ASYNC  # the default
    experiences = {}
    for schedule in (None, "turnByTurn"):
        spec = _example(schedule)
        path = resolve_model_path(spec.model.path)
        tokenizer = load_tokenizer(path)
        eos = stop_token_ids(tokenizer, path)
        settings = spec.rollout.multi_turn_settings
        tools = make_tools(settings)
        task = make_task(spec.data, spec.algorithm.seed, tokenizer, tools.schemas)
        engine = TorchEngine(path, dtype="float32", kv_capacity_tokens=8192, eos_token_ids=eos)
        scorer = Scorer(spec.reward)
        try:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rljob_worker.loop"):
                stage = _MultiTurnRollout(spec, RankConfig(0, 1), engine, tokenizer, task,
                                          scorer, eos, tools=tools, context_length=256)  # fmt: skip
            # One rank drives all 4 prompts x groupSize 4 = 16 conversations, 8 at a time:
            # turnByTurn runs each turn in 2 groups, one after the other, and says so.
            warned = [
                r.getMessage() for r in caplog.records if "groups one after" in r.getMessage()
            ]
            assert bool(warned) == (schedule == "turnByTurn")
            assert all(
                "this rank's 16 conversations: each turn runs in 2 groups" in w for w in warned
            )
            called.clear()
            experience = stage(1)
            assert called == ["run_turn_by_turn" if schedule == "turnByTurn" else "run"]
            experiences[schedule] = experience
        finally:
            scorer.close()
            tools.close()
            engine.shutdown()
    first = experiences[None]
    assert sum(len(r) for r in first.response_ids) > 0
    for experience in experiences.values():
        assert experience.response_ids == first.response_ids
        assert experience.loss_masks == first.loss_masks
        assert experience.rewards == first.rewards


def test_partial_rollouts_on_the_torch_engine_cut_turns_and_finish_them_token_for_token() -> None:
    """spec.rollout.multiTurn.partialRollout with the real engine: rollouts of 8 groups of 2
    under way and 4 trained; a stop aborts the queued requests and the running batch (its rows
    keep what they sampled), and a later rollout finishes those turns. Every trained token is
    one the engine sampled, in order, and a cut turn ends with exactly the tokens it was asked
    for. (A stop inside the decode loop, the tokens before it kept: test_torch_engine.py.)"""
    from rljob.api import DataSpec
    from rljob_worker.agentic.driver import Trajectory
    from rljob_worker.agentic.tool_calls import ParsedCall, ToolCall

    class TwoCalls(MultiTurnRollout):
        def calls_of(self, t: Trajectory) -> list[ParsedCall]:
            return [ToolCall("calculator", {"expression": "2+2"})] if t.turns < 3 else []

        def turn_tokens(self, t: Trajectory) -> int | None:
            return 4 * (1 + (t.conversation * 5 + t.turns) % 6)

        async def _tool_turn(self, t: Trajectory, calls: list[ParsedCall], eos: bool) -> None:
            # Tools of different lengths: the conversations' turns fall into different
            # batches, so a stop comes while one is running.
            await asyncio.sleep(0.01 * (t.conversation % 5))
            await super()._tool_turn(t, calls, eos)

    path = resolve_model_path(TINY_QWEN2)
    tokenizer = load_tokenizer(path)
    # No end-of-sequence: every turn runs to its cap, so a cut turn's length is checkable.
    engine = TorchEngine(path, dtype="float32", kv_capacity_tokens=16384, eos_token_ids=[])
    spy = Recording(engine)
    tools = make_tools(MultiTurnSpec(max_turns=3, max_tool_response_length=8))
    task = make_task(DataSpec(source="builtin:calculator", max_prompt_length=256), 0, tokenizer)
    prompts = [list(p.prompt_ids) for p in task.sample(200, salt=2)]
    rollout = TwoCalls(
        EngineRouter([spy]),
        ChatFormat(tokenizer, tools.schemas),
        tools,
        Limits(3, 200, 8, max_concurrent_conversations=16, context_length=4096),
        [],
        lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
    )
    carried: list[Trajectory] = []
    trained: list[Trajectory] = []
    started = cut = rollouts = 0
    # Whether a stop finds a request queued or decoding depends on timing: at least 3
    # rollouts, and on until one has cut a turn and a conversation begun in one rollout was
    # trained after a later one (at most 12; both came within 3 in most runs, but not in one
    # of two runs with the machine's two cores busy elsewhere).
    while rollouts < 3 or (not (cut and any(t.rollouts > 1 for t in trained)) and rollouts < 12):
        k, rollouts = rollouts, rollouts + 1
        new = (8 - len({t.group for t in carried})) * 2
        fresh = rollout.start(prompts[started : started + new], 2, first=started)
        started += new
        sampling = SamplingParams(1, temperature=1.0, seed=k)
        result = asyncio.run(rollout.run_partial([*carried, *fresh], sampling, 4))
        assert rollout.router.requests_in_flight == 0 and len(result.trained) == 8
        cut += sum(t.turn_start is not None for t in result.carried)
        trained += result.trained
        carried = result.carried
    assert cut > 0 and any(a.aborted for _, a in spy.answers)
    assert any(t.rollouts > 1 for t in trained)
    answers: dict[tuple[int, ...], list[int]] = {}
    for ids, answer in spy.answers:  # each request's answer, keyed by its conversation's prompt
        prompt = next(tuple(p) for p in prompts if ids[: len(p)] == p)
        answers.setdefault(prompt, []).extend(answer.token_ids)
    for t in trained:
        sampled = [x for x, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
        assert sampled == answers[tuple(t.prompt_ids)] and len(t.logprobs) == len(sampled)
        caps = [rollout.turn_tokens(Trajectory(t.conversation, [], turns=n)) or 0
                for n in range(t.turns)]  # fmt: skip
        assert t.turns == 3 and len(sampled) == sum(caps)
    engine.shutdown()
    tools.close()
