"""Issue 32 with the real `sglang.Engine` on one GPU (marker gpu): the multi-turn rollout over
async_generate inside staged awake, and the whole loop (rljob run's local driver) in mode multiTurn.

SGLang comes from the project's GPU set, as in test_sglang_gpu.py; with RLJOB_GPU_SGLANG=1 a
missing sglang is an error, not a skip. Memory is measured by the driver (mem_get_info).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.sglang_gpu import builtin_model_copy, sglang_gpu_missing

from rljob.api import DataSpec, MultiTurnSpec, parse_manifest
from rljob.report import Stage
from rljob_worker.engines.base import ALL_TAGS, TAG_WEIGHTS

if (missing := sglang_gpu_missing()) is not None:
    pytest.skip(missing, allow_module_level=True)

from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.driver import Limits, MultiTurnRollout, Trajectory
from rljob_worker.agentic.routing import EngineRouter
from rljob_worker.agentic.tool_calls import ParsedCall, ToolCall
from rljob_worker.agentic.tools import make_tools
from rljob_worker.checkpoint import ROLLOUT_KEY, checkpoint_dir
from rljob_worker.driver.local import run_local
from rljob_worker.engines.base import SamplingParams
from rljob_worker.engines.sglang_engine import SGLangEngine
from rljob_worker.model import load_tokenizer
from rljob_worker.task import make_task

MiB, GiB = 2**20, 2**30
PAGE_SLACK = 8 * MiB  # the saver maps whole 2 MiB pages


def _free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builtin model as it is: a context of 256 tokens, which the calculator task's
    conversations outgrow (the loop must cut them off there; sglang refuses a request past it)."""
    return builtin_model_copy(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builtin model with room for several turns (max_position_embeddings 2048; RoPE
    extends to it, and the random weights do not care)."""
    directory = builtin_model_copy(tmp_path_factory.mktemp("tiny-qwen2-2k"))
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _setup(model: Path, problems: int, salt: int) -> tuple[Any, Any, list[list[int]], Any, Any]:
    """The tokenizer, the tools, `problems` calculator prompts 4 times each (groups of 4), the
    model's weights on the GPU (what the trainer would send) and an sglang engine, asleep."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model)
    tools = make_tools(MultiTurnSpec(tools=["builtin:calculator", "builtin:python"]))
    task = make_task(DataSpec(source="builtin:calculator", max_prompt_length=512), 0, tokenizer)
    prompts = [list(p.prompt_ids) for p in task.sample(problems, salt=salt) for _ in range(4)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    weights = [(n, p.detach().to("cuda")) for n, p in hf.named_parameters()]
    engine = SGLangEngine(model_path=str(model), dtype="bfloat16", mem_fraction_static=0.3)
    return tokenizer, tools, prompts, weights, engine


def _wake(engine: Any, weights: Any) -> None:
    """wake_weights, the update, then wake_kv_cache, as the staged loop does."""
    engine.resume([TAG_WEIGHTS])
    engine.update_weights(weights)
    engine.flush_cache()
    engine.resume([t for t in ALL_TAGS if t != TAG_WEIGHTS])


def _on(cls: Any, engine: Any, tokenizer: Any, tools: Any, limits: Limits) -> Any:
    """A rollout of class `cls` over `engine` alone."""
    return cls(
        EngineRouter([engine]),
        ChatFormat(tokenizer, tools.schemas),
        tools,
        limits,
        [tokenizer.eos_token_id],
        lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
    )


class ThreeTurns(MultiTurnRollout):
    """Every conversation calls builtin:python after its first two turns (the random model
    would rarely write a call itself); generation is sglang's."""

    def calls_of(self, t: Trajectory) -> list[ParsedCall]:
        if t.turns < 3:
            return [ToolCall("python", {"expression": f"sum(range({t.conversation}))"})]
        return []


def test_staged_multi_turn_rollouts_end_before_release_and_give_every_byte_back(
    long_context_dir: Path,
) -> None:
    tokenizer, tools, prompts, weights, engine = _setup(long_context_dir, 16, salt=0)
    try:
        asleep = _free()
        kept: list[int] = []
        for iteration in range(2):  # the second iteration is where stage-ordering bugs show
            _wake(engine, weights)
            rollout = _on(ThreeTurns, engine, tokenizer, tools,
                          Limits(max_turns=4, max_response_length=160, max_tool_response_length=16,
                                 max_concurrent_conversations=32, max_turn_tokens=32,
                                 context_length=2048))  # fmt: skip
            sampling = SamplingParams(max_new_tokens=1, temperature=1.0, seed=iteration)
            trajectories = engine.run_async(rollout.run(prompts, sampling))
            # No request in flight when the rollout returns: the release below is allowed (the
            # adapter refuses one while any async_generate is unanswered).
            assert engine.requests_in_flight == 0 and rollout.router.requests_in_flight == 0
            assert len(trajectories) == 64 and all(t.ending is not None for t in trajectories)
            assert sum(t.turns for t in trajectories) >= 64 * 2
            for t in trajectories:  # token in, token out: the sampled tokens carry log-probs
                assert len(t.logprobs) == sum(t.loss_mask) and len(t.response_ids) <= 160
            cached = sum(t.cached_tokens or 0 for t in trajectories)
            sent = sum(t.prompt_tokens for t in trajectories)
            print(f"\niteration {iteration}: {sum(t.turns for t in trajectories)} turns, "
                  f"{sum(t.tool_calls for t in trajectories)} tool calls, prefix-cache hit "
                  f"{cached / sent:.3f}")  # fmt: skip
            assert cached > 0  # later turns found their prefix in the radix cache
            engine.release(list(ALL_TAGS))  # sleep
            kept.append(asleep - _free())
        print(f"after each iteration's release: {[round(k / MiB) for k in kept]} MiB stay taken")
        # Every released byte back, up to what sglang's own allocator cached for the requests
        # (outside the saver's regions), and no growth from one iteration to the next. On one
        # H200 1366 MiB stayed taken after each of the two iterations (test_sglang_gpu's single-
        # turn rollouts keep under 1 GiB on an H100); the bound is that with room, the growth
        # check below is the one that catches a leak.
        assert all(k <= 2 * GiB for k in kept)
        assert kept[1] <= kept[0] + PAGE_SLACK
    finally:
        engine.shutdown()
        tools.close()


def _loop_job(
    model: Path,
    iterations: int,
    data: dict[str, Any] | None = None,
    multi_turn: dict[str, Any] | None = None,
    **spec: Any,
) -> Any:
    """An RLJob of the loop in mode multiTurn on sglang (staged, half the card) over the builtin
    calculator task, 4 prompts x 4 a rollout; `data`, `multi_turn` and `spec` add settings."""
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "multi-turn-sglang"},
        "spec": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "algorithm": {"groupSize": 4, "iterations": iterations},
            "data": {"source": "builtin:calculator", "trainBatchSize": 4, "maxPromptLength": 200,
                     **(data or {})},
            "reward": {"function": "numeric"},
            "rollout": {
                "engine": "sglang", "wakeUp": "staged", "memFractionStatic": 0.5,
                "mode": "multiTurn",
                "multiTurn": {"maxTurns": 3, "maxToolResponseLength": 16,
                              "tools": ["builtin:calculator", "builtin:python"],
                              **(multi_turn or {})},
            },
            "resources": {"gpusPerWorker": 1},
            **spec,
        },
    }  # fmt: skip
    return parse_manifest(doc)[1]


