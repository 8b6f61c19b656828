"""spec.data's file: JSONL and Parquet rows, dotted keys, chat messages through the builtin
tokenizer's template, and every defect reported at start with the file and the row."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.processes import as_another_user

from rljob.api import DataSpec, MultiTurnSpec, PromptOverflow
from rljob_worker.agentic.tools import make_tools
from rljob_worker.dataset import DatasetError, DatasetTask, read_rows
from rljob_worker.model import CHAT_TEMPLATE, TINY_QWEN2, load_tokenizer, resolve_model_path
from rljob_worker.task import PromptTooLong, make_task


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_path(TINY_QWEN2))


def _jsonl(tmp_path: Path, rows: list[Any], name: str = "train.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _task(tokenizer: Any, path: Path, **data: Any) -> DatasetTask:
    task = make_task(DataSpec(source=str(path), **data), seed=0, tokenizer=tokenizer)
    assert isinstance(task, DatasetTask)
    return task


VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {a}+{a}? End with #### N."}],
        "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
        "extra_info": {"index": a, "split": "train"},
    }
    for a in range(1, 4)
]


def test_a_verl_parquet_file_reads_with_nested_keys_and_the_chat_template(
    tmp_path: Path, tokenizer: Any
) -> None:
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    task = _task(tokenizer, path, answer_key="reward_model.ground_truth", max_prompt_length=256)
    first = task.problems[0]
    assert first.prompt == "<|user|>\nWhat is 1+1? End with #### N.\n<|assistant|>\n"
    assert first.prompt_ids == tuple(tokenizer(first.prompt, add_special_tokens=False).input_ids)
    assert [p.answer for p in task.problems] == ["2", "4", "6"]
    assert first.data_source == "openai/gsm8k"
    assert first.extra_info == {"index": 1, "split": "train"}
    assert first.where == f"{path} row 0"


def test_plain_text_prompts_skip_the_template_and_name_the_spec_source(
    tmp_path: Path, tokenizer: Any
) -> None:
    path = _jsonl(tmp_path, [{"question": "2+2=", "meta": {"answer": 4}}])
    [problem] = _task(tokenizer, path, prompt_key="question", answer_key="meta.answer").problems
    assert (problem.prompt, problem.answer, problem.data_source) == ("2+2=", 4, str(path))
    assert problem.where == f"{path} line 1"


def test_plain_text_prompts_in_multi_turn_are_the_users_message_with_the_tools(
    tmp_path: Path,
) -> None:
    """mode multiTurn goes on in the template's turns, and the model sees the tools' schemas
    only through the template: a plain-text prompt is the user's message in it, not bare text
    (which had neither the tools nor the assistant header)."""
    path = _jsonl(tmp_path, [{"prompt": "What is 17*23?", "answer": "391"}])
    listing = load_tokenizer(resolve_model_path(TINY_QWEN2))
    listing.chat_template = (
        "{% for t in tools or [] %}<|tool {{ t['function']['name'] }}|>\n{% endfor %}"
        + CHAT_TEMPLATE
    )
    schemas = make_tools(MultiTurnSpec(tools=["builtin:calculator"])).schemas
    data = DataSpec(source=str(path), max_prompt_length=256)
    [problem] = make_task(data, 0, listing, schemas).problems  # type: ignore[attr-defined]
    assert problem.prompt == "<|tool calculator|>\n<|user|>\nWhat is 17*23?\n<|assistant|>\n"
    assert problem.prompt_ids == tuple(listing(problem.prompt, add_special_tokens=False).input_ids)
    # Single-turn (no tools): the text as it is, as before.
    [single] = _task(listing, path, max_prompt_length=256).problems
    assert single.prompt == "What is 17*23?"
    bare = load_tokenizer(resolve_model_path(TINY_QWEN2))
    bare.chat_template = None
    with pytest.raises(DatasetError, match=r"multiTurn renders the prompts with the model's chat"):
        make_task(data, 0, bare, schemas)


def test_chat_template_none_joins_the_messages(tmp_path: Path, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    path = _jsonl(tmp_path, [{"prompt": messages, "answer": "2"}])
    [problem] = _task(tokenizer, path, chat_template="None").problems
    assert problem.prompt == "Be brief.\n1+1="


def test_a_tokenizer_without_a_chat_template_is_told_apart_from_a_bad_row(
    tmp_path: Path, tokenizer: Any
) -> None:
    path = _jsonl(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}])
    bare = load_tokenizer(resolve_model_path(TINY_QWEN2))
    bare.chat_template = None
    with pytest.raises(DatasetError, match=r"no chat template.*chatTemplate: None"):
        _task(bare, path)
    assert CHAT_TEMPLATE  # the builtin model's own has one (the test above uses it)


def test_every_bad_row_is_named_with_its_line(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "1+1=", "answer": "2"}),  # line 1: good
                json.dumps({"prompt": "2+2="}),  # line 2: no answer
                "",  # line 3: blank lines are skipped
                json.dumps({"prompt": "   ", "answer": "0"}),  # line 4: empty prompt
                "{not json",  # line 5
                json.dumps(["a list"]),  # line 6
                json.dumps({"prompt": [{"role": "user"}], "answer": "1"}),  # line 7
                json.dumps({"prompt": 12, "answer": "1"}),  # line 8
                json.dumps({"prompt": "3+3=", "answer": None}),  # line 9
            ]
        )
    )
    with pytest.raises(DatasetError) as info:
        _task(tokenizer, path)
    message = str(info.value)
    assert "\n" not in message  # a rank's error reaches status by its last line
    assert message.startswith("spec.data.source: 7 of 8 rows cannot be used: ")
    assert f"{path} line 2: no key 'answer' (the row has: prompt)" in message
    assert f"{path} line 4: 'prompt' is empty" in message
    assert f"{path} line 5: not JSON" in message
    assert f"{path} line 6: a row must be a JSON object, not list" in message
    assert f"{path} line 7: 'prompt' is a list, so each item must be a chat message" in message
    assert "(and 2 more)" in message  # lines 8 and 9, counted, not listed
    assert "line 1:" not in message


def test_a_line_that_is_not_utf8_is_named_with_its_line(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        b'{"prompt": "1+1=", "answer": "2"}\n'
        b'{"prompt": "caf\xe9?", "answer": "1"}\n'  # line 2: Latin-1, not UTF-8
        + json.dumps({"prompt": "caf\u00e9 2+2=", "answer": "4"}).encode()  # UTF-8 again
    )
    with pytest.raises(DatasetError) as info:
        _task(tokenizer, path)
    message = str(info.value)
    assert message.startswith("spec.data.source: 1 of 3 rows cannot be used: ")
    assert f"{path} line 2: not UTF-8 (byte 0xe9 at column 16); the file must be UTF-8" in message


def test_a_jsonl_file_that_starts_with_a_utf8_bom_reads(tmp_path: Path, tokenizer: Any) -> None:
    # What Windows editors and PowerShell's Out-File write at the start of a UTF-8 file.
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "1+1=", "answer": "2"}).encode())
    [problem] = _task(tokenizer, path).problems
    assert (problem.prompt, problem.answer, problem.where) == ("1+1=", "2", f"{path} line 1")


@pytest.mark.parametrize(
    ("messages", "refusal"),
    [
        ([{"role": "assistant", "content": "hi"}], "Conversation roles must alternate"),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
         "System role not supported"),
    ],
)  # fmt: skip
def test_a_row_the_chat_template_refuses_is_named_with_its_line(
    tmp_path: Path, tokenizer: Any, messages: list[dict[str, str]], refusal: str
) -> None:
    # The checks Llama's and Gemma's templates make, through jinja's raise_exception.
    strict = load_tokenizer(resolve_model_path(TINY_QWEN2))
    strict.chat_template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    good = {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}
    path = _jsonl(tmp_path, [good, {"prompt": messages, "answer": "1"}])
    with pytest.raises(DatasetError) as info:
        _task(strict, path)
    message = str(info.value)
    assert message.startswith("spec.data.source: 1 of 2 rows cannot be used: ")
    assert f"{path} line 2: the model's chat template refuses 'prompt': {refusal}" in message
    assert "chatTemplate: None" in message


def test_a_nan_answer_is_refused_with_its_row(tmp_path: Path, tokenizer: Any) -> None:
    # json.loads reads NaN (json.dumps writes it for pandas' missing floats); Parquet holds it.
    path = tmp_path / "nan.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2.0}\n{"prompt": "2+2=", "answer": NaN}\n')
    with pytest.raises(DatasetError) as info:
        _task(tokenizer, path)
    assert str(info.value).endswith(f"1 of 2 rows cannot be used: {path} line 2: 'answer' is NaN")
    table = tmp_path / "nan.parquet"
    rows = [{"prompt": "1+1=", "answer": 2.0}, {"prompt": "2+2=", "answer": float("nan")}]
    pq.write_table(pa.Table.from_pylist(rows), table)
    with pytest.raises(DatasetError, match=rf"{table} row 1: 'answer' is NaN$"):
        _task(tokenizer, table)
    path.write_text('{"prompt": "1+1=", "answer": -Infinity}\n')
    with pytest.raises(DatasetError, match=rf"{path} line 1: 'answer' is -inf$"):
        _task(tokenizer, path)


def test_a_null_prompt_is_named_with_its_row_and_key(tmp_path: Path, tokenizer: Any) -> None:
    # A Parquet string column holds null where a row has no prompt (from_pylist: a missing key).
    path = tmp_path / "null.parquet"
    rows = [{"question": "1+1=", "answer": "2"}, {"question": None, "answer": "4"}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError) as info:
        _task(tokenizer, path, prompt_key="question")
    assert str(info.value).endswith(f"1 of 2 rows cannot be used: {path} row 1: 'question' is null")


def test_a_missing_nested_key_says_what_the_row_has(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "reward_model": {"style": "rule"}}]), path)
    with pytest.raises(DatasetError, match=r"row 0: no key 'reward_model.ground_truth' "
                       r"\(reward_model has: style\)"):  # fmt: skip
        _task(tokenizer, path, answer_key="reward_model.ground_truth")


@pytest.mark.parametrize(
    ("meta", "answer_key", "said"),
    [
        (None, "meta.answer", "meta is null, not a mapping"),
        ("forty-two", "meta.answer", "meta is text 'forty-two', not a mapping"),
        ([4], "meta.answer", "meta is a list, not a mapping"),
        (4, "meta.answer", "meta is a number (4), not a mapping"),
        (True, "meta.answer", "meta is a boolean (True), not a mapping"),
        ({"gold": None}, "meta.gold.value", "meta.gold is null, not a mapping"),
    ],
)
def test_a_dotted_key_through_a_value_that_is_no_mapping_names_that_part(
    tmp_path: Path, tokenizer: Any, meta: Any, answer_key: str, said: str
) -> None:
    path = _jsonl(
        tmp_path,
        [
            {"prompt": "1+1=", "meta": {"answer": "2", "gold": {"value": "2"}}},
            {"prompt": "x", "meta": meta},
        ],
    )
    with pytest.raises(DatasetError) as info:
        _task(tokenizer, path, answer_key=answer_key)
    assert f"{path} line 2: no key {answer_key!r} ({said})" in str(info.value)


def test_a_null_struct_in_a_parquet_row_is_named_on_the_dotted_key(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [
        {"prompt": "x", "reward_model": {"ground_truth": "2"}},
        {"prompt": "y", "reward_model": None},
    ]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=r"row 1: no key 'reward_model.ground_truth' "
                       r"\(reward_model is null, not a mapping\)"):  # fmt: skip
        _task(tokenizer, path, answer_key="reward_model.ground_truth")


def test_a_long_prompt_is_refused_by_default_and_truncated_from_the_left_when_asked(
    tmp_path: Path, tokenizer: Any
) -> None:
    long_prompt = "The quick brown fox jumps over the dog. " * 8 + "12+7="
    path = _jsonl(
        tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": long_prompt, "answer": "19"}]
    )
    with pytest.raises(DatasetError, match=rf"{path} line 2: the prompt is \d+ tokens, over "
                       r"spec.data.maxPromptLength=16 .*promptOverflow: Truncate"):  # fmt: skip
        _task(tokenizer, path, max_prompt_length=16)
    task = _task(tokenizer, path, max_prompt_length=16, prompt_overflow="Truncate")
    ids = task.problems[1].prompt_ids
    assert len(ids) == 16
    assert tokenizer.decode(ids).endswith("12+7=")


@pytest.mark.parametrize(
    ("name", "parquet"),
    [("train.JSONL", False), ("train.NDJson", False), ("train.Parquet", True), ("train.PQ", True)],
)
def test_a_file_type_is_known_by_its_suffix_in_any_case(
    tmp_path: Path, tokenizer: Any, name: str, parquet: bool
) -> None:
    path = tmp_path / name
    row = {"prompt": "1+1=", "answer": "2"}
    if parquet:
        pq.write_table(pa.Table.from_pylist([row]), path)
    else:
        path.write_text(json.dumps(row) + "\n")
    [problem] = _task(tokenizer, path).problems
    assert (problem.prompt, problem.answer) == ("1+1=", "2")


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("empty.jsonl", "", "the file has no rows"),
        ("blank.jsonl", "\n\n", "the file has no rows"),
        ("train.csv", "prompt,answer\n", "unknown file type; use a .jsonl, .json or .parquet file"),
        ("broken.parquet", "not parquet", "not a readable Parquet file"),
        ("broken.json", '[{"prompt": "1+1="},\n {"prompt"', r"not JSON \(.* at line 2, column"),
    ],
)
def test_an_unusable_file_says_why(
    tmp_path: Path, tokenizer: Any, name: str, content: str, match: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetError, match=match):
        _task(tokenizer, path)


def test_a_json_file_is_read_as_an_array_of_objects_or_as_json_lines(
    tmp_path: Path, tokenizer: Any
) -> None:
    """.json is what datasets' to_json writes (JSON lines under that name) and what a hand-made
    list of rows is (one array); both read, the array's items named by index."""
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    array = tmp_path / "rows.json"
    array.write_text("\ufeff  " + json.dumps(rows, indent=2))  # a BOM and a blank before it
    lines = _jsonl(tmp_path, rows, name="hf_export.JSON")
    for path in (array, lines):
        task = _task(tokenizer, path)
        assert [(p.prompt, p.answer) for p in task.problems] == [("1+1=", "2"), ("2+2=", "4")]
    assert _task(tokenizer, array).problems[1].where == f"{array} item 1"
    assert _task(tokenizer, lines).problems[1].where == f"{lines} line 2"
    array.write_text(json.dumps([rows[0], "2+2="]))
    with pytest.raises(DatasetError, match=r"item 1: an item must be a JSON object, not str"):
        _task(tokenizer, array)


