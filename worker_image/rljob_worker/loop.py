"""The colocated worker of one rank: trainer + engine + stage machine built from the job spec.

It runs the iterations and reports every stage sample, iteration and OOM through `emit`; it does
not know whether a local process group, Ray or a test drives it (the caller sets up the group).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rljob.api import (
    CheckpointFailure,
    MisfitAction,
    MultiTurnSchedule,
    PlanStatus,
    ResumePoint,
    RLJobSpec,
)
from rljob.plan import (
    is_auto,
    offload_choice,
    rank_plan,
    resolved_bucket_bytes,
    resolved_rollout,
    resolved_spec,
)
from rljob.report import LoadSample, OOMRecord, StageSample
from rljob_worker import allocator_report
from rljob_worker import checkpoint as checkpoints
from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.driver import (
    Limits,
    MultiTurnRollout,
    RolloutCounts,
    Trajectory,
    run_on,
)
from rljob_worker.agentic.routing import EngineRouter
from rljob_worker.agentic.tools import ToolSet, make_tools
from rljob_worker.engines import make_engine
from rljob_worker.engines.base import ALL_TAGS, AsyncGenerate, RolloutEngine, SamplingParams
from rljob_worker.export import export_target_problem
from rljob_worker.memory import MemoryMeter, OOMInjection, StageOOM
from rljob_worker.model import load_tokenizer, resolve_model_path, stop_token_ids, torch_dtype
from rljob_worker.reward import Scorer
from rljob_worker.stages import StageMachine
from rljob_worker.staging import Staging, overlap_staging
from rljob_worker.sync_send import Bucket
from rljob_worker.task import Problem, Task, make_task, validation_problems
from rljob_worker.train import Experience, Trainer, TrainStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankConfig:
    """Where this rank runs; everything about the job itself is in the RLJobSpec."""

    rank: int
    world_size: int
    device: str = "cpu"
    node: str = ""
    inject_oom: OOMInjection | None = None
    # Compare every engine weight with the training tensor sent for it, after each update
    # (costs a hash per parameter; tests and `rljob run --verify-weights` turn it on).
    verify_weights: bool = False
    # The job this rank runs for (the RLJob's uid; one `rljob run`): checkpoints record it, and
    # checkpoint.resume Never still continues from this job's own (checkpoint.resume_point).
    job: str | None = None


@dataclass(frozen=True)
class WeightCheck:
    """Per-parameter digests of what training sent and what the engine holds after the update."""

    sent: dict[str, str]
    engine: dict[str, str]

    @property
    def mismatched(self) -> list[str]:
        return sorted(
            n
            for n in self.sent.keys() | self.engine.keys()
            if self.sent.get(n) != self.engine.get(n)
        )


@dataclass(frozen=True)
class RolloutStats:
    """One rank's rollout, as figures the driver combines over ranks (iteration_reports)."""

    responses: int
    reward_mean: float
    # Sum of squared deviations from this rank's mean: ranks combine these exactly (Chan et
    # al.'s pairwise update), where sums of squares would cancel.
    reward_m2: float
    reward_min: float
    reward_max: float
    # Responses with the full score (reward >= 1.0, what every task gives a right answer).
    correct: int
    response_tokens: int
    response_length_max: int
    # Responses that reached data.maxResponseLength without an end-of-sequence token
    # (multiTurn: trajectories cut off at the budget or maxTurns).
    truncated: int
    # mode multiTurn (None in singleTurn): the conversations' turns, tool calls and outcomes.
    multi_turn: RolloutCounts | None = None


def rollout_stats(
    experience: Experience,
    max_response_length: int,
    eos_ids: Sequence[int],
    multi_turn: RolloutCounts | None = None,
) -> RolloutStats:
    rewards, responses = experience.rewards, experience.response_ids
    mean = sum(rewards) / len(rewards)
    return RolloutStats(
        responses=len(rewards),
        reward_mean=mean,
        reward_m2=sum((r - mean) ** 2 for r in rewards),
        reward_min=min(rewards),
        reward_max=max(rewards),
        correct=sum(r >= 1.0 for r in rewards),
        response_tokens=sum(len(r) for r in responses),
        response_length_max=max(len(r) for r in responses),
        truncated=multi_turn.cut_off
        if multi_turn is not None
        else sum(
            len(r) >= max_response_length and (not r or r[-1] not in eos_ids) for r in responses
        ),
        multi_turn=multi_turn,
    )


