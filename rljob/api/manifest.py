"""The documents around an RLJob: its manifest in (parse_manifest, load_manifest, the
name's rules) and the job config the worker is given (JobConfig, YAML).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from rljob.api._base import API_VERSION, DNS_1035_LABEL_PATTERN, KIND, CrossFieldRule, _Spec
from rljob.api.spec import RLJobSpec
from rljob.api.status import AttemptKnobs

# KubeRay names the RayCluster after the RayJob (which carries the RLJob's name) plus a suffix,
# and Services after that: it refuses RayJob names over 47 characters or not DNS-1035 labels.
MAX_NAME_LENGTH = 47
NAME_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        cel=f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        message=f"metadata.name must be at most {MAX_NAME_LENGTH} characters (KubeRay names "
        "the Ray cluster and its Services after it)",
        field_path=".metadata.name",
        check=lambda name: len(name) <= MAX_NAME_LENGTH,
    ),
    CrossFieldRule(
        cel=f"self.metadata.name.matches(r'{DNS_1035_LABEL_PATTERN}')",
        message="metadata.name must start with a letter and hold only lower-case letters, "
        "digits and '-' (a DNS-1035 label: KubeRay names a Service after it)",
        field_path=".metadata.name",
        check=lambda name: re.match(DNS_1035_LABEL_PATTERN, name) is not None,
    ),
)


def name_problems(name: str) -> list[tuple[str, str]]:
    """(field, message) for each NAME_RULES rule the RLJob's name breaks (admission checks the
    same rules at the CRD's root, so this finds something only under an older CRD)."""
    return [
        ("metadata.name", f"{r.message}; got {name!r}") for r in NAME_RULES if not r.check(name)
    ]


JOB_CONFIG_FILE = "job.yaml"


class JobConfig(_Spec):
    """What the worker is given (the ConfigMap mounted at /etc/rljob/job.yaml): the validated
    spec plus the RLJob's identity, so the driver knows whose status to write."""

    name: str = Field(min_length=1, description="The RLJob's name.")
    namespace: str = Field(min_length=1, description="The RLJob's namespace.")
    uid: str | None = Field(
        default=None,
        description="The RLJob's uid: the driver writes the status of that object only (a job "
        "deleted and applied again under its name is another object).",
    )
    spec: RLJobSpec
    attempt: int = Field(default=1, ge=1, description="The OOM policy's attempt number.")
    knobs: AttemptKnobs | None = Field(
        default=None, description="This attempt's memory knobs, where they differ from spec."
    )

    @property
    def effective_spec(self) -> RLJobSpec:
        """The spec this attempt runs: the user's, with the attempt's knobs applied."""
        return self.spec if self.knobs is None else self.knobs.apply(self.spec)

    def to_yaml(self) -> str:
        return yaml.dump(
            self.model_dump(by_alias=True, mode="json"), Dumper=_SafeDumper, sort_keys=False
        )

    @classmethod
    def from_yaml(cls, text: str) -> JobConfig:
        return cls.model_validate(yaml.load(text, Loader=_SafeLoader))


# libyaml's safe dumper and loader where PyYAML was built with it (its wheels are): the same
# text as the pure-Python ones for these documents (the golden ConfigMaps), 5-9x faster; the
# operator renders and parses a job config on every reconcile.
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_manifest(doc: dict[str, Any]) -> tuple[str, RLJobSpec]:
    """Validate an RLJob manifest (as `kubectl apply` would take it, the name's CEL rules
    included); return (name, spec)."""
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise ValueError(
            f"expected apiVersion {API_VERSION} and kind {KIND}, got "
            f"{doc.get('apiVersion')!r} / {doc.get('kind')!r}"
        )
    name = str((doc.get("metadata") or {}).get("name") or "")
    if not name:
        raise ValueError("metadata.name is required")
    problems = name_problems(name)
    if problems:
        raise ValueError("; ".join(f"{field}: {message}" for field, message in problems))
    return name, RLJobSpec.model_validate(doc.get("spec") or {})


def load_manifest(path: Path) -> tuple[str, RLJobSpec]:
    """The one RLJob of a YAML file (other documents, a Namespace say, are skipped), validated
    as parse_manifest does. Every problem, the file's included, is an OSError or a ValueError
    (pydantic's ValidationError is one) whose text names the file or the field."""
    try:
        docs = [d for d in yaml.load_all(path.read_text(), Loader=_SafeLoader) if d]
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from error
    if not all(isinstance(d, dict) for d in docs):
        raise ValueError(f"{path}: every YAML document must be a mapping (a Kubernetes object)")
    rljobs = [d for d in docs if d.get("kind") == KIND]
    if len(rljobs) == 1:
        return parse_manifest(rljobs[0])
    if not rljobs and len(docs) == 1:
        return parse_manifest(docs[0])  # says which apiVersion/kind it has instead
    raise ValueError(f"{path}: expected exactly one RLJob document, found {len(rljobs)}")
