"""The SGLang adapter's CONTRACT checked against the pinned sglang release's own source.

The release (pyproject's `sglang` extra, `sglang==X`) is fetched once without its dependencies
into ~/.cache/rljob (or $RLJOB_CACHE_DIR) and read with `ast`: sglang cannot be imported here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from rljob_worker.engines.base import ALL_TAGS
from rljob_worker.engines.sglang_engine import CONTRACT, SGLangContract

REPO = Path(__file__).resolve().parents[2]
# The one wheel the release publishes (cp311, manylinux_2_34 x86_64); naming it makes the
# download the same on any host. pip and uv spell the platform differently.
WHEEL_PYTHON = "3.11"
PIP_PLATFORM = "manylinux_2_34_x86_64"
UV_PLATFORM = "x86_64-manylinux_2_34"


def pinned_sglang_version() -> str:
    """The version in pyproject's sglang extra, which must pin exactly one release."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for requirement in extras["sglang"]:
        match = re.fullmatch(r"\s*sglang\s*==\s*([\w.+-]+)\s*", requirement)
        if match:
            return match.group(1)
    raise AssertionError(f"pyproject's sglang extra {extras['sglang']} does not pin sglang==X")


def _cache_root() -> Path:
    return Path(os.environ.get("RLJOB_CACHE_DIR") or Path.home() / ".cache" / "rljob")


def _fetch_wheel_into(version: str, target: Path) -> None:
    """Unpack sglang==version, without dependencies, into target (pip, else uv)."""
    requirement = f"sglang=={version}"
    pip = (
        [sys.executable, "-m", "pip"]
        if importlib.util.find_spec("pip")
        else [exe]
        if (exe := shutil.which("pip3") or shutil.which("pip"))
        else None
    )
    if pip is not None:
        with tempfile.TemporaryDirectory() as download:
            subprocess.run(
                [*pip, "download", "--no-deps", "--only-binary=:all:", "--quiet",
                 "--python-version", WHEEL_PYTHON, "--implementation", "cp",
                 "--platform", PIP_PLATFORM, "--dest", download, requirement],
                check=True, timeout=600,
            )  # fmt: skip
            (wheel,) = Path(download).glob("sglang-*.whl")
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        return
    uv = shutil.which("uv")
    if uv is None:
        raise AssertionError("neither pip nor uv is available to fetch the sglang wheel")
    subprocess.run(
        [uv, "pip", "install", "--no-deps", "--quiet", "--target", str(target),
         "--python-version", WHEEL_PYTHON, "--python-platform", UV_PLATFORM, requirement],
        check=True, timeout=600,
    )  # fmt: skip


@cache
def sglang_source() -> Path:
    """The folder holding the pinned release's `sglang` package (fetched on first use)."""
    version = pinned_sglang_version()
    folder = _cache_root() / f"sglang-{version}"
    if not (folder / "sglang" / "srt" / "entrypoints" / "engine.py").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Build aside and rename, so a concurrent or interrupted run never sees half a tree.
        staging = Path(tempfile.mkdtemp(prefix=f".sglang-{version}-", dir=folder.parent))
        try:
            _fetch_wheel_into(version, staging)
            try:
                staging.rename(folder)
            except OSError:
                if not (folder / "sglang").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


# --- reading the source -------------------------------------------------------------------------


