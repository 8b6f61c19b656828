"""Hermes-style tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what
Qwen2.5's template asks for), parsed from the text of one model turn (decoded once).

A call that cannot be run (bad JSON, no name, unknown tool, an unclosed tag) becomes a
CallProblem whose text the model gets back as the tool's answer: the conversation goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallProblem:
    """A tool call that cannot be run; `text` is what the model is told."""

    text: str


ParsedCall = ToolCall | CallProblem


def _one_call(body: str, known: Collection[str]) -> ParsedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return CallProblem(f"Error: the tool call is not valid JSON ({error.msg}).")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return CallProblem('Error: a tool call is {"name": TOOL, "arguments": {...}}.')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return CallProblem("Error: the tool call's arguments are not valid JSON.")
    if not isinstance(arguments, dict):
        return CallProblem("Error: the tool call's arguments must be a JSON object.")
    name = value["name"]
    if name not in known:
        return CallProblem(f"Error: unknown tool {name!r}; the tools are: {', '.join(known)}.")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str, known: Collection[str]) -> list[ParsedCall]:
    """Every `<tool_call>` block of one turn's text, in order; [] when the turn calls nothing
    (its text is then the conversation's answer). An opening tag left unclosed at the end is a
    problem too: the model meant to call and did not finish."""
    calls: list[ParsedCall] = [_one_call(m.group(1).strip(), known) for m in _CALL.finditer(text)]
    tail = text[text.rfind(CLOSE_TAG) + len(CLOSE_TAG) :] if CLOSE_TAG in text else text
    if OPEN_TAG in tail:
        calls.append(CallProblem(f"Error: {OPEN_TAG} without {CLOSE_TAG}."))
    return calls
