"""`rljob run` accepts manifests with volumes, mounts and env: spec.env's literal values reach
the ranks' environment (expanded as Kubernetes expands them), Secret- and ConfigMap-backed ones
are said to come from the shell, and volumes are only reported."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api import RLJobSpec
from rljob_worker import cli_run
from rljob_worker.local_env import expand, local_env

REPO = Path(__file__).resolve().parents[2]

ENV = [
    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
    {"name": "HF_HOME", "value": "$(SCRATCH)/hf"},
    {"name": "CACHE", "value": "$(HF_HOME)/cache and $$(HF_HOME) and $(UNSET)"},
]


@pytest.mark.parametrize(
    ("value", "expanded"),
    [
        ("$(A)/x", "1/x"),
        ("$$(A)", "$(A)"),
        ("$$", "$"),
        ("$(MISSING)", "$(MISSING)"),
        ("$A $(A", "$A $(A"),
        ("$(A)$(B)", "12"),
    ],
)
def test_references_expand_as_the_kubelet_expands_them(value: str, expanded: str) -> None:
    assert expand(value, {"A": "1", "B": "2"}) == expanded


def test_literal_values_are_set_and_secret_backed_ones_come_from_the_shell() -> None:
    spec = RLJobSpec.model_validate(
        {"env": ENV, "envFrom": [{"configMapRef": {"name": "rl-settings"}}]}
    )
    env = local_env(spec, {"SCRATCH": "/tmp/s", "HF_TOKEN": "from-shell"})
    assert env.values == {
        "HF_HOME": "/tmp/s/hf",
        "CACHE": "/tmp/s/hf/cache and $(HF_HOME) and $(UNSET)",
    }
    assert env.cluster_only == [
        "envFrom ConfigMap rl-settings",
        "HF_TOKEN (Secret hf-token key token; taken from your shell)",
    ]


def test_without_env_from_a_reference_expands_only_to_the_entries_before_it() -> None:
    # The kubelet never expands the image's variables (the shell's, here): $(HOME) stays; a
    # Secret-backed entry before expands by the shell's value, which stands in for it.
    spec = RLJobSpec.model_validate({
        "env": [
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "t", "key": "k"}}},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "t", "key": "k2"}}},
            {"name": "A", "value": "$(HOME)/a"},
            {"name": "B", "value": "$(A):$(TOKEN):$(LATER):$(KEY)"},
            {"name": "LATER", "value": "x"},
        ]
    })  # fmt: skip
    env = local_env(spec, {"HOME": "/root", "TOKEN": "s3cret", "LATER": "shell"})
    assert env.values == {
        "A": "$(HOME)/a", "B": "$(HOME)/a:s3cret:$(LATER):$(KEY)", "LATER": "x"
    }  # fmt: skip
    # KEY is defined, by its Secret, on the cluster: only the shell here lacks it.
    assert env.unexpanded == ["A: $(HOME)", "B: $(LATER)"]


class _Started(Exception):
    """Raised instead of starting the ranks."""


def test_rljob_run_accepts_volumes_and_gives_the_ranks_the_literal_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((REPO / "examples" / "tiny-local.yaml").read_text())
    doc["spec"] |= {
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "rl-data"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "env": ENV,
    }
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    monkeypatch.setattr(os, "environ", {"SCRATCH": "/tmp/s"})
    seen: dict[str, str] = {}

    def start(*args: Any, **kwargs: Any) -> None:
        seen.update(os.environ)  # what the rank processes would inherit
        raise _Started

    monkeypatch.setattr(cli_run, "_preflight", lambda *a: None)
    monkeypatch.setattr(cli_run, "_attempt", start)
    with pytest.raises(_Started):
        cli_run.main([str(manifest), "--out", str(tmp_path / "out"), "--device", "cpu"])
    # No envFrom: SCRATCH (the shell's, as an image's variable would be) is not expanded, as in
    # the pod, and the run says so.
    assert seen["HF_HOME"] == "$(SCRATCH)/hf" and "HF_TOKEN" not in seen
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "no earlier entry (nor envFrom) defines HF_HOME: $(SCRATCH)" in err, err
    assert "HF_TOKEN (Secret hf-token key token; not set here)" in err
    assert "not mounted locally" in err