class SourceTree:
    """Parsed modules of one unpacked sglang release."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._parsed: dict[str, ast.Module] = {}

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self._parsed:
            path = self.root / (dotted.replace(".", "/") + ".py")
            if not path.exists():
                path = self.root / dotted.replace(".", "/") / "__init__.py"
            self._parsed[dotted] = ast.parse(path.read_text(), filename=str(path))
        return self._parsed[dotted]

    def has_module(self, dotted: str) -> bool:
        base = self.root / dotted.replace(".", "/")
        return base.with_suffix(".py").exists() or (base / "__init__.py").exists()

    def find_class(self, dotted: str, name: str) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as seen from module `dotted`, following `from x import name`."""
        tree = self.module(dotted)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return dotted, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name and self.has_module(node.module):
                        return self.find_class(node.module, alias.name)
        return None

    def methods(self, dotted: str, name: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
        """Methods of a class and of its bases that resolve inside the release (subclass wins)."""
        found = self.find_class(dotted, name)
        if found is None:
            return {}
        module, cls = found
        result: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        for base in reversed(cls.bases):
            if isinstance(base, ast.Name):
                result.update(self.methods(module, base.id))
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                result[node.name] = node
        return result


def annotated_fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    return {
        node.target.id: node
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def server_args_fields(tree: SourceTree) -> dict[str, ast.AnnAssign]:
    """ServerArgs' fields: it is assembled from the classes listed in `_INPUT_NAMESPACES`."""
    module = "sglang.srt.server_args"
    namespaces: list[str] = []
    for node in tree.module(module).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets)
            and isinstance(node.value, ast.List)
        ):
            namespaces = [e.id for e in node.value.elts if isinstance(e, ast.Name)]
    fields: dict[str, ast.AnnAssign] = {}
    for name in namespaces:
        found = tree.find_class(module, name)
        assert found is not None, f"ServerArgs namespace {name} not found in the release"
        fields.update(annotated_fields(found[1]))
    own = tree.find_class(module, "ServerArgs")
    if own is not None:
        fields.update(annotated_fields(own[1]))
    return fields


