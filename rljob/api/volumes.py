"""spec.volumes, spec.volumeMounts, spec.env, spec.envFrom: storage and environment of the Ray
containers, and the names and paths the operator keeps for itself.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import AfterValidator, Field, model_validator

from rljob.api._base import (
    _DNS_LABEL,
    CrossFieldRule,
    DNSSubdomain,
    PositiveQuantity,
    ValueRule,
    _cel_rules,
    _check_rules,
    _Spec,
    _unique,
    _with_rules,
)

# Kubernetes' own shapes (issue 30), cut down to the volume sources rljob supports; names and
# paths the operator uses itself are refused, so a user's never silently replaces one.

# What the operator mounts and sets in every Ray container itself (rljob_operator.render).
JOB_CONFIG_DIR = "/etc/rljob"
JOB_CONFIG_VOLUME = "job-config"
SHM_DIR = "/dev/shm"
SHM_VOLUME = "dshm"
RAY_MEMORY_MONITOR_ENV = "RAY_memory_monitor_refresh_ms"
SGL_TP_IMBALANCE_ENV = "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK"
SGLANG_TP_IMBALANCE_ENV = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"
OPERATOR_VOLUMES: dict[str, str] = {
    JOB_CONFIG_VOLUME: f"the job config, mounted at {JOB_CONFIG_DIR}",
    SHM_VOLUME: f"{SHM_DIR}, sized by spec.resources.sharedMemory",
}
OPERATOR_MOUNT_PATHS: dict[str, str] = {
    JOB_CONFIG_DIR: f"the job config (volume {JOB_CONFIG_VOLUME})",
    SHM_DIR: f"shared memory for NCCL and Ray (volume {SHM_VOLUME})",
}
OPERATOR_ENV: dict[str, str] = {
    RAY_MEMORY_MONITOR_ENV: "0: Ray's memory monitor off, so a host OOM is the kernel's OOMKilled",
    SGL_TP_IMBALANCE_ENV: "with tensorParallelSize > 1",
    SGLANG_TP_IMBALANCE_ENV: "with tensorParallelSize > 1",
}
SUPPORTED_VOLUME_SOURCES: tuple[str, ...] = (
    "persistentVolumeClaim",
    "configMap",
    "secret",
    "emptyDir",
    "hostPath",
)

# An absolute path without empty components; a path relative to a volume (subPath, items[].path)
# the same without the leading '/'. '.' and '..' components are refused by a rule, so a clash
# with the operator's paths cannot hide behind /etc/./rljob.
ABSOLUTE_PATH_PATTERN = r"^/(?:[^/]+/?)*$"
RELATIVE_PATH_PATTERN = r"^[^/]+(?:/[^/]+)*$"
_DOT_COMPONENT = r"(^|/)\.\.?(/|$)"
NO_DOT_COMPONENTS_RULE = ValueRule(
    cel=f"!self.matches(r'{_DOT_COMPONENT}')",
    message="a path here may not have '.' or '..' components",
    check=lambda v: re.search(_DOT_COMPONENT, v) is None,
)
# Environment variable names as Kubernetes has long checked them (a C identifier, plus '-' and
# '.'); a ConfigMap or Secret key.
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


def _not_operator_volume(name: str, what: str) -> ValueRule:
    return ValueRule(
        cel=f"self != '{name}'",
        message=f"volume name {name} is the operator's own volume ({what}); "
        "give your volume another name",
        check=lambda v: v != name,
    )


def _not_operator_path(path: str, what: str) -> ValueRule:
    return ValueRule(
        cel=f"self != '{path}' && !self.startsWith('{path}/')",
        message=f"mountPath {path} (and anything under it) is where the operator mounts {what}; "
        "mount your volume elsewhere",
        check=lambda v: v != path and not v.startswith(f"{path}/"),
    )


def _not_operator_env(name: str, why: str) -> ValueRule:
    return ValueRule(
        cel=f"self != '{name}'",
        message=f"env {name} is set by the operator ({why}); remove it from spec.env",
        check=lambda v: v != name,
    )


VolumeName = Annotated[
    str,
    Field(pattern=rf"^{_DNS_LABEL}$", min_length=1, max_length=63),
    *_with_rules(*(_not_operator_volume(n, w) for n, w in OPERATOR_VOLUMES.items())),
]
MountPath = Annotated[
    str,
    Field(pattern=ABSOLUTE_PATH_PATTERN, min_length=1, max_length=1024),
    *_with_rules(
        NO_DOT_COMPONENTS_RULE, *(_not_operator_path(p, w) for p, w in OPERATOR_MOUNT_PATHS.items())
    ),
]
HostPath = Annotated[
    str,
    Field(pattern=ABSOLUTE_PATH_PATTERN, min_length=1, max_length=1024),
    *_with_rules(NO_DOT_COMPONENTS_RULE),
]
RelativePath = Annotated[
    str,
    Field(pattern=RELATIVE_PATH_PATTERN, min_length=1, max_length=1024),
    *_with_rules(NO_DOT_COMPONENTS_RULE),
]
EnvName = Annotated[
    str,
    Field(pattern=ENV_NAME_PATTERN, min_length=1, max_length=256),
    *_with_rules(*(_not_operator_env(n, w) for n, w in OPERATOR_ENV.items())),
]
ConfigKey = Annotated[str, Field(pattern=CONFIG_KEY_PATTERN, min_length=1, max_length=253)]
FileMode = Annotated[int, Field(ge=0, le=0o777)]


def _exactly_one(what: str, fields: tuple[str, ...], context: str) -> CrossFieldRule:
    """A rule that exactly one of `fields` (camelCase, as on the wire) is set."""
    snake = tuple(re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), f) for f in fields)
    return CrossFieldRule(
        cel="[" + ", ".join(f"has(self.{f})" for f in fields) + "].exists_one(s, s)",
        message=f"{what} sets exactly one of " + ", ".join(fields) + context,
        field_path="",
        check=lambda m: sum(getattr(m, f) is not None for f in snake) == 1,
    )


class _Ruled(_Spec):
    """A section whose CrossFieldRules (`rules`, CEL on the CRD) the model checks as well;
    `where` names the section in the message."""

    rules: ClassVar[tuple[CrossFieldRule, ...]] = ()
    where: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.model_config = {**cls.model_config, "json_schema_extra": _cel_rules(*cls.rules)}

    @model_validator(mode="after")
    def _cross_field(self) -> Self:
        _check_rules(self, self.rules, self.where)
        return self


class KeyToPath(_Spec):
    """One key of a ConfigMap or Secret projected as a file (Kubernetes KeyToPath)."""

    key: ConfigKey = Field(description="The key in the ConfigMap or Secret.")
    path: RelativePath = Field(description="File path relative to the mount point.")
    mode: FileMode | None = Field(default=None, description="File mode bits (0 to 0777).")


class PersistentVolumeClaimSource(_Spec):
    """A PersistentVolumeClaim in the RLJob's namespace (checkpoints, data, models)."""

    claim_name: DNSSubdomain = Field(description="The claim's name.")
    read_only: bool | None = Field(default=None, description="Mount the claim read-only.")