def test_rljob_run_loop_in_mode_multi_turn_with_sglang(builtin_dir: Path) -> None:
    validation = {"source": "builtin:calculator", "everyIterations": 2, "maxPrompts": 8}
    job = _loop_job(builtin_dir, 2, {"validation": validation}, {"maxResponseLength": 96})
    run = run_local(job, 1, "cuda")
    assert run.ok, run.errors
    reports = run.reports
    assert [r.iteration for r in reports] == [0, 1, 2]
    for report in reports:
        assert report.multi_turn is not None and report.multi_turn.turns_mean >= 1
        # Prompts of 192 tokens in a 256-token context: no trajectory went past it (sglang
        # refuses such a request, which failed this run before the driver kept to the context).
        assert report.response_length_max is not None and report.response_length_max <= 256 - 192
        assert report.multi_turn.prefix_cache_hit_rate is not None  # sglang reports cached tokens
    for report in reports[1:]:
        stages = [s.stage for s in report.samples]
        assert stages == [Stage.TRAIN, Stage.OFFLOAD_OPTIMIZER, Stage.WAKE_WEIGHTS,
                          Stage.OFFLOAD_TRAIN, Stage.WAKE_KV_CACHE, Stage.ROLLOUT, Stage.SLEEP]  # fmt: skip
        assert report.policy_loss is not None
    # Held-out conversations (whole ones, with the tools) at iteration 0 and the last, inside
    # the rollout stage: the staged release after them found nothing in flight (run.ok).
    validated = {r.iteration: r.validation for r in reports if r.validation is not None}
    assert sorted(validated) == [0, 2]
    assert all(v is not None and v.prompts == 8 and v.reward_mean is not None
               for v in validated.values())  # fmt: skip
    print("\n" + "\n".join(
        f"iteration {r.iteration}: reward {r.reward_mean}, validation {r.validation}, {r.multi_turn}"
        for r in reports
    ))  # fmt: skip