@dataclass(frozen=True)
class ValidationStats:
    """One rank's share of spec.data.validation at an iteration, as figures the driver combines
    over ranks (a rank may hold no prompt: fewer prompts than ranks)."""

    prompts: int
    responses: int
    reward_sum: float
    correct: int
    response_tokens: int
    truncated: int
    reward_errors: int
    seconds: float


# Validation's sampling seeds: apart from the training rollouts' (seed * 1_000_003 + salt).
VALIDATION_SEED_OFFSET = 1 << 40


@dataclass(frozen=True)
class RankIteration:
    """One rank's account of one iteration (its stage samples travel separately)."""

    rank: int
    iteration: int
    stages: tuple[str, ...]
    reward_sum: float
    reward_count: int
    kl_mean: float | None
    loss: float | None
    kv_capacity_tokens: int
    weights: WeightCheck | None = None
    # Seconds of the weight update inside wake_weights (without the engine's resume).
    weight_sync_seconds: float | None = None
    # The part of weight_sync_seconds spent handing buckets to the engine (update_weights).
    weight_handoff_seconds: float | None = None
    # What the stage machine offloads (spec.offload Auto: the memory plan's choice).
    offload_optimizer: bool | None = None
    offload_params: bool | None = None
    # Rank 0, iteration 0: the memory plan on this rank's GPU, for status.plan (issue 19).
    plan: PlanStatus | None = None
    # Every rank, its first iteration: its start-up (models built and loaded), measured.
    load: LoadSample | None = None
    # This iteration's rollout and (from iteration 1) policy update, as combinable figures.
    rollout: RolloutStats | None = None
    train: TrainStats | None = None
    # Reward calls that failed and scored 0 (spec.reward.onError Zero).
    reward_errors: int = 0
    # The first iteration of a run resumed from this iteration's checkpoint (its train is in
    # the checkpoint, so the report has no train figures).
    resumed_from: int | None = None
    resume_point: ResumePoint | None = None  # with the checkpoint's directory
    # The checkpoint the ranks agreed complete in this iteration (this rank's part; an
    # asynchronous one is an earlier iteration's) and this iteration's export (rank 0).
    checkpoint: checkpoints.SavedCheckpoint | None = None
    export_path: str | None = None
    # The training state's copies in order, "stage: start|wait transfer" (overlapStaging).
    staging: tuple[str, ...] = ()
    # spec.data.validation, at the iterations it is due (validation_due).
    validation: ValidationStats | None = None


# A SavedCheckpoint or ModelExported on its own: one the ranks agreed complete, or an export
# rank 0 wrote, in an iteration that then failed (its report never went out), so
# status.checkpoint and status.export still name it.
RankEvent = (
    StageSample
    | RankIteration
    | OOMRecord
    | CheckpointFailure
    | checkpoints.SavedCheckpoint
    | checkpoints.ModelExported
)


def _send_unreported(
    keeper: checkpoints.Keeper, send: Callable[[RankEvent], None], rank: int
) -> None:
    """After a failed iteration: the checkpoints the ranks agreed complete and the export
    written in it, each on its own (that iteration's report, which would carry them, never
    goes out). A send that fails is logged: the failure itself is the news, and goes out
    after."""
    saved, exported = keeper.take()
    parts: list[RankEvent] = [exported] if exported is not None else []
    for part in [*parts, *saved]:
        try:
            send(part)
        except Exception:
            log.exception("rank %d: %s not reported", rank, part)


