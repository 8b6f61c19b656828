"""The user's prompts: rows of a JSONL or Parquet file, read and checked whole when the job starts.

Every row's prompt and answer are looked up (dotted keys reach into nested columns), rendered
(chat messages through the tokenizer's template) and encoded before any GPU work, so a bad row
fails the job at once with the file and row named instead of mid-run.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rljob.api import ChatTemplateMode, DataSpec
from rljob_worker.task import SOURCE_FIELD, Problem, PromptEncoder, PromptTooLong

# How many bad rows a DatasetError lists (it counts them all).
SHOWN_PROBLEMS = 5
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# .json: a JSON array of objects, or JSON lines under that name (datasets' to_json writes them).
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")
# The file types, as the messages name them (DATA_URL_RULE's text in rljob.api names them too).
FILE_TYPES = ".jsonl, .json or .parquet"


class DatasetError(ValueError):
    """spec.data.source cannot be used as it is; the message names the file and the rows."""


class _RowProblem(ValueError):
    """One row's defect (collected, then reported together)."""


def read_rows(path: Path, source_field: str = SOURCE_FIELD) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row: JSONL by line number (what an editor shows), Parquet by row
    index from 0 (what pyarrow and pandas index). A row that is not an object comes back as
    a _RowProblem in place of the row. `source_field`: what messages call the file (the spec's field)."""
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
        if is_file:
            path.open("rb").close()
    except PermissionError as error:  # a file (or a folder above it) of a volume, mode 600/700
        # The kernel names the path asked for; the first folder this user may not enter is what
        # to change (os.access: the pod's real uid is its effective one).
        blocked = next((p for p in reversed(path.parents) if not os.access(p, os.X_OK)), path)
        raise DatasetError(
            f"{source_field} {path}: the worker cannot read it ({error.strerror}: {blocked}; "
            f"it runs as uid {os.getuid()}, gid {os.getgid()}): make the file, and the folders "
            "above it, readable by that user (chmod a+r, a+x on the folders)"
        ) from None
    if is_dir:
        # Said apart from a missing file: the folder is mounted, and mounting it again would not
        # help. Folders of shards (Spark's, datasets' save_to_disk) are not read.
        raise DatasetError(
            f"{source_field} {path}: a directory, not a file; one {FILE_TYPES} file is "
            "expected (name one file in it, or join its shards into one file)"
        )
    if not is_file:
        raise DatasetError(
            f"{source_field} {path}: no such file in the pod (mount the volume that holds it, "
            "or copy it into the image)"
        )
    name = path.name.lower()  # train.JSONL, data.Parquet: the type, whatever the case
    if name.endswith(JSON_SUFFIXES):
        with path.open(encoding="utf-8-sig", errors="surrogateescape") as text:
            head = text.read(4096).lstrip()
        if head.startswith("["):
            yield from _json_array_rows(path, source_field)
            return
    if name.endswith(JSONL_SUFFIXES + JSON_SUFFIXES):
        # utf-8-sig: a byte order mark at the start (Windows editors, PowerShell's Out-File)
        # is dropped; json.loads refuses it. surrogateescape: a byte that is not UTF-8 (a
        # Latin-1 export) would otherwise end the read with a bare UnicodeDecodeError naming no
        # line; kept as a lone surrogate, it is found below and reported with its line like any
        # other bad row.
        with path.open(encoding="utf-8-sig", errors="surrogateescape") as lines:
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
    elif name.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as error:  # pyarrow raises several types for unreadable files
            raise DatasetError(
                f"{source_field} {path}: not a readable Parquet file: {error}"
            ) from None
        for index, row in enumerate(table.to_pylist()):
            yield f"{path} row {index}", row
    else:
        raise DatasetError(f"{source_field} {path}: unknown file type; use a {FILE_TYPES} file")


def _json_array_rows(path: Path, source_field: str) -> Iterator[tuple[str, Any]]:
    """A .json file holding one array: its items by index from 0 (what json.load indexes)."""
    text = path.read_text(encoding="utf-8-sig", errors="surrogateescape")
    undecodable = _first_undecodable(text)
    if undecodable is not None:
        raise DatasetError(f"{source_field} {path}: {undecodable}")
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise DatasetError(
            f"{source_field} {path}: not JSON ({error.msg} at line {error.lineno}, column "
            f"{error.colno})"
        ) from None
    for index, row in enumerate(items):
        yield (
            f"{path} item {index}",
            row
            if isinstance(row, dict)
            else _RowProblem(f"an item must be a JSON object, not {type(row).__name__}"),
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
        at = ".".join(walked) or "the row"
        if not isinstance(value, Mapping):  # a null struct, or text where a mapping was meant
            raise _RowProblem(f"no key {key!r} ({at} is {_kind(value)}, not a mapping)")
        if part not in value:
            has = ", ".join(sorted(map(str, value)))
            raise _RowProblem(f"no key {key!r} ({at} has: {has or 'nothing'})")
        value = value[part]
        walked.append(part)
    return value


def _kind(value: Any) -> str:
    """What a row's value is, for a message: null, text 'forty-two', a list, a number (4)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"text {value[:40]!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):  # before int: JSON's true is a bool, and a bool is an int
        return f"a boolean ({value!r})"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    return type(value).__name__


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
        if value is None:  # a Parquet null, or JSON's null: said so, not "not NoneType"
            raise _RowProblem(f"{self.key!r} is null")
        if isinstance(value, str):
            if not value.strip():
                raise _RowProblem(f"{self.key!r} is empty")
            if self.tools is None or self.mode is ChatTemplateMode.NONE:
                return value
            # mode multiTurn: the conversation goes on in the template's turns, and the model
            # sees the tools' schemas only through it, so plain text is the user's message.
            return self._template([{"role": "user", "content": value}])
        if not isinstance(value, list):
            raise _RowProblem(
                f"{self.key!r} must be text or a list of chat messages {{role, content}}, "
                f"not {type(value).__name__}"
            )
        messages = _messages(value, self.key)
        if self.mode is ChatTemplateMode.NONE:
            return "\n".join(m["content"] for m in messages)
        return self._template(messages)

    def _template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            # Not a row's defect: every row would fail the same way.
            if self.tools is not None:
                raise DatasetError(
                    "spec.rollout.mode multiTurn renders the prompts with the model's chat "
                    "template (the tools' schemas are in it) and the tokenizer has none: use a "
                    "chat (instruct) model"
                )
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
    if isinstance(answer, float) and not math.isfinite(answer):
        # NaN: json.dumps of pandas' missing float; Infinity: json.loads reads it too. No
        # response's number equals either (NaN equals nothing), so the row could never score.
        shown = "NaN" if math.isnan(answer) else repr(answer)
        raise _RowProblem(f"{data.answer_key!r} is {shown}")
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
    source_field: str = SOURCE_FIELD,
) -> list[Problem]:
    """Every row of spec.data.source as a Problem; DatasetError naming the bad rows (the first
    SHOWN_PROBLEMS of them, and how many) when any is unusable, or when there are none."""
    path = Path(data.source)
    render = PromptRenderer(data, tokenizer, tools)
    problems: list[Problem] = []
    bad: list[str] = []
    for where, row in read_rows(path, source_field):
        try:
            problems.append(_problem(row, where, data, render, encode))
        except _RowProblem as problem:
            bad.append(f"{where}: {problem}")
    if bad:
        shown = "; ".join(bad[:SHOWN_PROBLEMS])
        more = f" (and {len(bad) - SHOWN_PROBLEMS} more)" if len(bad) > SHOWN_PROBLEMS else ""
        raise DatasetError(
            f"{source_field}: {len(bad)} of {len(bad) + len(problems)} rows cannot be used: "
            f"{shown}{more}"
        )
    if not problems:
        raise DatasetError(f"{source_field} {path}: the file has no rows")
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
        source_field: str = SOURCE_FIELD,
    ) -> None:
        self.seed = seed
        self.problems = load_problems(data, tokenizer, encode, tools, source_field)

    def sample(self, count: int, salt: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        return [rng.choice(self.problems) for _ in range(count)]
