"""The user's prompts: rows of a JSONL or Parquet file, read and checked whole when the job starts.

Every row's prompt and answer are looked up (dotted keys reach into nested columns), rendered
(chat messages through the tokenizer's template) and encoded before any GPU work, so a bad row
fails the job at once with the file and row named instead of mid-run.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rljob.api import ChatTemplateMode, DataSpec
from rljob_worker.task import Problem, PromptEncoder, PromptTooLong

# How many bad rows a DatasetError lists (it counts them all).
SHOWN_PROBLEMS = 5
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetError(ValueError):
    """spec.data.source cannot be used as it is; the message names the file and the rows."""


class _RowProblem(ValueError):
    """One row's defect (collected, then reported together)."""


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row: JSONL by line number (what an editor shows), Parquet by row
    index from 0 (what pyarrow and pandas index). A row that is not an object comes back as
    a _RowProblem in place of the row."""
    if not path.is_file():
        raise DatasetError(
            f"spec.data.source {path}: no such file in the pod (mount the volume that holds it, "
            "or copy it into the image)"
        )
    if path.name.endswith(JSONL_SUFFIXES):
        # surrogateescape: a byte that is not UTF-8 (a Latin-1 export) would otherwise end the
        # read with a bare UnicodeDecodeError naming no line; kept as a lone surrogate, it is
        # found below and reported with its line like any other bad row.
        with path.open(encoding="utf-8", errors="surrogateescape") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                undecodable = _first_undecodable(line)
                if undecodable is not None:
                    yield where, _RowProblem(undecodable)
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    yield where, _RowProblem(f"not JSON ({error.msg} at column {error.colno})")
                    continue
                yield (
                    where,
                    row
                    if isinstance(row, dict)
                    else _RowProblem(f"a row must be a JSON object, not {type(row).__name__}"),
                )
    elif path.name.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as error:  # pyarrow raises several types for unreadable files
            raise DatasetError(
                f"spec.data.source {path}: not a readable Parquet file: {error}"
            ) from None
        for index, row in enumerate(table.to_pylist()):
            yield f"{path} row {index}", row
    else:
        raise DatasetError(
            f"spec.data.source {path}: unknown file type; use a .jsonl or .parquet file"
        )


def _first_undecodable(line: str) -> str | None:
    """What is wrong with a line read with errors="surrogateescape", or None when it was UTF-8."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(line[error.start]) - 0xDC00  # surrogateescape keeps byte b as U+DC00 + b
        return (
            f"not UTF-8 (byte 0x{byte:02x} at column {error.start + 1}); the file must be "
            "UTF-8: convert it, e.g. iconv -f latin1 -t utf-8"
        )
    return None


_MISSING = object()


def lookup(row: Mapping[str, Any], key: str) -> Any:
    """row[key], or with dots, the nested value (reward_model.ground_truth); a column whose own
    name holds the dots wins. Raises _RowProblem naming what the row has instead."""
    if key in row:
        return row[key]
    value: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            has = ", ".join(sorted(map(str, value))) if isinstance(value, Mapping) else "no keys"
            at = ".".join(walked) or "the row"
            raise _RowProblem(f"no key {key!r} ({at} has: {has or 'nothing'})")
        value = value[part]
        walked.append(part)
    return value


def _messages(value: list[Any], key: str) -> list[dict[str, str]]:
    for message in value:
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise _RowProblem(
                f"{key!r} is a list, so each item must be a chat message {{role, content}} "
                f"with text in both; got {str(message)[:80]}"
            )
    if not any(m["content"].strip() for m in value):
        raise _RowProblem(f"{key!r} is empty (no message has any content)")
    return [{"role": m["role"], "content": m["content"]} for m in value]