@dataclass
class RankResult:
    rank: int
    samples: list[StageSample] = field(default_factory=list)
    iterations: list[RankIteration] = field(default_factory=list)
    oom: OOMRecord | None = None


def join_process_group(
    config: RankConfig, init_method: str, threads_per_rank: int, timeout_seconds: float
) -> None:
    """Put this rank on its device and into the job's process group (NCCL on CUDA, else gloo).

    Every driver calls this in the rank's own process before run_rank.
    """
    from datetime import timedelta

    device: torch.device | None = None
    if config.device.startswith("cuda"):
        device = torch.device(config.device)
        torch.cuda.set_device(device)
    else:
        # Ranks share the host's cores; a few threads each keep them from thrashing.
        torch.set_num_threads(threads_per_rank)
    dist.init_process_group(
        backend="nccl" if device is not None else "gloo",
        init_method=init_method,
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=timeout_seconds),
        # Binds NCCL to this rank's GPU (collectives and barrier() need not guess it).
        device_id=device,
    )


def tensor_digest(tensor: torch.Tensor) -> str:
    """Exact content digest (bytes of the tensor as stored), for weight-equality checks."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def prompts_per_rank(spec: RLJobSpec, world_size: int) -> int:
    prompts = spec.data.train_batch_size
    if prompts % world_size:
        raise ValueError(
            f"spec.data.trainBatchSize={prompts} must be a multiple of the {world_size} ranks "
            "(every rank rolls out and trains on the same number of prompts)"
        )
    return prompts // world_size


def validation_due(spec: RLJobSpec, iteration: int) -> bool:
    """spec.data.validation runs at iteration 0 (before any update), every N-th, and the last."""
    validation = spec.data.validation
    return validation is not None and (
        iteration % validation.every_iterations == 0 or iteration == spec.algorithm.iterations
    )


@dataclass(frozen=True)
class _Generated:
    """What one generation over some problems gave: the experience (rewards scored), the reward
    calls that failed, and (multiTurn) the conversations' counts."""

    experience: Experience
    reward_errors: int
    counts: RolloutCounts | None = None


