"""The SGLang adapter's contract for each supported release, checked against that release's source.

Every release in the adapter's CONTRACTS (which pyproject's `sglang` extra admits, and only those)
is fetched once without its dependencies into ~/.cache/rljob (or $RLJOB_CACHE_DIR) and read with
`ast`: sglang cannot be imported here. Where releases differ, a test says which contract handles
which difference.
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
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from packaging.requirements import Requirement

from rljob_worker.engines.base import ALL_TAGS
from rljob_worker.engines.sglang_engine import CONTRACTS, SUPPORTED_SGLANG_VERSIONS, SGLangContract

REPO = Path(__file__).resolve().parents[2]
# The one wheel each release publishes (cp311, manylinux_2_34 x86_64, 0.5.17 and 0.5.23 alike);
# naming it makes the download the same on any host. pip and uv spell the platform differently.
WHEEL_PYTHON = "3.11"
PIP_PLATFORM = "manylinux_2_34_x86_64"
UV_PLATFORM = "x86_64-manylinux_2_34"


def sglang_extra() -> Requirement:
    """pyproject's sglang extra, which must be the one requirement on sglang."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (requirement,) = extras["sglang"]
    parsed = Requirement(requirement)
    assert parsed.name == "sglang", requirement
    return parsed


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
def sglang_source(version: str) -> Path:
    """The folder holding release `version`'s `sglang` package (fetched on first use)."""
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


