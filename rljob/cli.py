"""The `rljob` command: one entry point that dispatches to the operator, the worker and tools.

Each subcommand imports its side lazily, so `rljob operator` never imports torch and
`rljob run` never imports kopf.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

USAGE = """usage: rljob COMMAND [ARGS...]

commands:
  run MANIFEST [--out DIR]   run an RLJob manifest locally (CPU or GPU; no cluster needed)
  operator [ARGS...]         run the kopf operator (reconciles RLJobs into KubeRay RayJobs)
  plan MANIFEST [--gpu-memory BYTES|Gi] [--json]
                             predict per-stage GPU memory and the largest fitting memFractionStatic
  crd                        print the RLJob CustomResourceDefinition generated from the models
  spec-doc                   print the RLJob field reference (docs/rljob-spec.md) from the models
  curve METRICS_FILE [-o PNG]
                             draw the learning curve of a job's <checkpoint.path>/metrics.jsonl
  driver [ARGS...]           the Ray driver (the RayJob's entrypoint inside the cluster)
  version                    print the version
"""


def _run(argv: list[str]) -> int:
    from rljob_worker.cli_run import main

    return main(argv)


def _operator(argv: list[str]) -> int:
    from rljob_operator.main import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from rljob.plan_cli import main

    return main(argv)


def _crd(argv: list[str]) -> int:
    from rljob_operator.crdgen import main

    return main(argv)


def _spec_doc(argv: list[str]) -> int:
    from rljob_operator.specdoc import main

    return main(argv)


def _curve(argv: list[str]) -> int:
    from rljob.metrics_file import main

    return main(argv)


def _driver(argv: list[str]) -> int:
    from rljob_worker.driver.ray_main import main

    return main(argv)


def _version(argv: list[str]) -> int:
    from rljob import __version__

    print(__version__)
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "run": _run,
    "operator": _operator,
    "plan": _plan,
    "crd": _crd,
    "spec-doc": _spec_doc,
    "curve": _curve,
    "driver": _driver,
    "version": _version,
}


def quiet_on_closed_pipe(command: Callable[[], int]) -> int:
    """Run a command whose output may go to a reader that stops early (`rljob plan x | head`):
    a closed pipe ends it quietly with 141 (128 + SIGPIPE, what a shell reports for a program the
    signal stopped), not with a traceback; stdout then points at /dev/null, so the interpreter's
    own flush at exit does not raise the same error again."""
    try:
        code = command()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


# The commands whose output is for reading or piping (`rljob plan x | head`). Not run, driver
# or operator: there a BrokenPipeError may come from another pipe (the ranks' queues, Ray) and
# must surface with its traceback.
HELP = ("-h", "--help", "help")
PIPED = ("plan", "crd", "spec-doc", "version", *HELP)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] not in PIPED:
        return _dispatch(args)
    return quiet_on_closed_pipe(lambda: _dispatch(args))


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in HELP:
        print(USAGE, end="")
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"rljob: unknown command {args[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