@dataclass(eq=False)
class _Rollout:
    """The rollout stage's work: sample prompts, generate group_size responses each, reward;
    at the iterations validation is due, then answer this rank's validation prompts."""

    spec: RLJobSpec
    config: RankConfig
    engine: RolloutEngine
    tokenizer: Any
    task: Task
    scorer: Scorer
    eos_ids: Sequence[int]
    # This rank's share of spec.data.validation's problems (validation_problems).
    validation_problems: Sequence[Problem] = ()
    reward_errors: int = field(default=0, init=False)  # of the latest rollout
    prompts: int = field(init=False)
    validated: ValidationStats | None = field(default=None, init=False)  # of the latest

    def __post_init__(self) -> None:
        self.prompts = prompts_per_rank(self.spec, self.config.world_size)

    def _problems(self, iteration: int) -> list[Problem]:
        world, rank = self.config.world_size, self.config.rank
        return self.task.sample(self.prompts, salt=iteration * world + rank)

    def _seed(self, iteration: int) -> int:
        world, rank = self.config.world_size, self.config.rank
        return self.spec.algorithm.seed * 1_000_003 + iteration * world + rank

    def _sampling(self, iteration: int, max_new_tokens: int) -> SamplingParams:
        sampling = self.spec.rollout.sampling
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=self._seed(iteration),
        )

    def __call__(self, iteration: int) -> Experience:
        generated = self._train_rollout(iteration)
        spec = self.spec
        self.reward_errors = generated.reward_errors
        self._took(generated)
        self.validated = self._validate(iteration) if validation_due(spec, iteration) else None
        return generated.experience

    def _train_rollout(self, iteration: int) -> _Generated:
        """The iteration's rollout for training: this rank's prompts, group_size responses each."""
        spec = self.spec
        return self._generate(
            self._problems(iteration),
            spec.algorithm.group_size,
            self._sampling(iteration, spec.data.max_response_length),
        )

    def _took(self, generated: _Generated) -> None:
        """What the training rollout leaves besides its experience (multiTurn: the counts)."""

    def _generate(
        self, problems: Sequence[Problem], group: int, sampling: SamplingParams
    ) -> _Generated:
        prompt_ids: list[list[int]] = []
        group_ids: list[int] = []
        for index, problem in enumerate(problems):
            prompt_ids += [list(problem.prompt_ids)] * group  # encoded under spec.data's rule
            group_ids += [index] * group
        completions = self.engine.generate_with_logprobs(prompt_ids, sampling)
        responses = [c.token_ids for c in completions]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        scored = self.scorer([p for p in problems for _ in range(group)], texts)
        experience = Experience(
            prompt_ids, [list(r) for r in responses], scored.scores, group_ids,
            [c.logprobs for c in completions],
        )  # fmt: skip
        return _Generated(experience, scored.errors)

    def _validate(self, iteration: int) -> ValidationStats:
        """This rank's validation prompts, answered by the weights the rollout just used (the
        engine is awake), scored by the job's reward; nothing of it is trained on."""
        validation = self.spec.data.validation
        assert validation is not None
        problems = self.validation_problems
        if not problems:
            return ValidationStats(0, 0, 0.0, 0, 0, 0, 0, 0.0)
        start = time.monotonic()
        sampling = SamplingParams(
            max_new_tokens=self.spec.data.max_response_length,
            temperature=validation.temperature,
            seed=self._seed(iteration) + VALIDATION_SEED_OFFSET,
        )
        generated = self._generate(problems, validation.samples_per_prompt, sampling)
        rewards = generated.experience.rewards
        stats = rollout_stats(
            generated.experience, self.spec.data.max_response_length, self.eos_ids,
            generated.counts,
        )  # fmt: skip
        return ValidationStats(
            prompts=len(problems),
            responses=len(rewards),
            reward_sum=sum(rewards),
            correct=stats.correct,
            response_tokens=stats.response_tokens,
            truncated=stats.truncated,
            reward_errors=generated.reward_errors,
            seconds=time.monotonic() - start,
        )


