"""The tools a multi-turn conversation may call: builtin:calculator (in this process, bounded
arithmetic), builtin:python (a Python expression in a child process with a time and memory
limit) and the user's FILE_OR_MODULE:callable.

A tool that raises, times out or answers something that is not text gives the model an error
text (ToolOutcome.error) and the conversation goes on: a tool never stalls the iteration.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rljob.api import BUILTIN_TOOL_CALCULATOR, BUILTIN_TOOL_PYTHON, MultiTurnSpec
from rljob_worker.agentic.python_runner import Evaluation, ZygotePool
from rljob_worker.agentic.tool_calls import CallProblem, ParsedCall

# Bounds of the calculator: no 9**9**9 that takes the rank's CPU for minutes.
CALCULATOR_MAX_EXPONENT = 64
CALCULATOR_MAX_DIGITS = 200
EXPRESSION_MAX_CHARACTERS = 2000


class Tool(Protocol):
    name: str
    schema: dict[str, Any]  # the OpenAI-style function schema given to the chat template

    async def __call__(self, arguments: dict[str, Any], timeout_seconds: float) -> str: ...


@dataclass(frozen=True)
class ToolOutcome:
    text: str
    error: bool = False
    timed_out: bool = False


def _expression_schema(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }


def _expression(arguments: dict[str, Any]) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError('the arguments must be {"expression": TEXT}')
    if len(expression) > EXPRESSION_MAX_CHARACTERS:
        raise ValueError(f"the expression is over {EXPRESSION_MAX_CHARACTERS} characters")
    return expression


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> int | float:
    """+ - * / // % ** and parentheses over numbers; anything else is refused (ValueError)."""

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            if isinstance(node.value, bool):
                raise ValueError(f"{node.value!r} is not a number")
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))  # type: ignore[no-any-return]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > CALCULATOR_MAX_EXPONENT:
                raise ValueError(f"exponent {right} is over {CALCULATOR_MAX_EXPONENT}")
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, int) and len(str(abs(result))) > CALCULATOR_MAX_DIGITS:
                raise ValueError(f"the result has over {CALCULATOR_MAX_DIGITS} digits")
            return result  # type: ignore[no-any-return]
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression ({error.msg})") from None
    return value(tree)


def format_number(number: int | float) -> str:
    if isinstance(number, float) and number.is_integer() and abs(number) < 1e16:
        return str(int(number))
    return repr(number) if isinstance(number, float) else str(number)


class Calculator:
    """builtin:calculator: arithmetic, in this process (pure and bounded, no child needed)."""

    name = "calculator"
    schema = _expression_schema(
        name, "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
    )

    async def __call__(self, arguments: dict[str, Any], timeout_seconds: float) -> str:
        return format_number(calculate(_expression(arguments)))


def python_answer(evaluation: Evaluation) -> str:
    """builtin:python's answer: the expression's repr, or RuntimeError with its error or, where
    the process ended before it could say (a limit's signal, MemoryError before the handler),
    its exit code and last line of output."""
    text = evaluation.output.strip()
    if evaluation.exit_code != 0:
        if text.startswith("Error:"):
            raise RuntimeError(text.removeprefix("Error: "))
        last = text.splitlines()[-1:] or [""]
        raise RuntimeError(
            f"the expression ended the runner (exit {evaluation.exit_code}) {last[0]}"
        )
    return text


class PythonExpression:
    """builtin:python: one Python expression in a fresh process (forked by the rank's pool of
    python runners, python_runner.py), with an address-space limit (toolMemoryMegabytes), a CPU
    limit, and the call's timeout (the process is killed). Only a few builtins and `math` are
    visible: a calculator with Python's syntax, not a shell. close() ends the runners."""

    name = "python"
    schema = _expression_schema(
        name,
        "Evaluate one Python expression (builtins such as sum, range, sorted, and the math "
        "module) and return its repr.",
    )

    def __init__(self, memory_megabytes: int, pool: ZygotePool | None = None) -> None:
        self.memory_bytes = memory_megabytes << 20
        self.pool = pool if pool is not None else ZygotePool()

    async def __call__(self, arguments: dict[str, Any], timeout_seconds: float) -> str:
        evaluation = await self.pool.evaluate(
            _expression(arguments),
            memory_bytes=self.memory_bytes,
            cpu_seconds=math.ceil(timeout_seconds) + 1,
            timeout_seconds=timeout_seconds,
        )
        return python_answer(evaluation)

    def close(self) -> None:
        self.pool.close()