def _assigned_meta_info_keys(node: ast.AST) -> Iterator[str]:
    """Keys the module stores with `meta_info["key"] = ...` (how sglang fills in log-probs)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Assign):
            for target in child.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "meta_info"
                    and isinstance(target.slice, ast.Constant)
                    and isinstance(target.slice.value, str)
                ):
                    yield target.slice.value


def _env_readers(root: Path, name: str) -> list[Path]:
    """Modules outside sglang.srt.environ that read the switch (`envs.NAME.get()` and the like)."""
    environ = root / "sglang" / "srt" / "environ.py"
    return [
        path
        for path in (root / "sglang").rglob("*.py")
        if path != environ and f"envs.{name}." in path.read_text(errors="replace")
    ]


def _subscript_keys(node: ast.AST, variable: str) -> set[str]:
    """String keys `k` of every `variable["k"]` under node."""
    return {
        child.slice.value
        for child in ast.walk(node)
        if isinstance(child, ast.Subscript)
        and isinstance(child.value, ast.Name)
        and child.value.id == variable
        and isinstance(child.slice, ast.Constant)
        and isinstance(child.slice.value, str)
    }


def _rpc_problems(
    contract: SGLangContract,
    tree: SourceTree,
    method: str,
    engine_method: ast.FunctionDef | ast.AsyncFunctionDef,
    passed: tuple[str, ...],
) -> list[str]:
    """An Engine method that forwards **kwargs to every scheduler (collective_rpc): it must take
    **kwargs, and the scheduler side must read exactly the keywords passed (`params["name"]`:
    one it reads and the adapter does not pass is a KeyError in every scheduler)."""
    if engine_method.args.kwarg is None:
        return [f"Engine.{method} takes no **kwargs to forward to the schedulers"]
    calls = {
        c.args[0].value
        for c in ast.walk(engine_method)
        if isinstance(c, ast.Call)
        and isinstance(c.func, ast.Attribute)
        and c.func.attr == "collective_rpc"
        and c.args
        and isinstance(c.args[0], ast.Constant)
    }
    if method not in calls:
        return [f"Engine.{method} does not call collective_rpc({method!r})"]
    module, cls, reader = contract.rpc_methods[method]
    found = tree.methods(module, cls).get(reader) if tree.has_module(module) else None
    if found is None:
        return [f"{module}.{cls}.{reader} does not exist"]
    read = _subscript_keys(found, found.args.args[-1].arg)
    problems = [f"{cls}.{reader} reads no params[{k!r}]" for k in passed if k not in read]
    problems += [
        f"{cls}.{reader} reads params[{k!r}], which the adapter does not pass"
        for k in sorted(read - set(passed))
    ]
    return problems


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
        if method in contract.rpc_methods:
            problems += _rpc_problems(contract, tree, method, methods[method], passed)
            continue
        names, required = _parameters(methods[method])
        for kwarg in passed:
            if kwarg not in names:
                problems.append(f"Engine.{method} has no parameter {kwarg!r} (has {sorted(names)})")
        for missing in sorted(required - set(passed)):
            problems.append(
                f"Engine.{method} requires {missing!r}, which the adapter does not pass"
            )
    # The partial rollout's stop: the tokenizer manager's abort of every request.
    module, cls, method, keyword = contract.abort
    manager = tree.methods(module, cls) if tree.find_class(module, cls) is not None else {}
    if method not in manager:
        problems.append(f"{module}.{cls}.{method} does not exist")
    elif keyword not in _parameters(manager[method])[0]:
        problems.append(f"{cls}.{method} has no parameter {keyword!r}")
    # A release with weight-update sessions (0.5.23) refuses updates outside one.
    if "begin_weight_update" in methods and not contract.opens_weight_update_session:
        problems.append(
            "Engine.begin_weight_update exists: update_weights_from_tensor needs a session "
            "the contract does not open"
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
        elif not _env_readers(root, name):
            # 0.5.17 declares SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK and reads it nowhere.
            problems.append(f"sglang.srt.environ declares {name}, but nothing reads it")

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
    tokenizer_manager = tree.module("sglang.srt.managers.tokenizer_manager")
    if contract.output_ids_key not in set(_dict_keys(tokenizer_manager)):
        problems.append(f"generate() results have no {contract.output_ids_key!r}")
    if contract.output_logprobs_key not in set(_assigned_meta_info_keys(tokenizer_manager)):
        problems.append(f"generate()'s meta_info has no {contract.output_logprobs_key!r}")
    if contract.cached_tokens_key not in set(_dict_keys(tokenizer_manager)):
        problems.append(f"generate() meta_info has no {contract.cached_tokens_key!r}")
    # meta_info["input_token_logprobs"] = ... where the tokenizer manager adds log-probs.
    if contract.input_logprobs_key not in _subscript_keys(
        tree.module("sglang.srt.managers.tokenizer_manager"), "meta_info"
    ):
        problems.append(f"generate() meta_info has no {contract.input_logprobs_key!r}")

    patch_module, patch_function = contract.tensor_reduction_patch
    if not tree.has_module(patch_module) or not any(
        isinstance(n, ast.FunctionDef) and n.name == patch_function
        for n in tree.module(patch_module).body
    ):
        problems.append(f"{patch_module}.{patch_function} does not exist")
    problems += _handoff_problems(contract, tree)
    problems += _flattened_bucket_problems(contract, tree)
    problems += _direct_loader_problems(contract, tree)
    return problems


def _direct_loader_problems(contract: SGLangContract, tree: SourceTree) -> list[str]:
    """The direct hand-off: the ServerArgs field that declares custom loaders, the schedulers'
    update_weights_from_tensor matching load_format against them after unwrapping each TP
    rank's tensor, and the functions that say a scheduler's TP rank and size."""
    problems: list[str] = []
    module, rank, size = contract.tp_place
    defined = (
        {n.name for n in tree.module(module).body if isinstance(n, ast.FunctionDef)}
        if tree.has_module(module)
        else set()
    )
    problems += [f"{module}.{f} does not exist" for f in (rank, size) if f not in defined]
    if contract.direct_loader is None:
        return problems
    field, attribute = contract.direct_loader
    if field not in server_args_fields(tree):
        problems.append(f"ServerArgs has no field {field!r}")
    method = next(
        (
            n
            for n in ast.walk(tree.module(WEIGHT_UPDATER))
            if isinstance(n, ast.FunctionDef) and n.name == "update_weights_from_tensor"
        ),
        None,
    )
    attributes = (
        {n.attr for n in ast.walk(method) if isinstance(n, ast.Attribute)} if method else set()
    )
    called = {
        n.func.id
        for n in ast.walk(method or ast.Module(body=[], type_ignores=[]))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    if attribute not in attributes or "dynamic_import" not in called:
        problems.append(
            f"update_weights_from_tensor does not run a loader listed in self.{attribute}"
        )
    elif "_unwrap_tensor" not in called:
        problems.append("update_weights_from_tensor does not unwrap each TP rank's tensor")
    return problems


# Where update_weights_from_tensor runs on each TP scheduler (0.5.17 and 0.5.23).
WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
# FlattenedTensorMetadata's fields, as the adapter passes them by keyword.
FLATTENED_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


def _flattened_bucket_problems(contract: SGLangContract, tree: SourceTree) -> list[str]:
    """The flattened-bucket weight update: the metadata class (where the schedulers' unpickler
    admits it), the scheduler's branch on the load_format and the keys it reads, and the
    engine passing pre-serialized per-rank payloads through for that format."""
    if contract.flattened_bucket is None:
        return []
    module, cls, load_format = contract.flattened_bucket
    found = tree.find_class(module, cls) if tree.has_module(module) else None
    if found is None or found[0] != module:
        return [f"{module}.{cls} is not defined there"]
    fields = annotated_fields(found[1])
    lacking = [name for name in FLATTENED_METADATA_FIELDS if name not in fields]
    problems = [f"{cls} has no fields {lacking}"] if lacking else []
    unpickler_module, unpickler = contract.safe_unpickler
    allowed = tree.find_class(unpickler_module, unpickler)
    if allowed is None or not _unpickler_allows(allowed[1], module, cls):
        problems.append(
            f"{unpickler} does not allow {module}.{cls}: the schedulers would refuse it"
        )
    updater = tree.module(WEIGHT_UPDATER)
    method = next(
        (
            n
            for n in ast.walk(updater)
            if isinstance(n, ast.FunctionDef) and n.name == "update_weights_from_tensor"
        ),
        None,
    )
    if method is None or load_format not in _string_constants(method):
        return [
            *problems,
            f"update_weights_from_tensor has no load_format {load_format!r} branch",
        ]
    missing = {"flattened_tensor", "metadata"} - _subscript_keys(
        updater, "flattened_tensor_bucket_dict"
    )
    if missing:
        problems.append(f"the flattened-bucket loader reads no {sorted(missing)}")
    engine = tree.methods(contract.engine_module, contract.engine_class)
    passing = engine.get("_serialize_tensors_per_rank")
    if passing is None or load_format not in _string_constants(passing):
        problems.append(f"Engine does not pass {load_format!r} payloads through per TP rank")
    return problems


def _string_constants(node: ast.AST) -> set[str]:
    return {
        c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
    }


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
    if allowed is None or not _unpickler_allows(allowed[1], module, cls):
        problems.append(
            f"{unpickler} does not allow {module}.{cls}: the schedulers would refuse it"
        )
    return problems


def _unpickler_allows(unpickler: ast.ClassDef, module: str, cls: str) -> bool:
    """Whether the restricted unpickler admits module.cls: 0.5.23 lists (module, class) pairs
    (ALLOWED_GLOBALS), 0.5.17 module prefixes ending in '.' (ALLOWED_MODULE_PREFIXES)."""
    pairs: set[tuple[Any, ...]] = set()
    prefixes: set[str] = set()
    for node in ast.walk(unpickler):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            pairs.add(tuple(c.value for c in node.elts if isinstance(c, ast.Constant)))
        if (
            isinstance(node, ast.Assign)
            and any(
                isinstance(t, ast.Name) and t.id == "ALLOWED_MODULE_PREFIXES" for t in node.targets
            )
            and isinstance(node.value, ast.Set)
        ):
            prefixes |= {
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
    return (module, cls) in pairs or any(f"{module}.".startswith(p) for p in prefixes)


# --- tests --------------------------------------------------------------------------------------


class Release(NamedTuple):
    version: str
    root: Path
    contract: SGLangContract


@pytest.fixture(scope="module", params=SUPPORTED_SGLANG_VERSIONS)
def release(request: pytest.FixtureRequest) -> Release:
    version: str = request.param
    return Release(version, sglang_source(version), CONTRACTS[version])


def test_cached_release_is_the_version_it_is_cached_for(release: Release) -> None:
    (metadata,) = release.root.glob("sglang-*.dist-info/METADATA")
    version = re.search(r"^Version: (\S+)$", metadata.read_text(), re.MULTILINE)
    assert version is not None
    assert version.group(1) == release.version == release.contract.release


def test_adapter_contract_matches_its_release(release: Release) -> None:
    assert check_contract(release.contract, release.root) == []


def test_sglang_extra_admits_exactly_the_supported_releases() -> None:
    specifier = sglang_extra().specifier
    oldest, newest = SUPPORTED_SGLANG_VERSIONS[0], SUPPORTED_SGLANG_VERSIONS[-1]
    major_minor, first = oldest.rsplit(".", 1)
    last = int(newest.rsplit(".", 1)[1])
    # Every release from one below the oldest to one above the newest, with a post release each.
    candidates = [
        f"{major_minor}.{patch}{post}"
        for patch in range(int(first) - 1, last + 2)
        for post in ("", ".post1")
    ]
    admitted = [v for v in candidates if specifier.contains(v)]
    assert set(SUPPORTED_SGLANG_VERSIONS) <= set(admitted)
    # A post release of the oldest is admitted by `>=` but refused at run time; nothing else.
    assert set(admitted) - set(SUPPORTED_SGLANG_VERSIONS) <= {f"{oldest}.post1"}, admitted


@pytest.mark.parametrize("contract", CONTRACTS.values(), ids=CONTRACTS.keys())
def test_contract_maps_every_tag_the_engine_interface_uses(contract: SGLangContract) -> None:
    assert sorted(contract.tags.values()) == sorted(ALL_TAGS)


# Where the supported releases differ: each row is a contract read against the other release's
# source, and what that source says about it. The adapter's answer is in its own contract.
@pytest.mark.parametrize(
    ("contract_of", "source_of", "expected"),
    [
        # 0.5.17's Engine has no weight-update session (entrypoints/engine.py; its scheduler's
        # update_weights_from_tensor loads at once, managers/scheduler_components/
        # weight_updater.py:153): the 0.5.23 contract's begin/end calls do not exist there.
        (
            "0.5.23",
            "0.5.17",
            [
                "Engine.begin_weight_update does not exist",
                "Engine.end_weight_update does not exist",
                "begin_weight_update returns None, not (success, message)",
                "end_weight_update returns None, not (success, message)",
            ],
        ),
        # 0.5.23 refuses update_weights_from_tensor outside begin/end_weight_update()
        # (managers/scheduler_components/weight_updater.py:234): the 0.5.17 contract opens none.
        (
            "0.5.17",
            "0.5.23",
            [
                "Engine.begin_weight_update exists: update_weights_from_tensor needs a session "
                "the contract does not open"
            ],
        ),
    ],
)
def test_each_contract_handles_what_only_its_release_does(
    contract_of: str, source_of: str, expected: list[str]
) -> None:
    assert check_contract(CONTRACTS[contract_of], sglang_source(source_of)) == expected


def test_0_5_17_declares_a_disable_switch_that_nothing_reads() -> None:
    # srt/environ.py:346 declares SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK; only
    # SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK is read (distributed/bootstrap.py:268), as in 0.5.23.
    contract = dataclasses.replace(
        CONTRACTS["0.5.17"], env={"SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK": "true"}
    )
    assert check_contract(contract, sglang_source("0.5.17")) == [
        "sglang.srt.environ declares SGLANG_DISABLE_TP_MEMORY_INBALANCE_CHECK, but nothing reads it"
    ]


Drift = Callable[[SGLangContract], dict[str, Any]]


DIRECT_DRIFTS: list[tuple[Drift, str]] = [
    (
        lambda c: {"direct_loader": ("custom_weight_loaders", "custom_weight_loaders")},
        "ServerArgs has no field 'custom_weight_loaders'",
    ),
    (
        lambda c: {"direct_loader": ("custom_weight_loader", "weight_loaders")},
        "does not run a loader listed in self.weight_loaders",
    ),
    (
        lambda c: {"tp_place": (c.tp_place[0], "get_tp_rank", c.tp_place[2])},
        "parallel_state.get_tp_rank does not exist",
    ),
]


@pytest.mark.parametrize(
    ("drift", "expected"),
    [
        (
            lambda c: {
                "engine_methods": {**c.engine_methods, "release_memory_occupation": ("tag",)}
            },
            "Engine.release_memory_occupation has no parameter 'tag'",
        ),
        (
            lambda c: {
                "engine_methods": {**c.engine_methods, "update_weights": ("named_tensors",)}
            },
            "Engine.update_weights does not exist",
        ),
        (
            lambda c: {"engine_methods": {**c.engine_methods, "update_weights_from_tensor": ()}},
            "Engine.update_weights_from_tensor requires 'named_tensors'",
        ),
        (
            lambda c: {"server_args": (*c.server_args, "mem_fraction_statics")},
            "ServerArgs has no field 'mem_fraction_statics'",
        ),
        (
            lambda c: {"server_arg_choices": {"dtype": ("bf16",)}},
            "ServerArgs.dtype='bf16' is not in",
        ),
        (
            lambda c: {"sampling_params": ("max_tokens",)},
            "SamplingParams has no field 'max_tokens'",
        ),
        (
            lambda c: {"tags": {**c.tags, "GPU_MEMORY_TYPE_KV_CACHE": "kv-cache"}},
            "GPU_MEMORY_TYPE_KV_CACHE is 'kv_cache', the adapter uses 'kv-cache'",
        ),
        # The switch that older releases read; these rename or copy it to other names.
        (
            lambda c: {"env": {"SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK": "True"}},
            "sglang.srt.environ reads no boolean SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK",
        ),
        (lambda c: {"kv_capacity_key": "max_total_tokens"}, "init info has no 'max_total_tokens'"),
        (
            lambda c: {"output_logprobs_key": "output_logprobs"},
            "meta_info has no 'output_logprobs'",
        ),
        (
            lambda c: {
                "serializer": ("sglang.srt.utils.common", "MultiprocessingSerializer", "dumps")
            },
            "MultiprocessingSerializer.dumps does not exist",
        ),
        (
            lambda c: {"local_tensor": (*c.local_tensor[:2], "tensors")},
            "LocalSerializedTensor has no field 'tensors'",
        ),
        # Re-exported there, but the schedulers' unpickler admits it only from weight_updater.
        (
            lambda c: {
                "local_tensor": ("sglang.srt.weight_sync.utils", "LocalSerializedTensor", "values")
            },
            "sglang.srt.weight_sync.utils.LocalSerializedTensor is not defined there",
        ),
        (lambda c: {"returns_success_message": ("flush_cache",)}, "flush_cache returns"),
        (
            lambda c: {"engine_methods": {**c.engine_methods, "generate": ("input_ids", "lp")}},
            "Engine.generate has no parameter 'lp'",
        ),
        (
            lambda c: {"input_logprobs_key": "input_logprobs"},
            "meta_info has no 'input_logprobs'",
        ),
        # The schedulers read params["path"], ["pattern"] and ["max_size"]: each must be passed.
        (
            lambda c: {
                "engine_methods": {**c.engine_methods, "save_sharded_model": ("path", "pattern")}
            },
            "reads params['max_size'], which the adapter does not pass",
        ),
        (
            lambda c: {
                "engine_methods": {
                    **c.engine_methods,
                    "save_sharded_model": ("path", "pattern", "max_size", "dir"),
                }
            },
            "SchedulerWeightUpdaterManager.save_sharded_model reads no params['dir']",
        ),
        (
            lambda c: {"flattened_bucket": (*c.flattened_bucket[:2], "flat_bucket")},
            "update_weights_from_tensor has no load_format 'flat_bucket' branch",
        ),
        (
            lambda c: {
                "flattened_bucket": (
                    "sglang.srt.weight_sync.tensor_bucket",
                    "FlattenedTensorBucket",
                    "flattened_bucket",
                )
            },
            "FlattenedTensorBucket has no fields ['name', 'shape'",
        ),
        (
            lambda c: {
                "flattened_bucket": ("sglang.srt.weight_sync.utils", *c.flattened_bucket[1:])
            },
            "sglang.srt.weight_sync.utils.FlattenedTensorMetadata is not defined there",
        ),
        *DIRECT_DRIFTS,
        (
            lambda c: {"abort": (*c.abort[:3], "everything")},
            "TokenizerManager.abort_request has no parameter 'everything'",
        ),
    ],
)
def test_checker_reports_a_contract_that_drifted_from_the_release(
    release: Release, drift: Drift, expected: str
) -> None:
    drifted = dataclasses.replace(release.contract, **drift(release.contract))
    problems = check_contract(drifted, release.root)
    assert len(problems) == 1, problems
    assert expected in problems[0]


def test_the_running_phase_sigquit_handler_the_adapter_replaces_exists(release: Release) -> None:
    """rljob_worker.engines.sglang_engine replaces sglang's running-phase SIGQUIT handler (it
    kills the whole process tree, the rank included) by name: the name must be there."""
    from rljob_worker.engines.sglang_engine import RUNNING_PHASE_SIGQUIT

    module, cls, method = RUNNING_PHASE_SIGQUIT
    source = (release.root / (module.replace(".", "/") + ".py")).read_text()
    body = source[source.index(f"\nclass {cls}:") :]
    body = body[: body.find("\nclass ", 1)]
    assert f"def {method}(self, signum=None, frame=None):" in body
    assert f"signal_handler.{method}" in source  # registered on the loop from there