def test_an_empty_parquet_file_has_no_rows(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(DatasetError, match="the file has no rows"):
        _task(tokenizer, path)


def test_a_missing_file_says_to_mount_it(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(DatasetError, match=r"no such file in the pod .mount the volume"):
        _task(tokenizer, tmp_path / "nope.jsonl")


@pytest.mark.parametrize("name", ["shards", "train.parquet"])  # a Spark/datasets output folder
def test_a_directory_is_refused_as_not_a_file(tmp_path: Path, tokenizer: Any, name: str) -> None:
    folder = tmp_path / name
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}]), folder / "0.parquet")
    with pytest.raises(DatasetError) as info:
        _task(tokenizer, folder)
    message = str(info.value)
    assert message.startswith(f"spec.data.source {folder}: a directory, not a file; ")
    assert "one .jsonl, .json or .parquet file is expected" in message
    assert "no such file" not in message  # it is there: mounting it again would not help


@pytest.mark.parametrize("locked", ["file", "folder"])
def test_a_file_the_worker_may_not_read_names_its_user(locked: str) -> None:
    folder = Path(tempfile.mkdtemp())  # not under pytest's tmp_path: that is mode 700
    try:
        path = folder / "train.jsonl"
        path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
        folder.chmod(0o755)
        (path if locked == "file" else folder).chmod(0o000)
        said = as_another_user(lambda: list(read_rows(path)))
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)
    blocked = path if locked == "file" else folder
    assert said.startswith(
        f"DatasetError: spec.data.source {path}: the worker cannot read it (Permission denied: "
    ), said
    assert f": {blocked}; it runs as uid " in said and said.endswith(
        "readable by that user (chmod a+r, a+x on the folders)"
    ), said


