"""What every section of the RLJob API shares: the API's identity (group, version, kind), the
Kubernetes patterns and value types, the base model, and the rules enforced both as CEL and here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "rljob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]

# The prefix of the builtin models, prompt sources and tools the worker makes itself (no
# download; model.py, data.py, rollout.py). The worker resolves exactly these (rljob_worker.model,
# rljob_worker.task) and admission refuses any other `builtin:` name, so the two cannot disagree.
BUILTIN_PREFIX = "builtin:"

# Kubernetes quantity syntax exactly (resource.Quantity's grammar: an optionally signed decimal
# number, then one binary-SI, decimal-SI or exponent suffix). No lone dots, no repeated dots,
# no suffix soup. Also valid RE2 (the apiserver) and Rust regex (pydantic).
QUANTITY_PATTERN = (
    r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
# Names as the apiserver checks them (k8s.io/apimachinery/pkg/util/validation).
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN_PATTERN = rf"^{_DNS_LABEL}(?:\.{_DNS_LABEL})*$"
# A Service name (KubeRay names the head Service after the RayJob): starts with a letter.
DNS_1035_LABEL_PATTERN = r"^[a-z](?:[-a-z0-9]*[a-z0-9])?$"
LABEL_KEY_PATTERN = (
    rf"^(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
# A container image reference (the grammar of github.com/distribution/reference):
# [domain[:port]/]path[:tag][@digest], path components lower case.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:__|[._]|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
IMAGE_PATTERN = (
    rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
# A URL scheme (ftp://, s3://, https://): the worker reads builtin sources and files in the pod.
URL_SCHEME_PATTERN = r"^[A-Za-z][A-Za-z0-9+.-]*://"


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several fields, written once and enforced twice: as CEL by the apiserver
    (x-kubernetes-validations, at admission) and as Python by the models (`rljob run`, and the
    operator's deeper check). `field_path` is relative to the model the rule sits on."""

    cel: str
    message: str
    field_path: str
    check: Callable[[Any], bool]

    def to_k8s(self) -> dict[str, str]:
        return {
            "rule": self.cel,
            "message": self.message,
            "fieldPath": self.field_path,
            "reason": "FieldValueInvalid",
        }


@dataclass(frozen=True)
class ValueRule:
    """A rule on one field's value, written once and enforced twice: as CEL on the field itself
    (`self` is the value, so the apiserver's error names the field) and as a pydantic validator."""

    cel: str
    message: str
    check: Callable[[Any], bool]

    def to_k8s(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message, "reason": "FieldValueInvalid"}

    def validate(self, value: Any) -> Any:
        if value is not None and not self.check(value):
            raise ValueError(self.message)
        return value


def immutable(what: str) -> dict[str, Any]:
    """json_schema_extra for a field that cannot change after creation (a CEL transition rule)."""
    return {
        "x-kubernetes-validations": [
            {"rule": "self == oldSelf", "message": f"{what} is immutable after creation"}
        ]
    }


def _cel_rules(*rules: CrossFieldRule | ValueRule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.to_k8s() for r in rules]}


def _check_rules(model: BaseModel, rules: tuple[CrossFieldRule, ...], where: str) -> None:
    broken = [r for r in rules if not r.check(model)]
    if broken:
        raise ValueError("; ".join(f"{where}{r.field_path}: {r.message}" for r in broken))


def _positive_quantity(value: str) -> bool:
    # The pattern has already held (pydantic checks it first), so the value's sign and its
    # number's digits decide: every suffix multiplies by a positive factor.
    number = re.match(r"[+-]?[0-9.]*", value)
    digits = number.group() if number else ""
    return not digits.startswith("-") and any(c in "123456789" for c in digits)


POSITIVE_QUANTITY_RULE = ValueRule(
    cel="isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
    message="must be a Kubernetes quantity greater than 0 (e.g. 8, 500m, 64Gi)",
    check=_positive_quantity,
)


def _builtin_rule(what: str, known: tuple[str, ...]) -> ValueRule:
    names = ", ".join(known)
    return ValueRule(
        cel=f"!self.startsWith('{BUILTIN_PREFIX}') || self in ["
        + ", ".join(f"'{n}'" for n in known)
        + "]",
        message=f"unknown builtin {what}; the builtin {what}s are: {names}",
        check=lambda v: not v.startswith(BUILTIN_PREFIX) or v in known,
    )


def _no_url_rule(what: str) -> ValueRule:
    return ValueRule(
        cel=f"!self.matches(r'{URL_SCHEME_PATTERN}')",
        message=f"URL schemes (ftp://, s3://, https://...) are not read: {what}",
        check=lambda v: re.match(URL_SCHEME_PATTERN, v) is None,
    )


def _unique(key: Callable[[Any], str], what: str) -> Callable[[list[Any]], list[Any]]:
    """A list validator mirroring x-kubernetes-list-type map or set (the apiserver refuses repeats)."""

    def check(items: list[Any]) -> list[Any]:
        seen: set[str] = set()
        for item in items:
            if key(item) in seen:
                raise ValueError(f"{what} {key(item)!r} appears twice")
            seen.add(key(item))
        return items

    return check


def _with_rules(*rules: ValueRule) -> list[Any]:
    """Annotated metadata of a field carrying `rules`: their CEL in the CRD, their checks here."""
    return [
        Field(json_schema_extra=_cel_rules(*rules)),
        *(AfterValidator(rule.validate) for rule in rules),
    ]


# A resource quantity that must be > 0 (cpu, memory, /dev/shm).
PositiveQuantity = Annotated[
    str,
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    *_with_rules(POSITIVE_QUANTITY_RULE),
]
ImageReference = Annotated[str, Field(pattern=IMAGE_PATTERN, min_length=1, max_length=512)]
DNSSubdomain = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253)]
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, min_length=1, max_length=317)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]


class _Spec(BaseModel):
    """Base for spec sections: camelCase on the wire, snake_case in Python, unknown keys refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=False
    )


_QUANTITY_SUFFIX = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
}


def _quantity(value: str) -> Decimal:
    """A quantity's value, exactly (QUANTITY_PATTERN has held). Parsed here, not with the
    kubernetes client: the worker parses manifests too, and needs only pydantic."""
    match = re.fullmatch(
        r"(?P<number>[+-]?[0-9.]+)(?:[eE](?P<exponent>[+-]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]|))",
        value,
    )
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number = Decimal(match["number"])
    if match["exponent"] is not None:
        return number * Decimal(10) ** int(match["exponent"])
    return number * _QUANTITY_SUFFIX[match["suffix"]]
