"""spec.data's file: JSONL and Parquet rows, dotted keys, chat messages through the builtin
tokenizer's template, and every defect reported at start with the file and the row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rljob.api import DataSpec, PromptOverflow
from rljob_worker.dataset import DatasetError, DatasetTask
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


def test_a_missing_nested_key_says_what_the_row_has(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "reward_model": {"style": "rule"}}]), path)
    with pytest.raises(DatasetError, match=r"row 0: no key 'reward_model.ground_truth' "
                       r"\(reward_model has: style\)"):  # fmt: skip
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
    ("name", "content", "match"),
    [
        ("empty.jsonl", "", "the file has no rows"),
        ("blank.jsonl", "\n\n", "the file has no rows"),
        ("train.csv", "prompt,answer\n", "unknown file type; use a .jsonl or .parquet file"),
        ("broken.parquet", "not parquet", "not a readable Parquet file"),
    ],
)
def test_an_unusable_file_says_why(
    tmp_path: Path, tokenizer: Any, name: str, content: str, match: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetError, match=match):
        _task(tokenizer, path)


def test_an_empty_parquet_file_has_no_rows(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(DatasetError, match="the file has no rows"):
        _task(tokenizer, path)


def test_a_missing_file_says_to_mount_it(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(DatasetError, match=r"no such file in the pod .mount the volume"):
        _task(tokenizer, tmp_path / "nope.jsonl")


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


def test_builtin_arithmetic_prompts_obey_the_length_rule(tokenizer: Any) -> None:
    refuse = make_task(DataSpec(max_prompt_length=1), seed=0, tokenizer=tokenizer)
    with pytest.raises(PromptTooLong, match="maxPromptLength=1"):
        refuse.sample(1, salt=0)
    truncate = DataSpec(max_prompt_length=1, prompt_overflow=PromptOverflow.TRUNCATE)
    [problem] = make_task(truncate, seed=0, tokenizer=tokenizer).sample(1, salt=0)
    assert len(problem.prompt_ids) == 1