class UserTool:
    """FILE_OR_MODULE:callable: called with the call's arguments as keywords; returns text (or
    anything json.dumps takes). An `async def` is awaited; a plain function runs in a thread,
    which a timeout stops waiting for (the thread itself cannot be stopped). Its schema is the
    callable's `tool_schema` attribute where it has one, else made from its signature and
    docstring."""

    def __init__(self, target: str) -> None:
        from rljob_worker.reward_child import load_function

        try:
            self.function = load_function(target)
        except ValueError as error:
            raise ValueError(f"spec.rollout.multiTurn.tools {target!r}: {error}") from None
        self.schema = getattr(self.function, "tool_schema", None) or self._schema()
        self.name = str(self.schema.get("function", self.schema)["name"])

    def _schema(self) -> dict[str, Any]:
        parameters = inspect.signature(self.function).parameters
        return {
            "type": "function",
            "function": {
                "name": self.function.__name__,
                "description": (inspect.getdoc(self.function) or "").split("\n\n")[0],
                "parameters": {
                    "type": "object",
                    "properties": {n: {"type": "string"} for n in parameters},
                    "required": [
                        n for n, p in parameters.items() if p.default is inspect.Parameter.empty
                    ],
                },
            },
        }

    async def __call__(self, arguments: dict[str, Any], timeout_seconds: float) -> str:
        if inspect.iscoroutinefunction(self.function):
            result = await self.function(**arguments)
        else:
            result = await asyncio.to_thread(self.function, **arguments)
        return result if isinstance(result, str) else json.dumps(result)


class ToolSet:
    """The job's tools by name, and the one way a call is run (with the timeout and errors)."""

    def __init__(self, tools: Sequence[Tool], timeout_seconds: float) -> None:
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            names = [t.name for t in tools]
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"spec.rollout.multiTurn.tools: two tools are named {twice}")
        self.timeout_seconds = timeout_seconds

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def run(self, call: ParsedCall) -> ToolOutcome:
        if isinstance(call, CallProblem):
            return ToolOutcome(call.text, error=True)
        tool = self.tools[call.name]  # the parser let only known names through
        try:
            text = await asyncio.wait_for(
                tool(call.arguments, self.timeout_seconds), self.timeout_seconds
            )
        except TimeoutError:
            return ToolOutcome(
                f"Error: {call.name} took longer than {self.timeout_seconds:g} s and was stopped.",
                error=True,
                timed_out=True,
            )
        except Exception as error:  # the tool's failure is the model's answer, not the job's
            return ToolOutcome(f"Error: {type(error).__name__}: {error}", error=True)
        return ToolOutcome(text)

    def close(self) -> None:
        """End the processes the tools keep (builtin:python's runners); called where the
        rollout ends. The tools may still be called after: they start what they need again."""
        for tool in self.tools.values():
            close = getattr(tool, "close", None)
            if close is not None:
                close()


def make_tools(settings: MultiTurnSpec) -> ToolSet:
    """The ToolSet of spec.rollout.multiTurn.tools; a user tool that cannot load fails here."""
    tools: list[Tool] = []
    for name in settings.tools:
        if name == BUILTIN_TOOL_CALCULATOR:
            tools.append(Calculator())
        elif name == BUILTIN_TOOL_PYTHON:
            tools.append(PythonExpression(settings.tool_memory_megabytes))
        else:
            tools.append(UserTool(name))
    return ToolSet(tools, settings.tool_timeout_seconds)