class LongTurns(ThreeTurns):
    """ThreeTurns whose turns sample 16 to 128 tokens by conversation and turn, so that a
    partial rollout's stop finds requests mid-turn on the engine."""

    def turn_tokens(self, t: Trajectory) -> int | None:
        return 16 * (1 + (t.conversation * 7 + t.turns) % 8)


def test_partial_rollouts_abort_mid_turn_go_on_next_time_and_give_every_byte_back(
    long_context_dir: Path,
) -> None:
    """spec.rollout.multiTurn.partialRollout on sglang: each staged iteration keeps 16 groups of
    4 under way and trains the 8 oldest that end; sglang's abort stops the rest (each keeps what
    it sampled), the release finds nothing in flight, and the next iteration goes on from
    there. A turn cut by a stop and finished later has exactly the tokens it was asked for."""
    tokenizer, tools, prompts, weights, engine = _setup(long_context_dir, 64, salt=1)
    eos = tokenizer.eos_token_id
    try:
        asleep = _free()
        kept: list[int] = []
        carried: list[Trajectory] = []
        started, cut_mid_turn, trained_all = 0, 0, []
        for iteration in range(3):
            _wake(engine, weights)
            rollout = _on(LongTurns, engine, tokenizer, tools,
                          Limits(max_turns=4, max_response_length=1024, max_tool_response_length=16,
                                 max_concurrent_conversations=64, context_length=2048))  # fmt: skip
            new = (16 - len({t.group for t in carried})) * 4
            fresh = rollout.start(prompts[started : started + new], 4, first=started)
            started += new
            sampling = SamplingParams(max_new_tokens=1, temperature=1.0, seed=iteration)
            result = engine.run_async(rollout.run_partial([*carried, *fresh], sampling, 8))
            assert engine.requests_in_flight == 0 and rollout.router.requests_in_flight == 0
            assert len(result.trained) == 32 and all(t.ending for t in result.trained)
            cut_mid_turn += sum(t.turn_start is not None for t in result.carried)
            print(f"\niteration {iteration}: trained 32 ({sum(t.rollouts > 1 for t in result.trained)}"
                  f" resumed), carried {len(result.carried)} ({result.paused} paused, "
                  f"{sum(t.turn_start is not None for t in result.carried)} mid-turn)")  # fmt: skip
            trained_all += result.trained
            carried = result.carried
            engine.release(list(ALL_TAGS))  # sleep: allowed, nothing in flight
            kept.append(asleep - _free())
        assert cut_mid_turn > 0, "no stop found a request mid-turn: the abort was not exercised"
        resumed = [t for t in trained_all if t.rollouts > 1]
        assert resumed, "no trained conversation went on from an earlier rollout"
        for t in trained_all:
            assert len(t.logprobs) == sum(t.loss_mask) and t.turn_start is None
            sampled = [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
            if eos not in sampled and t.ending == "answer":  # every turn ran to its cap
                caps = []
                for turn in range(t.turns):
                    probe = Trajectory(t.conversation, [], turns=turn)
                    caps.append(rollout.turn_tokens(probe) or 0)
                assert len(sampled) == sum(caps), (t.conversation, t.rollouts, caps)
        print(f"after each iteration's release: {[round(k / MiB) for k in kept]} MiB stay taken")
        assert all(k <= 2 * GiB for k in kept)
        assert max(kept[1:]) <= kept[0] + PAGE_SLACK
    finally:
        engine.shutdown()
        tools.close()


def _partial_job(model: Path, root: Path, iterations: int) -> Any:
    """The loop's job with partialRollout: 4 prompts trained a rollout, 8 groups of 4 under way
    (overSample 1.0), 8 conversations at a time, a checkpoint every iteration."""
    partial = {"maxResponseLength": 56, "maxConcurrentConversations": 8, "schedule": "async",
               "partialRollout": {"overSample": 1.0}}  # fmt: skip
    checkpoint = {"path": str(root / "ckpt"), "everyIterations": 1, "keep": 10}
    return _loop_job(model, iterations, multi_turn=partial, checkpoint=checkpoint)


def _carry(root: Path, iteration: int) -> tuple[int, int]:
    """What the checkpoint of `iteration` keeps for the next rollout: the next conversation's
    number and how many groups it carries."""
    own = torch.load(checkpoint_dir(root / "ckpt", iteration) / "rng-rank0.pt",
                     weights_only=False)[ROLLOUT_KEY]  # fmt: skip
    return int(own["nextConversation"]), len({t.group for t in own["carried"]})


def test_rljob_run_with_partial_rollout_on_sglang_trains_its_groups_and_resumes_the_carried(
    builtin_dir: Path, tmp_path: Path
) -> None:
    """partialRollout through the whole loop on sglang (staged): every iteration trains exactly
    its 4 groups of 4, the rest stay under way (paused: sglang aborts what is mid-turn, and the
    release after it finds nothing in flight), each checkpoint keeps them, and a run resumed
    from the last one starts the next rollout with them, numbering new conversations on."""
    under_way = 8
    run = run_local(_partial_job(builtin_dir, tmp_path, 2), 1, "cuda")
    assert run.ok, run.errors
    reports = sorted(run.reports, key=lambda r: r.iteration)
    assert [r.iteration for r in reports] == [0, 1, 2]
    for report in reports:
        assert report.multi_turn is not None
        # Exactly the trained groups' conversations have rewards, never the carried ones.
        assert [i.reward_count for i in run.iterations if i.iteration == report.iteration] == [16]
        # Paused: carried and not ended (a carried group may hold ended conversations).
        assert report.multi_turn.paused <= (under_way - 4) * 4
    # The first rollout: 8 at a time, stopped once 16 have ended: the last 8 never began.
    assert reports[0].multi_turn is not None and reports[0].multi_turn.paused >= 8
    for report in reports[1:]:
        assert [s.stage for s in report.samples] == [
            Stage.TRAIN, Stage.CHECKPOINT, Stage.OFFLOAD_OPTIMIZER, Stage.WAKE_WEIGHTS,
            Stage.OFFLOAD_TRAIN, Stage.WAKE_KV_CACHE, Stage.ROLLOUT, Stage.SLEEP]  # fmt: skip
    following, carried = _carry(tmp_path, 2)
    assert carried > 0 and following > 0
    resumed = run_local(_partial_job(builtin_dir, tmp_path, 3), 1, "cuda")
    assert resumed.ok, resumed.errors
    assert resumed.resumed_from == 2
    # The resumed rollout began with the checkpoint's carried groups and started only the
    # groups missing to 8, numbered on from where the checkpoint left off (a run that resumed
    # without them starts 8 new groups from conversation 0).
    assert _carry(tmp_path, 3)[0] == following + (under_way - carried) * 4
    print("\n" + "\n".join(f"iteration {r.iteration}: {r.multi_turn}" for r in
                              [*reports, *resumed.reports]))  # fmt: skip
