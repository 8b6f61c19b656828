"""The operator's few API calls: server-side apply of children and of status, and reads.

One field manager for everything the operator writes, so repeated applies are no-ops and
the driver's status fields (its own field manager) are never clobbered.
"""

from __future__ import annotations

import datetime
import functools
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from rljob.api import API_VERSION, GROUP, KIND, PLURAL, VERSION, status_apply_body
from rljob_operator import causes
from rljob_operator.status import ApplyFailure

FIELD_MANAGER = "rljob-operator"
APPLY = "application/apply-patch+yaml"
# Statuses worth retrying: conflicts, throttling, apiserver trouble.
TRANSIENT = {409, 429, 500, 502, 503, 504}
# Retries of a failed apply wait 5 s, 10 s, 20 s... up to 5 minutes.
FIRST_RETRY_SECONDS, LAST_RETRY_SECONDS = 5.0, 300.0
# Every call below passes _preload_content=False and parses the answer's JSON itself: the
# generated client otherwise builds a typed model (V1ConfigMap, V1Role...) that the operator only
# turned back into a dict, and it types only the 200 of a patch, so the 201 of an apply that
# creates came back as None.


_SHARED: client.ApiClient | None = None
_SHARED_GUARD = threading.Lock()


def _api() -> client.ApiClient:
    """The process's one ApiClient, made on first use (after the kube config is loaded).

    The generated APIs' default, a fresh ApiClient per call, opens a new TCP+TLS connection for
    every request; shared, its urllib3 pool (thread-safe) keeps connections to the apiserver.
    bench/operator_load.py measured the handshakes at ~40% of the operator's CPU under load.
    """
    global _SHARED
    with _SHARED_GUARD:
        if _SHARED is None:
            _SHARED = client.ApiClient()
        return _SHARED


@functools.cache
def _custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(_api())


@functools.cache
def _core() -> client.CoreV1Api:
    return client.CoreV1Api(_api())


@functools.cache
def _builtin_calls(kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The generated client's (patch, read) calls for a built-in kind: fn(name, namespace, ...)."""
    core, rbac = _core(), client.RbacAuthorizationV1Api(_api())
    table: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
        "ServiceAccount": (
            core.patch_namespaced_service_account,
            core.read_namespaced_service_account,
        ),
        "ConfigMap": (core.patch_namespaced_config_map, core.read_namespaced_config_map),
        "Role": (rbac.patch_namespaced_role, rbac.read_namespaced_role),
        "RoleBinding": (rbac.patch_namespaced_role_binding, rbac.read_namespaced_role_binding),
    }
    return table[kind]


def _json(response: Any) -> dict[str, Any]:
    """A raw (not preloaded) answer's body as a dict."""
    body: dict[str, Any] = json.loads(response.data)
    return body


def apply(obj: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply one manifest; returns the object as stored."""
    meta = obj["metadata"]
    kwargs: dict[str, Any] = {
        "field_manager": FIELD_MANAGER, "force": True, "_content_type": APPLY,
        "_preload_content": False,
    }  # fmt: skip
    if obj["kind"] == "RayJob":
        group, version = obj["apiVersion"].split("/")
        response = _custom().patch_namespaced_custom_object(
            group, version, meta["namespace"], "rayjobs", meta["name"], obj, **kwargs
        )
    else:
        patch = _builtin_calls(obj["kind"])[0]
        response = patch(meta["name"], meta["namespace"], obj, **kwargs)
    return _json(response)


def apply_status(namespace: str, name: str, status: dict[str, Any], uid: str | None = None) -> None:
    """Server-side apply the operator's status fields on the status subresource (with `uid`:
    only while the RLJob of that name is still that object, api.status_apply_body)."""
    body = status_apply_body(namespace, name, status, uid)
    response: Any = _custom().patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, body,
        field_manager=FIELD_MANAGER, force=True, _content_type=APPLY, _preload_content=False,
    )  # fmt: skip
    response.drain_conn()  # the answer is not needed; read to the end, the connection is reused


def get_rljob(namespace: str, name: str) -> dict[str, Any] | None:
    return _get(lambda: _custom().get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, _preload_content=False))  # fmt: skip


def get_rayjob(namespace: str, name: str) -> dict[str, Any] | None:
    return _get(lambda: _custom().get_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", name, _preload_content=False))  # fmt: skip


def get_config_map(namespace: str, name: str) -> dict[str, Any] | None:
    return _get(lambda: _core().read_namespaced_config_map(name, namespace, _preload_content=False))


def claim_access_modes(namespace: str, claim: str) -> list[str] | None:
    """A persistentVolumeClaim's spec.accessModes, or None where it does not exist (yet)."""
    found = _get(lambda: _core().read_namespaced_persistent_volume_claim(
        claim, namespace, _preload_content=False))  # fmt: skip
    if found is None:
        return None
    return [str(mode) for mode in (found.get("spec") or {}).get("accessModes") or []]


