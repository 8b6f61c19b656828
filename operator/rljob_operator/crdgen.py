"""Generates the RLJob CustomResourceDefinition from the pydantic models in rljob.api.

The models are the single source of truth; this turns their JSON schema into a structural
OpenAPI v3 schema (refs inlined, nullable instead of anyOf-null, defaults for nested sections).
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import yaml
from pydantic import BaseModel

from rljob.api import (
    GROUP,
    KIND,
    NAME_RULES,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    UNTYPED_SCHEMA,
    VERSION,
    RLJobSpec,
    RLJobStatus,
)

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_PATH = "crds/rljob.dev_rljobs.yaml"

# JSON-schema keywords that carry over to OpenAPI v3 as they are.
_KEPT = {
    "type",
    "description",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "required",
    "default",
    "format",
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Iteration", "type": "integer", "jsonPath": ".status.iteration"},
    {
        "name": "Worst-Stage",
        "type": "number",
        "jsonPath": ".status.worstStageFraction",
        "description": "Highest per-stage peak memory fraction of the latest iteration.",
    },
    {"name": "OOMs", "type": "integer", "jsonPath": ".status.oomTotal"},
    {
        "name": "Checkpoint",
        "type": "integer",
        "jsonPath": ".status.checkpoint.iteration",
        "description": "Iteration of the newest complete checkpoint (docs/checkpoints.md).",
    },
    {
        "name": "Cause",
        "type": "string",
        "jsonPath": ".status.cause",
        "description": "Why the job failed or is blocked (kubectl rljob describe has every cause).",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One JSON-schema node -> one structural OpenAPI v3 node."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        # Siblings of $ref (default, description) win over the referenced schema's own.
        node = {**copy.deepcopy(target), **node}
    if "anyOf" in node:
        options = node.pop("anyOf")
        kept = [o for o in options if o.get("type") != "null"]
        nullable = len(kept) < len(options)
        if UNTYPED_SCHEMA in node:
            # A number or "Auto" (api.MemFraction): structural schemas cannot type it, so the
            # model gives its untyped schema (value validations only) to use as it is.
            untyped = node.pop(UNTYPED_SCHEMA)
            return {**{k: v for k, v in node.items() if k in ("default", "description")}, **untyped}
        kept = [defs[o["$ref"].split("/")[-1]] if "$ref" in o else o for o in kept]
        if len(kept) > 1 and all(o.get("type") == "string" for o in kept):
            # A string enum or a literal (WakeUp | Literal["Auto"]): one enum of every value.
            values = [v for o in kept for v in o.get("enum", [o.get("const")])]
            kept = [{"type": "string", "enum": values}]
        if len(kept) != 1:
            raise ValueError(f"cannot make a structural schema of a union: {options}")
        return _structural({**kept[0], **node, "_nullable": nullable}, defs)
    nullable = bool(node.pop("_nullable", False))
    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT}
    if "const" in node:
        out["enum"] = [node["const"]]
    # Draft 2020 exclusive bounds are numbers; OpenAPI v3 (as Kubernetes reads it) uses booleans.
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node:
            out[plain] = node[bound]
            out[bound] = True
    if "properties" in node:
        out["properties"] = {name: _property(sub, defs) for name, sub in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if "patternProperties" in node:
        # A map with constrained keys (dict[LabelKey, ...]): pydantic gives the key pattern as
        # patternProperties and the key's lengths as propertyNames. OpenAPI v3 has neither, so
        # the values become additionalProperties and the keys' rule becomes CEL.
        ((pattern, values),) = node["patternProperties"].items()
        out["type"] = "object"
        out["additionalProperties"] = _structural(values, defs)
        longest = node.get("propertyNames", {})["maxLength"]
        out.setdefault("x-kubernetes-validations", []).append(_key_rule(pattern, longest))
    if "items" in node:
        out["items"] = _structural(node["items"], defs)
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
    if out.get("default") is None:
        out.pop("default", None)
    if nullable:
        out["nullable"] = True
    return out


def _key_rule(pattern: str, longest: int) -> dict[str, str]:
    """The CEL rule for a map's keys."""
    return {
        "rule": f"self.all(k, k.size() <= {longest} && k.matches(r'{pattern}'))",
        "message": f"every key must match {pattern} (at most {longest} characters)",
        "reason": "FieldValueInvalid",
    }


def _property(sub: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    prop = _structural(sub, defs)
    # A section with its own defaults (default_factory=Model in pydantic) defaults to {} so the
    # apiserver fills its fields; a user who omits `rollout` gets the same spec pydantic builds.
    if prop.get("type") == "object" and "properties" in prop and not prop.get("nullable"):
        prop.setdefault("default", filled_default(prop))
    return prop


def filled_default(node: dict[str, Any]) -> dict[str, Any]:
    """The default of an object section with its fields' defaults filled in. The apiserver
    checks a default against the section's CEL rules as it is, without defaulting inside it,
    so `{}` would fail a rule such as `self.name != 'grpo' || ...` (no such key)."""
    return {
        name: copy.deepcopy(sub["default"])
        for name, sub in node.get("properties", {}).items()
        if "default" in sub
    }


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one model (camelCase, as on the wire)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def crd() -> dict[str, Any]:
    """The RLJob CustomResourceDefinition as a dict."""
    spec = openapi_schema(RLJobSpec)
    spec["default"] = filled_default(spec)
    status = openapi_schema(RLJobStatus)
    root = {
        "type": "object",
        "description": "RLJob: a colocated RL job (FSDP training and a rollout engine sharing "
        "the GPUs with staged wake-up), run as a KubeRay RayJob.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        # CEL at the root may read metadata.name (and only name and generateName).
        "x-kubernetes-validations": [
            {"rule": r.cel, "message": r.message, "reason": "FieldValueInvalid"} for r in NAME_RULES
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["rljob"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as the YAML checked in at crds/rljob.dev_rljobs.yaml."""
    header = "# Generated by `rljob crd` from rljob/api/. Do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def emit(text: str, out: str | None, prog: str) -> int:
    """Print generated text, or write it to `out`; 2 with the reason when the file cannot be
    written (a generator's command line: `rljob crd`, `rljob spec-doc`)."""
    if not out:
        sys.stdout.write(text)
        return 0
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """`rljob crd [--out PATH]`: print (or write) the generated CRD."""
    parser = argparse.ArgumentParser(prog="rljob crd", description=main.__doc__)
    parser.add_argument("--out", help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    return emit(crd_yaml(), args.out, "rljob crd")


if __name__ == "__main__":
    sys.exit(main())
