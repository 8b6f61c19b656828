"""The process a user's reward function runs in: `python -m rljob_worker.reward_child FD SPEC`.

It loads FILE_OR_MODULE:callable once, says "ready" (or why not) on the socket FD, then answers
one call at a time: ("ok", score, extras) or ("error", why). The rank ends it on a timeout.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from rljob_worker.rewards import RewardValueError, score_of


def load_function(spec: str) -> Callable[..., Any]:
    """FILE_OR_MODULE:callable: a path (ends in .py or holds a '/') is loaded as a file, anything
    else imported as a module from the image's packages. ValueError says what is missing."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise ValueError(
                f"{path}: no such file in the pod (mount it, e.g. from a ConfigMap, or copy it "
                "into the image)"
            )
        module_spec = importlib.util.spec_from_file_location(f"rljob_reward_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{path}: not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses and pickling look themselves up
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as error:
            # The hint is for a name meant as a file ("rewards" for rewards.py); when the module
            # was found and one of its own imports is missing, it would point the wrong way.
            named = error.name is not None and (
                target == error.name or target.startswith(f"{error.name}.")
            )
            if named:
                raise ValueError(
                    f"no module {error.name!r} in the image (a file path needs '/' or '.py')"
                ) from None
            raise ValueError(
                f"{target} imports {error.name!r}, which is not in the image (install it in an "
                "image FROM the worker image)"
            ) from None
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and n[0] != "_")
        raise ValueError(f"{target} has no function {name!r} (it defines: {', '.join(defined)})")
    return function  # type: ignore[no-any-return]


def _die_with_parent() -> None:
    """A call that hangs never reads the closed socket: ask Linux to end us with the rank."""
    if sys.platform == "linux":
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the rank ended before the line above
        sys.exit(0)


def serve(conn: Connection, spec: str) -> None:
    try:
        function = load_function(spec)
    except Exception as error:  # reported to the rank, which fails the job with it
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready",))
    while True:
        try:
            data_source, solution, truth, extra = conn.recv()
        except EOFError:
            return
        try:
            score, extras = score_of(function(data_source, solution, truth, extra))
        except RewardValueError as error:
            conn.send(("error", str(error)))
        except Exception as error:  # the user's function: any exception is its answer
            conn.send(("error", f"{type(error).__name__}: {error}"))
        else:
            conn.send(("ok", score, extras))


def main(argv: list[str]) -> None:
    _die_with_parent()
    serve(Connection(int(argv[1])), argv[2])


if __name__ == "__main__":
    main(sys.argv)