class _KeysAsFiles(_Spec):
    """What a ConfigMap volume and a Secret volume share: which keys, as which files."""

    items: list[KeyToPath] | None = Field(
        default=None,
        max_length=64,
        description="Only these keys, each at its path (default: every key, named by key).",
    )
    default_mode: FileMode | None = Field(
        default=None, description="Mode bits of the files (0 to 0777; default 0644)."
    )
    optional: bool | None = Field(default=None, description="Start without it if it is missing.")


class ConfigMapVolumeSource(_KeysAsFiles):
    """A ConfigMap's keys as files (a reward function, a small prompt file)."""

    name: DNSSubdomain = Field(description="The ConfigMap's name.")


class SecretVolumeSource(_KeysAsFiles):
    """A Secret's keys as files (credentials a library reads from a file)."""

    secret_name: DNSSubdomain = Field(description="The Secret's name.")


class EmptyDirVolumeSource(_Spec):
    """Scratch space that lives as long as the pod."""

    medium: Literal["", "Memory"] | None = Field(
        default=None, description="'' (node disk) or Memory (tmpfs, counts against memory)."
    )
    size_limit: PositiveQuantity | None = Field(
        default=None, description="The most it may hold (e.g. 20Gi); the pod is evicted beyond."
    )


class HostPathVolumeSource(_Spec):
    """A node's directory or file (a node-local model cache, say); the node's to keep."""

    path: HostPath = Field(description="Absolute path on the node.")
    type: (
        Literal[
            "",
            "DirectoryOrCreate",
            "Directory",
            "FileOrCreate",
            "File",
            "Socket",
            "CharDevice",
            "BlockDevice",
        ]
        | None
    ) = Field(default=None, description="What must be at path ('' checks nothing).")


VOLUME_SOURCE_RULE = _exactly_one(
    "a volume",
    SUPPORTED_VOLUME_SOURCES,
    " (the supported sources; docs/volumes-and-env.md)",
)