class PromptRenderer:
    """A row's prompt value as the text the model sees."""

    def __init__(
        self, data: DataSpec, tokenizer: Any, tools: list[dict[str, Any]] | None = None
    ) -> None:
        self.key, self.mode, self.tokenizer = data.prompt_key, data.chat_template, tokenizer
        # The tools' schemas (mode multiTurn): the template lists them (Qwen2.5: in the system
        # turn); None leaves the template as single-turn jobs render it.
        self.tools = tools

    def __call__(self, value: Any) -> str:
        if isinstance(value, str):
            if not value.strip():
                raise _RowProblem(f"{self.key!r} is empty")
            return value
        if not isinstance(value, list):
            raise _RowProblem(
                f"{self.key!r} must be text or a list of chat messages {{role, content}}, "
                f"not {type(value).__name__}"
            )
        messages = _messages(value, self.key)
        if self.mode is ChatTemplateMode.NONE:
            return "\n".join(m["content"] for m in messages)
        if not getattr(self.tokenizer, "chat_template", None):
            # Not a row's defect: every row with messages would fail the same way.
            raise DatasetError(
                "the prompts are chat messages and the model's tokenizer has no chat template: "
                "use a chat (instruct) model, or set spec.data.chatTemplate: None to join the "
                "messages' contents with newlines"
            )
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            text: str = self.tokenizer.apply_chat_template(
                messages, tools=self.tools, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as error:
            # A template's own checks (raise_exception: roles must alternate, no system role)
            # judge one row's messages: report it with the row, as the other row defects are.
            raise _RowProblem(
                f"the model's chat template refuses {self.key!r}: {error} (fix the row's "
                "messages, or set spec.data.chatTemplate: None to join their contents)"
            ) from None
        return text


def _problem(row: Any, where: str, data: DataSpec, render: PromptRenderer,
             encode: PromptEncoder) -> Problem:  # fmt: skip
    if isinstance(row, _RowProblem):
        raise row
    prompt = render(lookup(row, data.prompt_key))
    answer = lookup(row, data.answer_key)
    if answer is None:
        raise _RowProblem(f"{data.answer_key!r} is null")
    try:
        ids = encode(prompt)
    except PromptTooLong as error:
        raise _RowProblem(str(error)) from None
    # verl's columns, when the file has them: the reward function is told where a row came from.
    source = row.get("data_source")
    extra = row.get("extra_info")
    return Problem(
        prompt,
        answer,
        where,
        data_source=source if isinstance(source, str) else data.source,
        extra_info=extra if isinstance(extra, Mapping) else {},
        prompt_ids=ids,
    )


def load_problems(
    data: DataSpec,
    tokenizer: Any,
    encode: PromptEncoder,
    tools: list[dict[str, Any]] | None = None,
) -> list[Problem]:
    """Every row of spec.data.source as a Problem; DatasetError naming the bad rows (the first
    SHOWN_PROBLEMS of them, and how many) when any is unusable, or when there are none."""
    path = Path(data.source)
    render = PromptRenderer(data, tokenizer, tools)
    problems: list[Problem] = []
    bad: list[str] = []
    for where, row in read_rows(path):
        try:
            problems.append(_problem(row, where, data, render, encode))
        except _RowProblem as problem:
            bad.append(f"{where}: {problem}")
    if bad:
        shown = "; ".join(bad[:SHOWN_PROBLEMS])
        more = f" (and {len(bad) - SHOWN_PROBLEMS} more)" if len(bad) > SHOWN_PROBLEMS else ""
        raise DatasetError(
            f"spec.data.source: {len(bad)} of {len(bad) + len(problems)} rows cannot be used: "
            f"{shown}{more}"
        )
    if not problems:
        raise DatasetError(f"spec.data.source {path}: the file has no rows")
    return problems


class DatasetTask:
    """The file's rows, sampled with replacement (seeded: every rank and rerun draws alike)."""

    def __init__(
        self,
        data: DataSpec,
        seed: int,
        tokenizer: Any,
        encode: PromptEncoder,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.seed = seed
        self.problems = load_problems(data, tokenizer, encode, tools)

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        return [rng.choice(self.problems) for _ in range(count)]