def _warning_event(
    rljob: Mapping[str, Any], name: str, reason: str, message: str, count: int,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A core/v1 Warning Event on the RLJob under a name of the operator's choosing."""
    meta = rljob["metadata"]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    metadata: dict[str, Any] = {"name": name, "namespace": meta["namespace"]}
    if annotations is not None:
        metadata["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1", "kind": "Event", "metadata": metadata,
        "involvedObject": {
            "apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
            "namespace": meta["namespace"], "uid": meta["uid"],
        },
        "reason": reason, "message": message, "type": "Warning", "count": count,
        "firstTimestamp": now, "lastTimestamp": now,
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
    }  # fmt: skip


def post_event_once(rljob: Mapping[str, Any], name: str, reason: str, message: str) -> bool:
    """A Warning Event on the RLJob under a name of its own (one per job uid and subject): the
    first post makes it, a later one (the next reconcile, an operator restart) finds it and
    posts nothing. True where this call made it."""
    body: Any = _warning_event(rljob, name, reason, message, 1)  # the client takes the dict
    try:
        _core().create_namespaced_event(
            rljob["metadata"]["namespace"], body, _preload_content=False
        )
    except ApiException as exc:
        if exc.status != 409:
            raise
        return False
    return True


def get_child(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """A child of the kind render.children() makes (RayJob or a built-in kind), or None."""
    if kind == "RayJob":
        return get_rayjob(namespace, name)
    read = _builtin_calls(kind)[1]
    return _get(lambda: read(name, namespace, _preload_content=False))


def _get(call: Callable[[], Any]) -> dict[str, Any] | None:
    """The object, or None when it does not exist."""
    try:
        response = call()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return _json(response)


def as_kopf_error(exc: Exception, what: str) -> kopf.TemporaryError | kopf.PermanentError:
    """Translate an API failure into kopf's retry (transient) or stop (the request is wrong)."""
    if isinstance(exc, HTTPError):
        return kopf.TemporaryError(f"{what}: API unreachable ({exc})", delay=5)
    if isinstance(exc, ApiException):
        if exc.status in TRANSIENT:
            return kopf.TemporaryError(f"{what}: HTTP {exc.status} {exc.reason}", delay=5)
        if exc.status in (401, 403):
            # RBAC may be fixed by an admin; keep trying, slowly.
            return kopf.TemporaryError(f"{what}: forbidden ({exc.reason})", delay=60)
        return kopf.PermanentError(f"{what}: HTTP {exc.status}: {_api_message(exc)}")
    return kopf.TemporaryError(f"{what}: {exc}", delay=10)


def retry_delay(retry: int) -> float:
    """Backoff before retry number `retry` (0 first): doubling from 5 s, at most 5 minutes."""
    return min(FIRST_RETRY_SECONDS * 2 ** min(retry, 16), LAST_RETRY_SECONDS)


def apply_failure(child: Mapping[str, Any], exc: Exception, retry: int) -> ApplyFailure:
    """What a failed apply of `child` means: refused for good, or retried after a backoff.

    Refused for good: a 4xx that the same request would get again (invalid, bad request, not
    found...). Retried: 5xx, conflicts, throttling, the API unreachable, and 401/403 (RBAC or a
    quota an admin may still change)."""
    kind, name = str(child["kind"]), str(child["metadata"]["name"])
    if isinstance(exc, ApiException) and exc.status is not None:
        message = f"HTTP {exc.status}: {_api_message(exc)}"
        if 400 <= exc.status < 500 and exc.status not in TRANSIENT | {401, 403}:
            return ApplyFailure(kind, name, message)
    else:
        message = f"API unreachable ({exc})"
    return ApplyFailure(kind, name, message, retry_in_seconds=retry_delay(retry))


def post_cause_event(
    rljob: Mapping[str, Any], name: str, reason: str, line: str, sources: tuple[str, ...]
) -> int | None:
    """A Warning Event on the RLJob under a stable `name`, counting the objects a cause hit:
    created the first time; then, for `sources` (new to this process) it has not counted yet
    (causes.counted), its count, message and lastTimestamp updated (the kubelet's way of
    aggregating repeats). The count it wrote, or None where the Event had counted every source
    already."""
    namespace = rljob["metadata"]["namespace"]
    count, listed = causes.counted(None, 0, sources) or (0, [])
    body: Any = _warning_event(
        rljob, name, reason, causes.event_message(line, count), count,
        {causes.SOURCES_ANNOTATION: json.dumps(listed)},
    )  # fmt: skip
    try:
        _core().create_namespaced_event(namespace, body, _preload_content=False)
        return count
    except ApiException as exc:
        if exc.status != 409:
            raise
    stored = _json(_core().read_namespaced_event(name, namespace, _preload_content=False))
    try:
        previous = list(json.loads(stored["metadata"]["annotations"][causes.SOURCES_ANNOTATION]))
    except (KeyError, TypeError, ValueError):
        previous = []  # an Event from before the annotation: count on from its count
    merged = causes.counted(previous, int(stored.get("count") or 1), sources)
    if merged is None:
        return None
    count, listed = merged
    update = {
        # resourceVersion: a write that raced this one is a 409, and the caller retracts the
        # announcement, so the job's next event tries again
        "metadata": {"resourceVersion": stored["metadata"]["resourceVersion"],
                     "annotations": {causes.SOURCES_ANNOTATION: json.dumps(listed)}},
        "count": count, "message": causes.event_message(line, count),
        "lastTimestamp": body["lastTimestamp"],
    }  # fmt: skip
    _core().patch_namespaced_event(name, namespace, update, _preload_content=False)
    return count


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)