def _choices(field: ast.AnnAssign) -> list[str] | None:
    for node in ast.walk(field.annotation):
        if isinstance(node, ast.keyword) and node.arg == "choices":
            if isinstance(node.value, ast.List):
                return [
                    e.value
                    for e in node.value.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                ]
            return None
    return None


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], set[str]]:
    """(parameters callable by keyword, those of them without a default), without self."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    # Defaults belong to the last positional parameters.
    without_default = positional[: len(positional) - len(args.defaults)]
    by_keyword = [*args.args, *args.kwonlyargs]
    required = [
        *without_default,
        *(a for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None),
    ]
    names = {a.arg for a in by_keyword} - {"self"}
    return names, {a.arg for a in required} - {"self"}


def _dict_keys(node: ast.AST) -> Iterator[str]:
    for child in ast.walk(node):
        if isinstance(child, ast.Dict):
            for key in child.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    yield key.value


def _tokenizer_manager_returns(tree: SourceTree, method: str) -> str | None:
    for node in ast.walk(tree.module("sglang.srt.managers.tokenizer_control_mixin")):
        if isinstance(node, ast.AsyncFunctionDef) and node.name == method and node.returns:
            return ast.unparse(node.returns)
    return None


def check_contract(contract: SGLangContract, root: Path) -> list[str]:
    """Every way the release disagrees with the contract, one line each (empty: they agree)."""
    tree = SourceTree(root)
    problems: list[str] = []

    # Engine: the class, each method, each keyword the adapter passes, nothing else required.
    if tree.find_class(contract.engine_module, contract.engine_class) is None:
        return [f"{contract.engine_module}.{contract.engine_class} does not exist"]
    methods = tree.methods(contract.engine_module, contract.engine_class)
    for method, passed in contract.engine_methods.items():
        if method not in methods:
            problems.append(f"Engine.{method} does not exist")
            continue
        names, required = _parameters(methods[method])
        for kwarg in passed:
            if kwarg not in names:
                problems.append(f"Engine.{method} has no parameter {kwarg!r} (has {sorted(names)})")
        for missing in sorted(required - set(passed)):
            problems.append(
                f"Engine.{method} requires {missing!r}, which the adapter does not pass"
            )

    # Engine(**kwargs) builds ServerArgs from the keywords.
    init = methods.get("__init__")
    if init is None or init.args.kwarg is None:
        problems.append("Engine.__init__ does not take **kwargs (ServerArgs fields)")
    fields = server_args_fields(tree)
    for name in contract.server_args:
        if name not in fields:
            problems.append(f"ServerArgs has no field {name!r}")
    for name, values in contract.server_arg_choices.items():
        choices = _choices(fields[name]) if name in fields else None
        if choices is None:
            problems.append(f"ServerArgs.{name} declares no choices")
            continue
        problems += [
            f"ServerArgs.{name}={v!r} is not in {choices}" for v in values if v not in choices
        ]

    # Per-request sampling parameters.
    sampling = tree.find_class("sglang.srt.sampling.sampling_params", "SamplingParams")
    sampling_fields = annotated_fields(sampling[1]) if sampling else {}
    for name in contract.sampling_params:
        if name not in sampling_fields:
            problems.append(f"SamplingParams has no field {name!r}")

    # Memory tags: the constants and their string values.
    constants = {
        t.id: node.value.value
        for node in tree.module("sglang.srt.constants").body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    for constant, value in contract.tags.items():
        if constant not in constants:
            problems.append(f"sglang.srt.constants has no {constant}")
        elif constants[constant] != value:
            problems.append(f"{constant} is {constants[constant]!r}, the adapter uses {value!r}")

    # Environment switches: a boolean the release reads, and a value its parser accepts.
    env_fields: dict[str, str] = {}
    accepted: set[str] = set()
    for node in ast.walk(tree.module("sglang.srt.environ")):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            kind = func.id if isinstance(func, ast.Name) else ""
            env_fields.update({t.id: kind for t in node.targets if isinstance(t, ast.Name)})
        if isinstance(node, ast.ClassDef) and node.name == "EnvBool":
            accepted = {
                c.value
                for c in ast.walk(node)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    for name, value in contract.env.items():
        if not env_fields.get(name, "").startswith("EnvBool"):
            problems.append(f"sglang.srt.environ reads no boolean {name}")
        elif value.lower() not in accepted:
            problems.append(f"{name}={value!r} is not a boolean sglang parses")

    # Results the adapter inspects.
    for method in contract.returns_success_message:
        returns = _tokenizer_manager_returns(tree, method)
        if returns not in ("Tuple[bool, str]", "tuple[bool, str]"):
            problems.append(f"{method} returns {returns}, not (success, message)")
    for method, result_class in contract.returns_success_attr.items():
        if _tokenizer_manager_returns(tree, method) != result_class:
            problems.append(f"{method} does not return {result_class}")
        found = tree.find_class("sglang.srt.managers.io_struct", result_class)
        if found is None or "success" not in annotated_fields(found[1]):
            problems.append(f"{result_class} has no field 'success'")
    scheduler = tree.methods("sglang.srt.managers.scheduler", "Scheduler")
    if "get_init_info" not in scheduler or contract.kv_capacity_key not in set(
        _dict_keys(scheduler["get_init_info"])
    ):
        problems.append(f"the scheduler's init info has no {contract.kv_capacity_key!r}")
    if contract.output_ids_key not in set(
        _dict_keys(tree.module("sglang.srt.managers.tokenizer_manager"))
    ):
        problems.append(f"generate() results have no {contract.output_ids_key!r}")

    patch_module, patch_function = contract.tensor_reduction_patch
    if not tree.has_module(patch_module) or not any(
        isinstance(n, ast.FunctionDef) and n.name == patch_function
        for n in tree.module(patch_module).body
    ):
        problems.append(f"{patch_module}.{patch_function} does not exist")
    problems += _handoff_problems(contract, tree)
    return problems


def _handoff_problems(contract: SGLangContract, tree: SourceTree) -> list[str]:
    """The per-TP-rank weight handoff: serializer, wrapper, and the unpickler that admits it."""
    problems: list[str] = []
    module, cls, method = contract.serializer
    if not tree.has_module(module) or tree.find_class(module, cls) is None:
        problems.append(f"{module}.{cls} does not exist")
    elif method not in tree.methods(module, cls):
        problems.append(f"{cls}.{method} does not exist")

    module, cls, field = contract.local_tensor
    found = tree.find_class(module, cls) if tree.has_module(module) else None
    # The schedulers unpickle the wrapper by the module it is defined in.
    if found is None or found[0] != module:
        return [*problems, f"{module}.{cls} is not defined there"]
    if field not in annotated_fields(found[1]):
        problems.append(f"{cls} has no field {field!r}")
    get = tree.methods(module, cls).get("get")
    if get is None or [a.arg for a in get.args.args] != ["self", "rank"]:
        problems.append(f"{cls}.get(rank) does not exist: TP ranks cannot pick their value")

    unpickler_module, unpickler = contract.safe_unpickler
    allowed = tree.find_class(unpickler_module, unpickler)
    pairs = {
        tuple(c.value for c in node.elts if isinstance(c, ast.Constant))
        for node in (ast.walk(allowed[1]) if allowed else ())
        if isinstance(node, ast.Tuple) and len(node.elts) == 2
    }
    if (module, cls) not in pairs:
        problems.append(
            f"{unpickler} does not allow {module}.{cls}: the schedulers would refuse it"
        )
    return problems


# --- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release() -> Path:
    return sglang_source()


def test_cached_release_is_the_version_pyproject_pins(release: Path) -> None:
    (metadata,) = release.glob("sglang-*.dist-info/METADATA")
    version = re.search(r"^Version: (\S+)$", metadata.read_text(), re.MULTILINE)
    assert version is not None
    assert version.group(1) == pinned_sglang_version()


def test_adapter_contract_matches_the_pinned_release(release: Path) -> None:
    assert check_contract(CONTRACT, release) == []


def test_contract_maps_every_tag_the_engine_interface_uses() -> None:
    assert sorted(CONTRACT.tags.values()) == sorted(ALL_TAGS)


@pytest.mark.parametrize(
    ("drift", "expected"),
    [
        (
            {"engine_methods": {**CONTRACT.engine_methods, "release_memory_occupation": ("tag",)}},
            "Engine.release_memory_occupation has no parameter 'tag'",
        ),
        (
            {"engine_methods": {**CONTRACT.engine_methods, "update_weights": ("named_tensors",)}},
            "Engine.update_weights does not exist",
        ),
        (
            {"engine_methods": {**CONTRACT.engine_methods, "update_weights_from_tensor": ()}},
            "Engine.update_weights_from_tensor requires 'named_tensors'",
        ),
        (
            {"server_args": (*CONTRACT.server_args, "mem_fraction_statics")},
            "ServerArgs has no field 'mem_fraction_statics'",
        ),
        ({"server_arg_choices": {"dtype": ("bf16",)}}, "ServerArgs.dtype='bf16' is not in"),
        ({"sampling_params": ("max_tokens",)}, "SamplingParams has no field 'max_tokens'"),
        (
            {"tags": {**CONTRACT.tags, "GPU_MEMORY_TYPE_KV_CACHE": "kv-cache"}},
            "GPU_MEMORY_TYPE_KV_CACHE is 'kv_cache', the adapter uses 'kv-cache'",
        ),
        # The switch that older releases read; this one rewrites it to a name nothing reads.
        (
            {"env": {"SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK": "True"}},
            "sglang.srt.environ reads no boolean SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK",
        ),
        ({"kv_capacity_key": "max_total_tokens"}, "init info has no 'max_total_tokens'"),
        (
            {"serializer": ("sglang.srt.utils.common", "MultiprocessingSerializer", "dumps")},
            "MultiprocessingSerializer.dumps does not exist",
        ),
        (
            {"local_tensor": (*CONTRACT.local_tensor[:2], "tensors")},
            "LocalSerializedTensor has no field 'tensors'",
        ),
        # Re-exported there, but the schedulers' unpickler admits it only from weight_updater.
        (
            {"local_tensor": ("sglang.srt.weight_sync.utils", "LocalSerializedTensor", "values")},
            "sglang.srt.weight_sync.utils.LocalSerializedTensor is not defined there",
        ),
        ({"returns_success_message": ("flush_cache",)}, "flush_cache returns"),
    ],
)
def test_checker_reports_a_contract_that_drifted_from_the_release(
    release: Path, drift: dict[str, object], expected: str
) -> None:
    problems = check_contract(dataclasses.replace(CONTRACT, **drift), release)  # type: ignore[arg-type]
    assert len(problems) == 1, problems
    assert expected in problems[0]
