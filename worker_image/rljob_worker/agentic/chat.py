"""The token ids of a conversation's tool turn, from the model's own chat template.

Token in, token out: the prompt is encoded once and the model's turns are the ids it sampled,
so only the text between them (end of the assistant turn, the tool messages, the next assistant
header) is rendered here. Each tool result is tokenized once, and cut to its token budget, then
placed between the template's pieces: re-templating the whole conversation afterwards would give
ids that differ from the sampled ones (verl's lesson), which is what this avoids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_ANSWER = "\x00rljob-assistant\x00"
_RESULT = "\x00rljob-tool-{}\x00"


@dataclass(frozen=True)
class ToolTurn:
    ids: list[int]
    truncated_results: int  # results cut to maxToolResponseLength


class ChatFormat:
    """The tokenizer's chat template, split around an assistant answer and tool results."""

    def __init__(self, tokenizer: Any, tool_schemas: Sequence[dict[str, Any]]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "spec.rollout.mode multiTurn needs a chat template: the model's tokenizer has "
                "none (use a chat/instruct model)"
            )
        self.tokenizer = tokenizer
        self.tools = list(tool_schemas)
        self._pieces: dict[int, list[str]] = {}

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text: str = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The first prompt: the messages with the tools' schemas and the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def _split(self, results: int) -> list[str]:
        """The template's text after an assistant answer, around `results` tool messages: piece
        0 ends the assistant turn, pieces 1..n-1 sit between results, piece n opens the next
        assistant turn."""
        if results not in self._pieces:
            base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANSWER}]
            tools = [{"role": "tool", "content": _RESULT.format(i)} for i in range(results)]
            before = self.render(base, generation_prompt=False)
            after = self.render(base + tools, generation_prompt=True)
            start = before.index(_ANSWER) + len(_ANSWER)
            if after[:start] != before[:start]:
                raise ValueError(
                    "the chat template renders earlier turns differently once tool "
                    "messages follow; multiTurn cannot append tool turns to it"
                )
            text, pieces = after[start:], []
            for i in range(results):
                piece, _, text = text.partition(_RESULT.format(i))
                pieces.append(piece)
            self._pieces[results] = [*pieces, text]
        return self._pieces[results]

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (a stop id's: Qwen's `<|im_end|>`)."""
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def tool_turn(
        self, results: Sequence[str], sampled_end: str, max_result_tokens: int
    ) -> ToolTurn:
        """Ids to append after a model turn that called tools: the rest of the assistant turn,
        the results, and the next assistant header. `sampled_end` is the text of the stop token
        that ended the turn ("" where none did): where the template's end of turn begins with
        it, the model already sampled that text and it is not added twice; any other stop
        (Qwen2.5's `<|endoftext|>` where its turns end with `<|im_end|>`) leaves the turn open,
        and the template's end of turn follows it."""
        pieces = self._split(len(results))
        first = pieces[0]
        if sampled_end and first.startswith(sampled_end):
            first = first[len(sampled_end) :]
        ids = self.encode(first)
        truncated = 0
        for result, piece in zip(results, pieces[1:], strict=True):
            result_ids = self.encode(result)
            if len(result_ids) > max_result_tokens:
                result_ids, truncated = result_ids[:max_result_tokens], truncated + 1
            ids += result_ids + self.encode(piece)
        return ToolTurn(ids, truncated)
