"""A short supervised warm start for the multi-turn learning check (issue 32, docs/multi-turn.md).

The random builtin:tiny-qwen2 never writes a tool call, so every GRPO group on builtin:calculator
is flat (reward 0) and RL has nothing to learn from. Practitioners start agentic RL from a model
that already calls tools now and then; this makes one on the CPU (~5 minutes on 2 shared vCPUs):

    .venv/bin/python bench/converging/multi_turn_warmstart.py --out out/mt-warmstart

It fine-tunes builtin:tiny-qwen2 on synthetic calculator conversations built with the rollout's
own code paths (the task's prompt ids, the Hermes `<tool_call>` parsed by agentic/tool_calls.py
and run by the rollout's ToolSet, the tool turn from ChatFormat.tool_turn), loss on the model's
turns only, and saves an HF directory (model + tokenizer). On purpose imperfect: half the
conversations call with a wrong expression (one digit changed) and a fifth answer a random number
without a call, so that RL starts with a minority of correct calls and variance inside its
groups. The saved config's
max_position_embeddings is raised from 256 to --context (RoPE has no learned positions): a
conversation (192 prompt tokens, ~104 for the call, ~30 for the tool turn, ~8 for the answer)
does not fit 256.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rljob.api import BUILTIN_CALCULATOR, DataSpec, MultiTurnSpec
from rljob_worker.agentic.chat import ChatFormat
from rljob_worker.agentic.tool_calls import CLOSE_TAG, OPEN_TAG, parse_tool_calls
from rljob_worker.agentic.tools import ToolSet, make_tools
from rljob_worker.model import load_causal_lm, load_tokenizer, resolve_model_path
from rljob_worker.task import Problem, make_task

# The conversation's question, as task.calculator_problem writes it.
_QUESTION = re.compile(r"What is ([0-9 *+\-]+)\?")
# The manifest's tools and budgets (bench/converging/multi-turn.yaml): the same template input.
TOOLS = ["builtin:calculator", "builtin:python"]
MAX_TOOL_RESPONSE_LENGTH = 16
KINDS = ("correct", "wrong-expression", "no-call")


@dataclass(frozen=True)
class Conversation:
    """One synthetic trajectory as the trainer sees it: prompt ids, then the response (model
    turns, mask 1; the tool turn, mask 0)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    kind: str  # "correct", "wrong-expression" or "no-call"


def call_text(expression: str) -> str:
    """A Hermes-style calculator call, as the task's instructions show it."""
    arguments = {"name": "calculator", "arguments": {"expression": expression}}
    return f"{OPEN_TAG}{json.dumps(arguments)}{CLOSE_TAG}"


def answer_text(number: str) -> str:
    """The final turn. Not the prompt's "Answer: N": this byte-level BPE merges a number's
    digits differently after a space, so "Answer: N" would ask the tiny model to translate the
    tool result's tokens, not copy them. After a newline the number is the same tokens as the
    tool's result; the numeric reward reads the last number either way."""
    return f"Answer:\n{number}"


def question_expression(problem: Problem) -> str:
    """The arithmetic of a builtin:calculator problem, from its prompt text."""
    match = _QUESTION.search(problem.prompt)
    if match is None:
        raise ValueError(f"{problem.where}: not a builtin:calculator question")
    return match.group(1)


def wrong_expression(expression: str, rng: random.Random) -> str:
    """The expression with one digit changed: a call that runs but gives a wrong result."""
    places = [i for i, c in enumerate(expression) if c.isdigit()]
    i = rng.choice(places)
    digit = rng.choice([d for d in "0123456789" if d != expression[i]])
    return expression[:i] + digit + expression[i + 1 :]


def conversation(
    problem: Problem,
    chat: ChatFormat,
    tools: ToolSet,
    eos_id: int,
    kind: str,
    rng: random.Random,
) -> Conversation:
    """The trajectory the rollout would record if the model wrote these turns: the model's turns
    end with end-of-sequence (where the engine stops), the tool turn is ChatFormat's."""
    response: list[int] = []
    mask: list[int] = []

    def model_turn(text: str) -> None:
        ids = [*chat.encode(text), eos_id]
        response.extend(ids)
        mask.extend([1] * len(ids))

    if kind == "no-call":
        model_turn(answer_text(str(rng.randint(10_000, 99_999))))
    else:
        expression = question_expression(problem)
        if kind == "wrong-expression":
            expression = wrong_expression(expression, rng)
        model_turn(call_text(expression))
        text = chat.tokenizer.decode(response, skip_special_tokens=True)
        calls = parse_tool_calls(text, tools.names)  # the rollout's parser and tools
        outcomes = [asyncio.run(tools.run(c)) for c in calls]
        turn = chat.tool_turn(
            [o.text for o in outcomes], chat.token_text(eos_id), MAX_TOOL_RESPONSE_LENGTH
        )
        response.extend(turn.ids)
        mask.extend([0] * len(turn.ids))
        model_turn(answer_text(outcomes[0].text))
    return Conversation(list(problem.prompt_ids), response, mask, kind)


