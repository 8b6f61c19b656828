"""Unit tests of the generated CRD: the checked-in file equals the models, and it is structural.

Structural means every node has a type and there is no $ref/anyOf left (except a value of more
than one type, memFractionStatic's number-or-Auto: x-kubernetes-preserve-unknown-fields and an
anyOf of value validations without types), which the apiserver requires before it accepts
defaults and CEL rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rljob.api import RLJobSpec
from rljob_operator.crdgen import CRD_PATH, crd, crd_yaml

ROOT = Path(__file__).parents[2]


def test_checked_in_crd_equals_generated_from_models() -> None:
    checked_in = (ROOT / CRD_PATH).read_text()
    assert checked_in == crd_yaml(), (
        f"{CRD_PATH} drifted from rljob/api/; regenerate with "
        f"`python -m rljob_operator.crdgen --out {CRD_PATH}`"
    )


def _walk(node: Any, path: str) -> list[str]:
    """Paths of schema nodes that break the structural rules."""
    bad: list[str] = []
    if not isinstance(node, dict):
        return bad
    untyped = bool(node.get("x-kubernetes-preserve-unknown-fields")) and "properties" not in node
    for banned in ("$ref", "anyOf", "allOf", "oneOf", "title", "$defs", "const"):
        if banned in node and not (untyped and banned == "anyOf"):
            bad.append(f"{path}: {banned}")
    if untyped and any("type" in option for option in node.get("anyOf", [])):
        bad.append(f"{path}: a type inside anyOf")
    if "type" not in node and not untyped:
        bad.append(f"{path}: no type")
    for name, sub in node.get("properties", {}).items():
        bad += _walk(sub, f"{path}.{name}")
    if "items" in node:
        bad += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _walk(node["additionalProperties"], f"{path}{{}}")
    return bad


def _schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_schema_is_structural() -> None:
    assert _walk(_schema()["properties"]["spec"], "spec") == []
    assert _walk(_schema()["properties"]["status"], "status") == []


def test_every_spec_field_has_a_description() -> None:
    missing: list[str] = []

    def visit(node: dict[str, Any], path: str) -> None:
        for name, sub in node.get("properties", {}).items():
            if not sub.get("description"):
                missing.append(f"{path}.{name}")
            visit(sub, f"{path}.{name}")
        if "items" in node:
            visit(node["items"], f"{path}[]")

    visit(_schema()["properties"]["spec"], "spec")
    assert missing == []


def test_sections_default_to_their_filled_defaults_so_cel_rules_hold_on_them() -> None:
    # The apiserver evaluates a section's CEL rules on its default as written (no defaulting
    # inside it), so `{}` would be refused (`no such key: name`); each default is filled.
    spec = _schema()["properties"]["spec"]
    python = RLJobSpec().model_dump(by_alias=True, mode="json")
    assert spec["default"]["algorithm"]["name"] == "grpo"
    for section in ("model", "algorithm", "data", "rollout", "training", "resources"):
        default = spec["properties"][section]["default"]
        assert default and default == spec["default"][section]
        assert all(python[section][key] == value for key, value in default.items())
    assert spec["properties"]["rollout"]["properties"]["memFractionStatic"]["default"] == 0.85


def test_mem_fraction_static_is_auto_or_open_interval_zero_one() -> None:
    """A number or "Auto": no structural type fits both, and CEL cannot see an untyped field, so
    value validations that each ignore the other JSON types (the control-plane admission test
    applies them; tests/support/malformed.py holds the refusals)."""
    mfs = _schema()["properties"]["spec"]["properties"]["rollout"]["properties"][
        "memFractionStatic"
    ]
    assert mfs["x-kubernetes-preserve-unknown-fields"] is True
    auto, number = mfs["anyOf"]
    assert auto == {"enum": ["Auto"]}
    assert (number["minimum"], number["exclusiveMinimum"]) == (0, True)
    assert (number["maximum"], number["exclusiveMaximum"]) == (1, True)
    assert (number["minLength"], number["maxLength"]) == (1, 0)  # no string passes
    wake_up = _schema()["properties"]["spec"]["properties"]["rollout"]["properties"]["wakeUp"]
    assert wake_up["enum"] == ["staged", "single", "Auto"]


def test_weight_sync_bucket_is_auto_or_a_whole_number_of_mebibytes() -> None:
    """As memFractionStatic: untyped, "Auto" by enum or a number in [1, 65536] that is whole."""
    bucket = _schema()["properties"]["spec"]["properties"]["rollout"]["properties"][
        "weightSyncBucketMegabytes"
    ]
    assert bucket["x-kubernetes-preserve-unknown-fields"] is True
    assert bucket["default"] == 512
    auto, number = bucket["anyOf"]
    assert auto == {"enum": ["Auto"]}
    assert (number["minimum"], number["maximum"], number["multipleOf"]) == (1, 65536, 1)
    assert (number["minLength"], number["maxLength"]) == (1, 0)  # no string passes


def test_immutable_fields_carry_transition_rules() -> None:
    props = _schema()["properties"]["spec"]["properties"]
    immutable = [
        props["model"],
        props["rollout"]["properties"]["engine"],
        props["rollout"]["properties"]["tensorParallelSize"],
        props["resources"]["properties"]["workers"],
        props["resources"]["properties"]["gpusPerWorker"],
        props["resources"]["properties"]["cpuRanksPerWorker"],
    ]
    for node in immutable:
        assert {"self == oldSelf"} <= {r["rule"] for r in node["x-kubernetes-validations"]}
    assert "x-kubernetes-validations" not in props["suspend"]


def test_crd_has_status_subresource_short_name_and_printer_columns() -> None:
    doc = crd()
    version = doc["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert doc["spec"]["names"]["shortNames"] == ["rlj"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "Iteration": ".status.iteration",
        "Worst-Stage": ".status.worstStageFraction",
        "OOMs": ".status.oomTotal",
        "Checkpoint": ".status.checkpoint.iteration",
        "Cause": ".status.cause",
        "Age": ".metadata.creationTimestamp",
    }
    status_props = _schema()["properties"]["status"]["properties"]
    for column in columns.values():
        if column.startswith(".status."):
            assert column.removeprefix(".status.").split(".")[0] in status_props


def test_conditions_merge_by_type_under_server_side_apply() -> None:
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_crd_yaml_parses_back_to_the_same_document() -> None:
    assert yaml.safe_load(crd_yaml()) == crd()