def test_the_data_page_points_a_missing_file_to_the_volumes_page() -> None:
    page = Path(__file__).parents[2] / "docs" / "data-and-reward.md"
    bullet = " ".join(page.read_text().split("- **Files in the pod.**")[1].split("\n- ")[0].split())
    assert "[volumes-and-env.md](volumes-and-env.md)" in bullet
    assert "`no such file in the pod (mount the volume that holds it, ...)`" in bullet
    assert "does not mount volumes" not in bullet


def test_sampling_is_seeded_and_draws_from_the_rows(tmp_path: Path, tokenizer: Any) -> None:
    path = _jsonl(tmp_path, [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(10)])
    task = _task(tokenizer, path)
    draw = task.sample(6, salt=3)
    assert draw == _task(tokenizer, path).sample(6, salt=3)
    assert {p.answer for p in draw} <= {str(i) for i in range(10)}


# The builtin tokenizer's counts: arithmetic's prompts take 4 to 6 tokens ('10+10=' 6), digit's
# 6, calculator's 192 (its chat template around the question and the tool-call form).
@pytest.mark.parametrize(
    ("source", "longest", "over", "checked", "label"),
    [
        ("builtin:arithmetic", 6, 12195, 15050, r"'\d+[+-]\d+='"),
        ("builtin:digit", 6, 10, 10, r"'say \d:'"),
        ("builtin:calculator", 192, 32, 32, r"'What is \d+ \* \d+ \+ \d+ \* \d - \d+\?'"),
    ],
    ids=["arithmetic", "digit", "calculator"],
)
def test_builtin_prompts_over_the_length_are_refused_when_the_task_is_made(
    tokenizer: Any, source: str, longest: int, over: int, checked: int, label: str
) -> None:
    # Not at the iteration that first draws a long one: most of arithmetic's prompts fit in 5.
    with pytest.raises(PromptTooLong) as info:
        make_task(
            DataSpec(source=source, max_prompt_length=longest - 1), seed=0, tokenizer=tokenizer
        )
    assert re.fullmatch(
        rf"spec.data.source {source}: {over} of the {checked} prompts checked cannot be used: "
        rf"the longest, {label}, is {longest} tokens, over spec.data.maxPromptLength="
        rf"{longest - 1} \(raise it to {longest}, or set spec.data.promptOverflow: Truncate\)",
        str(info.value),
    ), info.value
    exact = DataSpec(source=source, max_prompt_length=longest)
    assert make_task(exact, seed=0, tokenizer=tokenizer).sample(1, salt=0)[0].prompt_ids


def test_builtin_arithmetic_prompts_obey_the_length_rule(tokenizer: Any) -> None:
    with pytest.raises(PromptTooLong, match="maxPromptLength=1"):
        make_task(DataSpec(max_prompt_length=1), seed=0, tokenizer=tokenizer)
    truncate = DataSpec(max_prompt_length=1, prompt_overflow=PromptOverflow.TRUNCATE)
    [problem] = make_task(truncate, seed=0, tokenizer=tokenizer).sample(1, salt=0)
    assert len(problem.prompt_ids) == 1