@dataclass(eq=False)
class _MultiTurnRollout(_Rollout):
    """The rollout stage of mode multiTurn: group_size conversations per prompt, driven with
    asyncio over this rank's engine (agentic/driver.py), every one ended or cut off before the
    stage returns (the engine sleeps next)."""

    tools: ToolSet = field(kw_only=True)
    context_length: int | None = field(kw_only=True)
    multi_turn: MultiTurnRollout = field(init=False)
    counts: RolloutCounts = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        spec, engine, tools, context_length = (
            self.spec,
            self.engine,
            self.tools,
            self.context_length,
        )
        settings = spec.rollout.multi_turn_settings
        assert settings is not None
        if context_length is not None and spec.data.max_prompt_length >= context_length:
            raise ValueError(
                f"spec.data.maxPromptLength {spec.data.max_prompt_length} leaves no room for a "
                f"turn in the model's context of {context_length} tokens "
                "(config.json max_position_embeddings): lower it"
            )
        if not isinstance(engine, AsyncGenerate):
            raise ValueError(
                f"spec.rollout.mode multiTurn: the {spec.rollout.engine} engine has no "
                "async_generate (use engine torch or sglang with tensorParallelSize 1)"
            )
        self.multi_turn = MultiTurnRollout(
            EngineRouter([engine]),
            ChatFormat(self.tokenizer, tools.schemas),
            tools,
            Limits(
                max_turns=settings.max_turns,
                max_response_length=settings.max_response_length,
                max_tool_response_length=settings.max_tool_response_length,
                max_concurrent_conversations=settings.max_concurrent_conversations,
                context_length=context_length,
            ),
            self.eos_ids,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
        )
        self.counts = RolloutCounts()  # of the latest rollout
        # spec.rollout.multiTurn.partialRollout: the conversations a rollout left under way (or
        # ended in groups it did not train), the problem of each of their groups, and the
        # number the next new conversation gets. Saved with each checkpoint (rollout_state).
        self.carried: list[Trajectory] = []
        self.problems_of: dict[int, Problem] = {}
        self.next_conversation = 0
        self.next_group = 0
        conversations = self.prompts * spec.algorithm.group_size
        if settings.partial_rollout is not None:
            under_way = spec.algorithm.group_size * settings.partial_rollout.groups_under_way(
                self.prompts
            )
            if settings.max_concurrent_conversations < under_way:
                log.warning(
                    "spec.rollout.multiTurn.partialRollout keeps %d conversations a rank under "
                    "way, maxConcurrentConversations %d: the rest wait for a free place "
                    "(docs/multi-turn.md#partial-rollout)",
                    under_way,
                    settings.max_concurrent_conversations,
                )
        if (
            settings.schedule is MultiTurnSchedule.TURN_BY_TURN
            and settings.max_concurrent_conversations < conversations
        ):
            log.warning(
                "spec.rollout.multiTurn.schedule turnByTurn with maxConcurrentConversations %d "
                "below this rank's %d conversations: each turn runs in %d groups one after "
                "another, each waiting for its slowest member (docs/multi-turn.md#which-schedule)",
                settings.max_concurrent_conversations,
                conversations,
                -(-conversations // settings.max_concurrent_conversations),
            )

    def _took(self, generated: _Generated) -> None:
        assert generated.counts is not None
        self.counts = generated.counts

    @property
    def partial(self) -> bool:
        """spec.rollout.multiTurn.partialRollout is set."""
        settings = self.spec.rollout.multi_turn_settings
        return settings is not None and settings.partial_rollout is not None

    def _train_rollout(self, iteration: int) -> _Generated:
        settings = self.spec.rollout.multi_turn_settings
        assert settings is not None
        if settings.partial_rollout is None:
            return super()._train_rollout(iteration)
        # The partial rollout: prompts x (1 + overSample) groups under way, the carried ones
        # first; the oldest `prompts` groups that end are trained, the rest carried on.
        group = self.spec.algorithm.group_size
        under_way = settings.partial_rollout.groups_under_way(self.prompts)
        new = under_way - len({t.group for t in self.carried})
        world, rank = self.config.world_size, self.config.rank
        problems = self.task.sample(new, salt=iteration * world + rank) if new > 0 else []
        fresh = self.multi_turn.start(
            [list(p.prompt_ids) for p in problems for _ in range(group)],
            group,
            self.next_conversation,
            self.next_group,
        )
        for index, problem in enumerate(problems):
            self.problems_of[self.next_group + index] = problem
        self.next_conversation += len(fresh)
        self.next_group += len(problems)
        sampling = self._sampling(iteration, self.spec.data.max_response_length)
        result = run_on(
            self.engine,
            self.multi_turn.run_partial([*self.carried, *fresh], sampling, self.prompts),
        )
        self.carried = result.carried
        groups = sorted({t.group for t in result.trained})
        asked = [self.problems_of[t.group] for t in result.trained]
        for g in groups:
            del self.problems_of[g]
        position = {g: i for i, g in enumerate(groups)}
        return self._trained(
            asked, result.trained, [position[t.group] for t in result.trained], result.paused
        )

    def rollout_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the partial rollout, for resume() to give back: a copy
        (the checkpoint's writer pickles it while the next rollout goes on)."""
        return copy.deepcopy(
            {
                "carried": self.carried,
                "problems": self.problems_of,
                "nextConversation": self.next_conversation,
                "nextGroup": self.next_group,
            }
        )

    def resume_rollout(self, state: dict[str, Any] | None) -> None:
        """The partial rollout as a checkpoint kept it (None: it kept none, nothing carried)."""
        if state is None:
            return
        self.carried = list(state["carried"])
        self.problems_of = dict(state["problems"])
        self.next_conversation = int(state["nextConversation"])
        self.next_group = int(state["nextGroup"])

    def _generate(
        self, problems: Sequence[Problem], group: int, sampling: SamplingParams
    ) -> _Generated:
        # sampling.max_new_tokens is not used: each turn asks for what is left of the
        # trajectory's budget (multiTurn.maxResponseLength).
        asked = [p for p in problems for _ in range(group)]
        prompts = [list(p.prompt_ids) for p in asked]
        # spec.rollout.multiTurn.schedule: every conversation at its own pace, or turn k of all
        # of them as one batch (the same requests and seeds; docs/multi-turn.md).
        settings = self.spec.rollout.multi_turn_settings
        assert settings is not None
        run = (
            self.multi_turn.run
            if settings.schedule is MultiTurnSchedule.ASYNC
            else self.multi_turn.run_turn_by_turn
        )
        trajectories = run_on(self.engine, run(prompts, sampling))
        group_ids = [index for index in range(len(problems)) for _ in range(group)]
        return self._trained(asked, trajectories, group_ids)

    def _trained(
        self,
        asked: Sequence[Problem],
        trajectories: Sequence[Trajectory],
        group_ids: list[int],
        paused: int = 0,
    ) -> _Generated:
        """The experience of `trajectories` (each of its problem in `asked`), rewarded."""
        counts = RolloutCounts.of(trajectories, [str(p.answer) for p in asked], paused)
        scored = self.scorer(list(asked), [t.last_turn_text for t in trajectories])
        experience = Experience(
            [t.prompt_ids for t in trajectories],
            [t.response_ids for t in trajectories],
            scored.scores,
            group_ids,
            [t.logprobs for t in trajectories],
            [t.loss_mask for t in trajectories],
        )
        return _Generated(experience, scored.errors, counts)


def _auto_capacity(
    spec: RLJobSpec, capacity: int | None, device: torch.device, world: int
) -> int | None:
    """The card rollout Auto plans on: the smallest GPU of all ranks (so all choose alike, and
    the choice fits each). On CPU there is no card: spec.memoryPlan.gpuMemory where given (to
    rehearse a GPU job's choice), else the host's memory; the torch engine on CPU sizes its KV
    pool without the fraction, so there the choice is recorded and run, not a limit."""
    if capacity is None and spec.memory_plan.gpu_memory is None:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if capacity is not None and world > 1 and dist.is_available() and dist.is_initialized():
        smallest = torch.tensor([capacity], dtype=torch.int64, device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        capacity = int(smallest.item())
    return capacity


def run_rank(
    spec: RLJobSpec, config: RankConfig, emit: Callable[[RankEvent], None] | None = None
) -> RankResult:
    """Run iteration 0 (first rollout) and spec.algorithm.iterations training iterations.

    Every rank calls this at once with the process group already initialised (collectives
    inside). A CUDA OOM ends the run: it is emitted and returned, with every sample before it.
    """
    send = emit or (lambda _event: None)
    result = RankResult(rank=config.rank)
    device = torch.device(config.device)
    torch.manual_seed(spec.algorithm.seed)
    model_path = resolve_model_path(spec.model.path)
    refused = export_target_problem(spec, model_path)
    if refused is not None:
        raise ValueError(refused)
    tokenizer = load_tokenizer(model_path)
    eos_ids = stop_token_ids(tokenizer, model_path)
    # The data's rows are read and checked before any GPU work (the reward function below).
    multi_turn = spec.rollout.multi_turn_settings
    tools = make_tools(multi_turn) if multi_turn is not None else None  # user tools load here
    schemas = tools.schemas if tools is not None else None
    task = make_task(spec.data, spec.algorithm.seed, tokenizer, schemas)
    validation = validation_problems(spec.data, spec.algorithm.seed, tokenizer, schemas)

    # The plan on the real GPU, before any engine starts: a misfit with onMisfit Reject fails
    # fast here; with offload Auto it decides what the stages offload.
    capacity = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
    if is_auto(spec):
        capacity = _auto_capacity(spec, capacity, device, config.world_size)
    # The weight sync's switches as this process has them (a Secret's value included).
    memory_plan = rank_plan(spec, capacity, config.world_size, model_path, os.environ)
    # rollout Auto: every rank planned on the same (smallest) card with the same spec and
    # shape, so each resolves the same mode and fraction (AutoRefused: nothing fits).
    spec = resolved_spec(spec, memory_plan)
    if (
        memory_plan is not None
        and not memory_plan.chosen.fits
        and spec.memory_plan.on_misfit is MisfitAction.REJECT
    ):
        raise RuntimeError(
            f"memory plan: the job does not fit this GPU ({memory_plan.capacity_bytes} bytes): "
            f"{memory_plan.chosen.misfit_text()} (spec.memoryPlan.onMisfit=Reject)"
        )
    offload_optimizer, offload_params = offload_choice(spec, memory_plan)
    plan_status = memory_plan.to_status() if memory_plan is not None and config.rank == 0 else None

    # The engine first, then release it: it sizes its KV pool on a device that training does
    # not yet occupy, and the loop starts where every iteration starts (engine asleep).
    scorer = Scorer(spec.reward)  # loads a user's function in its process, or fails
    allocator_report.start_recording()  # RLJOB_ALLOCATOR_REPORT: stacks from here on
    try:
        engine = make_engine(spec, device=str(device), eos_token_ids=eos_ids, node=config.node)
    except BaseException:
        scorer.close()
        if tools is not None:
            tools.close()
        raise
    released = engine.released_tags
    engine.release([tag for tag in ALL_TAGS if tag not in released])
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def on_sample(sample: StageSample) -> None:
        result.samples.append(sample)
        send(sample)

    meter = MemoryMeter(
        config.rank,
        device,
        on_sample,
        inject=config.inject_oom or OOMInjection.from_env(),
        node=config.node,
    )
    # The start-up, measured like a stage: status.memory.load against the plan's load row.
    with meter.load():
        staging = Staging(device, overlap_staging(spec, device))
        trainer = Trainer(spec, model_path, device, pad_id=tokenizer.pad_token_id, staging=staging)
    checks: dict[str, tuple[str, str]] = {}

    def check_weights(_iteration: int, bucket: Bucket) -> None:
        held = dict(engine.named_weights())  # type: ignore[attr-defined]
        for name, tensor in bucket:
            # A bucket in the master dtype (an engine that casts): compared as the engine cast it.
            sent = tensor if tensor.dtype == held[name].dtype else tensor.to(held[name].dtype)
            checks[name] = (tensor_digest(sent), tensor_digest(held[name]))

    context = getattr(trainer.model.config, "max_position_embeddings", None)
    # This rank's share of the validation prompts (every rank read and checked them all).
    held_out = validation[config.rank :: config.world_size]
    parts = (spec, config, engine, tokenizer, task, scorer, eos_ids, held_out)
    rollout = (
        _Rollout(*parts)
        if tools is None
        else _MultiTurnRollout(*parts, tools=tools, context_length=context)
    )
    # The checkpoint writes from the host buffers the offloads use (trainer.copy_to_host).
    # The partial rollout's carried conversations go into every checkpoint.
    carried = (
        rollout.rollout_state
        if isinstance(rollout, _MultiTurnRollout) and rollout.partial
        else None
    )
    keeper = checkpoints.Keeper(
        spec, trainer.model, trainer.optimizer, model_path, host=trainer, job=config.job,
        rollout=carried,
    )  # fmt: skip
    machine = StageMachine(
        trainer,
        engine,
        meter,
        rollout,
        wake_up=resolved_rollout(spec)[0],
        bucket_bytes=resolved_bucket_bytes(spec),
        engine_dtype=torch_dtype(spec.model.dtype),
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        after_weight_update=check_weights if config.verify_weights else None,
        checkpoint=keeper.save if spec.checkpoint is not None else None,
        checkpoint_every=spec.checkpoint.every_iterations if spec.checkpoint else 0,
        between_stages=keeper.poll if spec.checkpoint is not None else None,
    )
    # A new attempt, or the same manifest run again, continues from the newest complete
    # checkpoint: its iteration N is trained, so the run starts with N's second half.
    try:
        resumed_from = keeper.resume()
        if isinstance(rollout, _MultiTurnRollout):
            rollout.resume_rollout(keeper.resumed_rollout)
        start = resumed_from or 0
        for iteration in range(start, spec.algorithm.iterations + 1):
            checks.clear()
            machine.weight_sync_seconds = None
            machine.weight_handoff_seconds = None
            resumed = resumed_from is not None and iteration == start
            outcome = machine.run_iteration(iteration, resumed=resumed)
            if iteration == spec.algorithm.iterations:
                if isinstance(rollout, _MultiTurnRollout) and rollout.carried:
                    log.info("rank %d: %d conversations the last partial rollout carried are "
                             "not trained (the job ends)", config.rank, len(rollout.carried))  # fmt: skip
                keeper.export_final()  # the policy as its last update left it
                keeper.finish()  # the last writer: its checkpoint complete, or its failure
            saved, exported = keeper.take()
            for older in saved[:-1]:  # completed in the same iteration: status counts each
                send(older)
            experience = outcome.experience
            assert experience is not None  # every iteration ends with a rollout
            report = RankIteration(
                rank=config.rank,
                iteration=iteration,
                stages=tuple(str(s) for s in outcome.stages),
                reward_sum=sum(experience.rewards),
                reward_count=len(experience.rewards),
                reward_errors=rollout.reward_errors,
                kl_mean=outcome.train.kl_mean if outcome.train else None,
                loss=outcome.train.loss if outcome.train else None,
                kv_capacity_tokens=engine.kv_capacity_tokens,
                weights=WeightCheck(
                    sent={n: s for n, (s, _) in checks.items()},
                    engine={n: e for n, (_, e) in checks.items()},
                )
                if config.verify_weights
                else None,
                weight_sync_seconds=machine.weight_sync_seconds,
                weight_handoff_seconds=machine.weight_handoff_seconds,
                offload_optimizer=offload_optimizer,
                offload_params=offload_params,
                # The run's first iteration: 0, or the one a resumed run starts with.
                plan=plan_status if iteration == start else None,
                load=meter.load_sample if iteration == start else None,
                rollout=rollout_stats(
                    experience,
                    spec.data.max_response_length,
                    eos_ids,
                    rollout.counts if isinstance(rollout, _MultiTurnRollout) else None,
                ),
                train=outcome.train,
                resumed_from=start if resumed else None,
                resume_point=keeper.resumed if resumed else None,
                checkpoint=saved[-1] if saved else None,
                export_path=exported.path if exported is not None else None,
                staging=outcome.staging,
                validation=rollout.validated,
            )
            result.iterations.append(report)
            send(report)
            log.info("rank %d iteration %d done", config.rank, iteration)
    except checkpoints.CheckpointFailed as failed:
        # Every rank raises it together (checkpoint._agreed); the driver puts it in
        # status.checkpointFailure, the job fails with reason CheckpointFailed.
        _send_unreported(keeper, send, config.rank)
        send(failed.failure)
        raise
    except Exception as error:
        # An OOM (returned: the OOM policy decides) or any other failure (an engine that died
        # in the weight sync, ...: raised). A checkpoint staged this iteration is written
        # before the process ends (its writer is held back for the weight sync by default, and
        # a daemon thread dies with the process), so a re-run resumes from it. The checkpoints
        # the ranks agreed complete before the failure are reported too, or status.checkpoint
        # (and its Event) would name an older one than the re-run resumes from.
        if isinstance(error, StageOOM):
            log.error("rank %d: %s", config.rank, error)
        keeper.drain()
        _send_unreported(keeper, send, config.rank)
        if not isinstance(error, StageOOM):
            raise
        result.oom = error.record
        send(error.record)
    finally:
        engine.shutdown()
        scorer.close()
        if tools is not None:
            tools.close()  # builtin:python's runners
    if dist.is_initialized() and result.oom is None:
        dist.barrier()
    return result
