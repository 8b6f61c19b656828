"""`rljob operator`: runs the kopf operator as a process, with peering so one replica acts.

Checks at startup that KubeRay's RayJob CRD is served, ensures the peering object exists, and
runs the handlers of rljob_operator.handlers cluster-wide or in the given namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import random
import sys
import time
from collections.abc import Callable

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from prometheus_client import start_http_server

from rljob_operator import metrics

PEERING_NAME = "rljob-operator"
# How long kopf waits for its watch to deliver the RLJob version its own patch produced before
# it runs the create/update handlers on an older body anyway (kopf's default: 5 s). That older
# body lacks the last-handled annotation, so kopf takes the job for new and re-runs the create
# handler: in a burst of 300 RLJobs on 2 cores the watch fell more than 5 s behind and about half
# the jobs were reconciled twice (5 more applies and a patch each: harmless, but pure load). The
# wait is asleep and ends when that version arrives, which the watch delivers before any later
# change; only a watch that never delivers it (a relist after "410 Gone") makes that one RLJob's
# next create/update handler wait this long.
CONSISTENCY_TIMEOUT_SECONDS = 60.0

log = logging.getLogger("rljob.operator")


def peering_priority(now_seconds: float | None = None) -> int:
    """A priority that is higher the earlier this replica started.

    kopf pauses an operator that sees a live peer of higher priority, and pauses *every*
    operator when two share a priority (kopf 1.45: "Pausing all operators, including self"),
    so equal priorities would mean nobody acts. With start-time priorities the oldest live
    replica acts and a newcomer starts paused (peering is mandatory, so kopf starts paused until
    it has read the peers); the random tail breaks ties between replicas started in the same
    millisecond.
    """
    started_ms = int((time.time() if now_seconds is None else now_seconds) * 1000)
    return -started_ms * 1000 + random.randint(0, 999)


def load_kube_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def kuberay_problem() -> str | None:
    """Why the operator cannot run (KubeRay's RayJob API not served), or None."""
    try:
        resources = client.CustomObjectsApi().get_api_resources("ray.io", "v1")
    except ApiException as exc:
        if exc.status == 404:
            return (
                "KubeRay's RayJob CRD (rayjobs.ray.io, v1) is not installed: install the "
                "KubeRay operator (helm chart kuberay-operator >= 1.1) first"
            )
        return f"cannot check for KubeRay's RayJob CRD: HTTP {exc.status} {exc.reason}"
    names = {r.name for r in (resources.resources if resources else [])}
    if "rayjobs" not in names:
        return "the ray.io/v1 API is served but has no rayjobs: install KubeRay >= 1.1"
    return None


# Set by the Helm chart's Deployment: the release that creates and owns the peering objects.
HELM_RELEASE_ENV = "RLJOB_HELM_RELEASE"
# How long an operator started by the chart waits for the release's peering objects.
PEERING_WAIT_SECONDS = 180.0


def ensure_peering(name: str, namespaces: list[str], wait_seconds: float | None = None) -> None:
    """Make sure the peering object(s) kopf keeps alive in exist.

    Started by the Helm chart (RLJOB_HELM_RELEASE set), the release creates them, after the
    Deployment: a pod that starts first (its image already on the node) waits for them, saying
    so, and never creates them, or `helm install` fails with "already exists" (Helm checks for
    existing objects before it creates any, so marking ours for adoption does not close the
    race). Installed by hand, get first and create what is missing.
    """
    release = os.environ.get(HELM_RELEASE_ENV, "").strip()
    if wait_seconds is None:
        wait_seconds = PEERING_WAIT_SECONDS if release else 0.0
    api = client.CustomObjectsApi()
    targets: list[tuple[Callable[[], object], Callable[[], object]]] = []
    # One KopfPeering per watched namespace, or one ClusterKopfPeering when kopf watches all.
    peers: list[str | None] = [*namespaces] if namespaces else [None]
    get: Callable[[], object]
    create: Callable[[], object]
    for ns in peers:
        kind = "ClusterKopfPeering" if ns is None else "KopfPeering"
        body = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": name}}
        group = ("kopf.dev", "v1")
        if ns is None:
            get = functools.partial(
                api.get_cluster_custom_object, *group, "clusterkopfpeerings", name
            )
            create = functools.partial(
                api.create_cluster_custom_object, *group, "clusterkopfpeerings", body
            )
        else:
            get = functools.partial(
                api.get_namespaced_custom_object, *group, ns, "kopfpeerings", name
            )
            create = functools.partial(
                api.create_namespaced_custom_object, *group, ns, "kopfpeerings", body
            )
        targets.append((get, create))
    try:
        for get, create in targets:
            try:
                get()
            except ApiException as exc:
                if exc.status != 404:
                    raise
                if wait_seconds > 0:
                    _wait_for_release_object(get, name, release, wait_seconds)
                else:
                    _ignore_conflict(create)
    except ApiException as exc:
        if exc.status == 404:
            raise SystemExit(
                "kopf's peering CRDs are missing: kubectl apply -f crds/kopf-peering.yaml "
                "(or run with --standalone for a single replica)"
            ) from exc
        if exc.status == 403:
            raise SystemExit(
                f"the operator may not read or create its peering object {name!r} "
                f"({exc.reason}): install the chart's RBAC, or create the "
                "KopfPeering/ClusterKopfPeering object yourself, or run with --standalone"
            ) from exc
        raise


def _wait_for_release_object(
    get: Callable[[], object], name: str, release: str, wait_seconds: float
) -> None:
    log.info(f"waiting up to {wait_seconds:.0f}s for Helm release {release!r} to create {name!r}")
    deadline = time.monotonic() + wait_seconds
    while time.monotonic() < deadline:
        time.sleep(2.0)
        try:
            get()
            return
        except ApiException as exc:
            if exc.status != 404:
                raise
    raise SystemExit(
        f"the peering object {name!r} of Helm release {release!r} did not appear within "
        f"{wait_seconds:.0f}s: is leaderElection.enabled in the release's values?"
    )


def _ignore_conflict(create: Callable[[], object]) -> None:
    try:
        create()
    except ApiException as exc:
        if exc.status != 409:  # created meanwhile by another replica
            raise


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: object) -> None:
    # Keep kopf's own bookkeeping in annotations only (no status.kopf field to race with the
    # status apply), and post Events for handler outcomes.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="rljob.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="rljob.dev")
    settings.posting.level = logging.WARNING
    settings.peering.stealth = True
    settings.persistence.consistency_timeout = CONSISTENCY_TIMEOUT_SECONDS