def conversations(
    tokenizer: Any, count: int, seed: int, wrong_share: float, no_call_share: float
) -> list[Conversation]:
    """`count` conversations of builtin:calculator problems (the task made as the rollout makes
    it, seeded apart from the RL run's), a `wrong_share` of them with a wrong expression and a
    `no_call_share` answering a random number without a call."""
    tools = make_tools(MultiTurnSpec(tools=TOOLS, max_response_length=256))
    chat = ChatFormat(tokenizer, tools.schemas)
    data = DataSpec(source=BUILTIN_CALCULATOR, max_prompt_length=200)
    task = make_task(data, seed, tokenizer, tools.schemas)
    rng = random.Random(seed)
    out = []
    for problem in task.sample(count, salt=0):
        draw = rng.random()
        kind = (
            "wrong-expression"
            if draw < wrong_share
            else "no-call"
            if draw < wrong_share + no_call_share
            else "correct"
        )
        out.append(conversation(problem, chat, tools, tokenizer.eos_token_id, kind, rng))
    return out


def batch_tensors(
    batch: list[Conversation], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, attention mask and labels (-100 outside the model's turns), right-padded."""
    length = max(len(c.prompt_ids) + len(c.response_ids) for c in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), length), dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for row, c in enumerate(batch):
        sequence = c.prompt_ids + c.response_ids
        trained = [0] * len(c.prompt_ids) + c.loss_mask
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        labels[row, : len(sequence)] = torch.tensor(
            [t if m else -100 for t, m in zip(sequence, trained, strict=True)]
        )
    return ids, attention, labels


def warm_start(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    source = resolve_model_path("builtin:tiny-qwen2")
    tokenizer = load_tokenizer(source)
    model = load_causal_lm(source, torch.float32)
    model.config.max_position_embeddings = args.context
    data = conversations(
        tokenizer, args.conversations, args.seed, args.wrong_share, args.no_call_share
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    order = random.Random(args.seed)
    losses, start = [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        batch = order.sample(data, args.batch_size)
        ids, attention, labels = batch_tensors(batch, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f}", flush=True)
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "conversations": args.conversations,
        "kinds": {kind: sum(c.kind == kind for c in data) for kind in KINDS},
        "context": args.context,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": round(time.perf_counter() - start, 1),
    }
    if args.check_prompts:
        summary["check"] = check(out, args.check_prompts, args.seed + 1, args.check_length)
    (out / "warmstart.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def check(
    directory: Path, count: int, seed: int, max_response_length: int, show: int = 0
) -> dict[str, float]:
    """The saved model through the rollout's own path (MultiTurnRollout over the torch engine,
    temperature 1, the manifest's tools and budgets) on `count` fresh prompts: the share of
    conversations with a correct calculator call (a tool result equal to the answer), with any
    call, and with the right final answer (what the numeric reward scores)."""
    from rljob_worker.agentic.driver import Limits, MultiTurnRollout
    from rljob_worker.agentic.routing import EngineRouter
    from rljob_worker.engines.base import SamplingParams
    from rljob_worker.engines.torch_engine import TorchEngine
    from rljob_worker.rewards import numeric

    tokenizer = load_tokenizer(directory)
    tools = make_tools(MultiTurnSpec(tools=TOOLS, max_response_length=max_response_length))
    data = DataSpec(source=BUILTIN_CALCULATOR, max_prompt_length=200)
    problems = make_task(data, seed, tokenizer, tools.schemas).sample(count, salt=0)
    engine = TorchEngine(directory, dtype="float32", kv_capacity_tokens=count * 512)
    rollout = MultiTurnRollout(
        EngineRouter([engine]),
        ChatFormat(tokenizer, tools.schemas),
        tools,
        Limits(3, max_response_length, MAX_TOOL_RESPONSE_LENGTH, count, context_length=None),
        [tokenizer.eos_token_id],
        lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
    )
    prompts = [list(p.prompt_ids) for p in problems]
    trajectories = asyncio.run(rollout.run(prompts, SamplingParams(1, temperature=1.0, seed=seed)))
    engine.shutdown()
    for t in trajectories[:show]:
        print(repr(tokenizer.decode(t.response_ids)))
    pairs = list(zip(problems, trajectories, strict=True))
    return {
        "conversations": count,
        "calledShare": sum(t.tool_calls > 0 for t in trajectories) / count,
        "correctCallShare": sum(str(p.answer) in t.tool_results for p, t in pairs) / count,
        "correctAnswerShare": sum(
            numeric(BUILTIN_CALCULATOR, t.last_turn_text, p.answer, {}) for p, t in pairs
        )
        / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the HF directory to write")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--wrong-share", type=float, default=0.5)
    parser.add_argument("--no-call-share", type=float, default=0.2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--check-prompts",
        type=int,
        default=32,
        help="fresh prompts the saved model is run on through the rollout (0: none)",
    )
    parser.add_argument(
        "--check-length",
        type=int,
        default=224,
        help="the check's maxResponseLength (the manifest's)",
    )
    # One thread: a model this small gains nothing from two (measured on 2 shared vCPUs).
    parser.add_argument("--threads", type=int, default=1)
    print(json.dumps(warm_start(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