class Volume(_Ruled):
    """A Kubernetes Volume of the Ray pods, with one of the supported sources."""

    rules = (VOLUME_SOURCE_RULE,)
    where = "spec.volumes[]"

    name: VolumeName = Field(description="The name volumeMounts refer to (a DNS label).")
    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    config_map: ConfigMapVolumeSource | None = None
    secret: SecretVolumeSource | None = None
    empty_dir: EmptyDirVolumeSource | None = None
    host_path: HostPathVolumeSource | None = None


class VolumeMount(_Spec):
    """Where a volume of spec.volumes appears in the Ray containers (head and workers)."""

    name: VolumeName = Field(description="A volume of spec.volumes.")
    mount_path: MountPath = Field(
        description=f"Absolute path in the container; not {JOB_CONFIG_DIR} or {SHM_DIR} "
        "(the operator's) nor anything under them."
    )
    sub_path: RelativePath | None = Field(
        default=None, description="A path inside the volume to mount instead of its root."
    )
    read_only: bool | None = Field(default=None, description="Mount read-only.")


class KeySelector(_Spec):
    """One key of a Secret or ConfigMap in the RLJob's namespace."""

    name: DNSSubdomain = Field(description="The Secret's or ConfigMap's name.")
    key: ConfigKey = Field(description="The key whose value the variable takes.")
    optional: bool | None = Field(
        default=None, description="Leave the variable unset if the key is missing."
    )


ENV_VALUE_SOURCE_RULE = _exactly_one(
    "valueFrom", ("secretKeyRef", "configMapKeyRef"), " (the supported sources)"
)


class EnvVarSource(_Ruled):
    """Where an env var's value comes from, so a secret never appears in the manifest."""

    rules = (ENV_VALUE_SOURCE_RULE,)
    where = "spec.env[].valueFrom"

    secret_key_ref: KeySelector | None = None
    config_map_key_ref: KeySelector | None = None


ENV_ONE_VALUE_RULE = CrossFieldRule(
    cel="!has(self.value) || !has(self.valueFrom)",
    message="an env var has value or valueFrom, not both",
    field_path=".valueFrom",
    check=lambda e: e.value is None or e.value_from is None,
)


class EnvVar(_Ruled):
    """An environment variable of the Ray containers: a literal value or one from a Secret or
    ConfigMap key ($(NAME) references expand as Kubernetes expands them)."""

    rules = (ENV_ONE_VALUE_RULE,)
    where = "spec.env[]"

    name: EnvName = Field(description="The variable's name.")
    value: str | None = Field(
        default=None, max_length=32768, description="A literal value (never a secret)."
    )
    value_from: EnvVarSource | None = None


class LocalObjectRef(_Spec):
    """A Secret or ConfigMap in the RLJob's namespace, all of whose keys become env vars."""

    name: DNSSubdomain = Field(description="The Secret's or ConfigMap's name.")
    optional: bool | None = Field(default=None, description="Start without it if it is missing.")


ENV_FROM_SOURCE_RULE = _exactly_one("envFrom", ("secretRef", "configMapRef"), "")


class EnvFromSource(_Ruled):
    """Every key of a Secret or ConfigMap as an env var (env wins over envFrom on a name, so
    the operator's own variables cannot be replaced this way)."""

    rules = (ENV_FROM_SOURCE_RULE,)
    where = "spec.envFrom[]"

    prefix: Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=64)] | None = Field(
        default=None, description="Prepended to every key's name."
    )
    secret_ref: LocalObjectRef | None = None
    config_map_ref: LocalObjectRef | None = None


def _map_list(key: str) -> dict[str, Any]:
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}


Volumes = Annotated[
    list[Volume],
    Field(max_length=64, json_schema_extra=_map_list("name")),
    AfterValidator(_unique(lambda v: v.name, "volume name")),
]
VolumeMounts = Annotated[
    list[VolumeMount],
    Field(max_length=64, json_schema_extra=_map_list("mountPath")),
    AfterValidator(_unique(lambda m: m.mount_path, "mountPath")),
]
EnvVars = Annotated[
    list[EnvVar],
    Field(max_length=256, json_schema_extra=_map_list("name")),
    AfterValidator(_unique(lambda e: e.name, "env name")),
]

MOUNTS_NAME_VOLUMES_RULE = CrossFieldRule(
    cel="self.volumeMounts.all(m, self.volumes.exists(v, v.name == m.name))",
    message="every volumeMounts[].name must be the name of a volume in spec.volumes",
    field_path=".volumeMounts",
    check=lambda s: {m.name for m in s.volume_mounts} <= {v.name for v in s.volumes},
)
