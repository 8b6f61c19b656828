"""A user's mistakes at the command line get one line naming the file, field or flag, and an
exit status of their own, before anything starts: `rljob plan`, `rljob run`, `rljob crd`,
`rljob operator` and `kubectl rljob` (none prints a traceback for bad input)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.plan_cli import main as plan_main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-local.yaml"


def tiny(tmp_path: Path, edit: Any = None, name: str = "job.yaml") -> Path:
    doc = yaml.safe_load(TINY.read_text())
    if edit is not None:
        edit(doc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_says_what_is_wrong_with_the_manifest_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def typo(doc: dict[str, Any]) -> None:
        doc["spec"]["rollout"]["memFractionStatc"] = 0.8

    def bad_name(doc: dict[str, Any]) -> None:
        doc["metadata"]["name"] = "Tiny_Local"

    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    cases = [
        (tiny(tmp_path, typo, "typo.yaml"), "memFractionStatc"),
        (tiny(tmp_path, bad_name, "name.yaml"), "DNS-1035"),
        (broken, "not valid YAML"),
        (empty, "found 0"),
        (tmp_path / "missing.yaml", "No such file"),
        (tmp_path, "Is a directory"),
    ]
    for path, words in cases:
        assert plan_main([str(path), "--gpu-memory", "80Gi"]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("rljob plan: ") and words in err, err
        assert "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "-5", "99999999999999999999999"])
def test_plan_refuses_a_gpu_memory_no_gpu_has(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        plan_main([str(TINY), "--gpu-memory", value])
    assert exit_.value.code == 2
    assert "more than 0 and at most 16Ti" in capsys.readouterr().err


@pytest.mark.parametrize("example", ["one-gpu-grpo.yaml", "multi-node-tp.yaml"])
def test_the_hugging_face_examples_plan_as_shipped_and_fit(
    example: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_main([str(REPO / "examples" / example)]) == 0
    printed = capsys.readouterr().out
    if example == "one-gpu-grpo.yaml":  # the README's first GPU job leaves both knobs to Auto
        assert "rollout Auto chose wakeUp staged, memFractionStatic 0.9" in printed
    else:
        assert "(the spec's) at memFractionStatic" in printed


def run_main(argv: list[str]) -> int:
    from rljob_worker.cli_run import main

    return main(argv)


def test_run_refuses_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def sglang(doc: dict[str, Any]) -> None:  # a GPU job, run here with --device cpu
        doc["spec"]["rollout"]["engine"] = "sglang"
        doc["spec"]["resources"]["gpusPerWorker"] = 1

    def missing_data(doc: dict[str, Any]) -> None:
        doc["spec"]["data"]["source"] = str(tmp_path / "nowhere.jsonl")

    def long_name(doc: dict[str, Any]) -> None:
        doc["metadata"]["name"] = "x" * 62

    def mini_batches(doc: dict[str, Any]) -> None:  # 8 responses a rank at the spec's 2 ranks
        doc["spec"]["algorithm"]["ppoMiniBatches"] = 8

    def export_over_checkpoints(doc: dict[str, Any]) -> None:  # the same directory by a link
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "link").symlink_to(tmp_path / "run")
        doc["spec"]["checkpoint"] = {"path": str(tmp_path / "run" / "ckpt")}
        doc["spec"]["export"] = {"path": str(tmp_path / "link")}

    def missing_tool(doc: dict[str, Any]) -> None:
        doc.update(yaml.safe_load((REPO / "examples" / "multi-turn-tools.yaml").read_text()))
        doc["spec"]["rollout"]["multiTurn"]["tools"] = ["no_such_tools_mod:lookup"]

    out = tmp_path / "out"
    cases = [
        ([str(tiny(tmp_path, sglang, "s.yaml")), "--device", "cpu"], "needs a CUDA GPU"),
        ([str(TINY), "--ranks", "3"], "must be a multiple of the 3 ranks"),
        ([str(tiny(tmp_path, missing_data, "d.yaml"))], "nowhere.jsonl"),
        ([str(tiny(tmp_path, long_name, "n.yaml"))], "at most 47 characters"),
        (
            [str(tiny(tmp_path, mini_batches, "m.yaml")), "--ranks", "4"],
            "ppoMiniBatches=8 is more than the 4 responses each of the 4 ranks",
        ),
        (
            [str(tiny(tmp_path, export_over_checkpoints, "e.yaml"))],
            "is spec.checkpoint.path",
        ),
        ([str(tiny(tmp_path, missing_tool, "t.yaml"))], "no module 'no_such_tools_mod'"),
    ]
    for argv, words in cases:
        assert run_main([*argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err
        assert words in " ".join(err.split()), err  # rich wraps long lines
        assert not out.exists()  # nothing ran, nothing written
    with pytest.raises(SystemExit) as exit_:
        run_main([str(TINY), "--ranks", "0"])
    assert exit_.value.code == 2


def test_crd_operator_and_kubectl_rljob_name_the_file_or_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rljob import kubectl_plugin
    from rljob_operator import crdgen
    from rljob_operator import main as operator_main

    assert crdgen.main(["--out", str(tmp_path / "no" / "crd.yaml")]) == 2
    assert "rljob crd: " in capsys.readouterr().err
    from kubernetes.config import kube_config

    missing = str(tmp_path / "kubeconfig")
    # The client reads $KUBECONFIG once, at import: its default path is what load_kube_config
    # uses, so that is what is pointed at the missing file (and not in a pod).
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", missing)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert operator_main.main(["--standalone"]) == 2
    assert "no usable kubeconfig" in capsys.readouterr().err
    assert kubectl_plugin.main(["--kubeconfig", missing, "describe", "job"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"no usable kubeconfig at {missing}" in err and "Traceback" not in err


def _closed_pipe_run(*argv: str) -> tuple[int, str]:
    """Run `python -m rljob.cli ARGV` with stdout a pipe whose reader is already gone (as
    `| head` leaves it once it has its lines): (exit status, stderr)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "rljob.cli", *argv], stdout=write, stderr=subprocess.PIPE,
            timeout=120, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    return proc.returncode, proc.stderr.decode()


@pytest.mark.parametrize(
    "argv", [("crd",), ("plan", str(TINY), "--gpu-memory", "80Gi"), ("version",)]
)
def test_a_reader_that_stops_early_ends_the_command_quietly(argv: tuple[str, ...]) -> None:
    """`rljob plan x | head`: the pipe closes while the command still writes. The reading
    commands end with 141 (128 + SIGPIPE, as a shell reports a program the signal stopped) and
    no traceback; before, Python's BrokenPipeError."""
    code, err = _closed_pipe_run(*argv)
    assert code == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_a_broken_pipe_elsewhere_in_rljob_run_is_not_hidden(monkeypatch: Any) -> None:
    """Only the reading commands are wrapped: in `rljob run` (or the driver, the operator) a
    BrokenPipeError may come from another pipe, and it must surface."""
    from rljob import cli

    def broken(_: list[str]) -> int:
        raise BrokenPipeError("a rank's queue")

    monkeypatch.setitem(cli.COMMANDS, "run", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["run", "x.yaml"])