def main(argv: list[str] | None = None) -> int:
    """`rljob operator [--namespace NS ...] [--standalone] [--metrics-port PORT]`."""
    parser = argparse.ArgumentParser(prog="rljob operator", description=__doc__)
    parser.add_argument(
        "--namespace", action="append", default=[], help="watch only this namespace (repeatable)"
    )
    parser.add_argument(
        "--standalone", action="store_true", help="no peering (a single replica; dev and tests)"
    )
    parser.add_argument("--peering-name", default=PEERING_NAME)
    parser.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics on this port at /metrics (0: off)",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        load_kube_config()
    except config.ConfigException as error:
        print(
            f"rljob operator: no cluster to run against: not in a pod, and no usable kubeconfig "
            f"({error}); set KUBECONFIG to a cluster's kubeconfig",
            file=sys.stderr,
        )
        return 2
    problem = kuberay_problem()
    if problem:
        log.error(problem)
        print(f"rljob operator: {problem}", file=sys.stderr)
        return 2
    if not args.standalone:
        ensure_peering(args.peering_name, args.namespace)
    import rljob_operator.handlers  # noqa: F401  (registers the handlers)

    if args.metrics_port:
        metrics.register()
        start_http_server(args.metrics_port)
        log.info(f"serving metrics on :{args.metrics_port}/metrics")

    priority = peering_priority()
    log.info(f"starting: namespaces={args.namespace or 'all'} peering priority={priority}")
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=args.standalone,
            priority=priority,
            peering_name=None if args.standalone else args.peering_name,
            liveness_endpoint=args.liveness,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
