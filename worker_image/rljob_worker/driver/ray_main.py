"""The RayJob's entrypoint: `python -m rljob_worker.driver.ray_main --config /etc/rljob/job.yaml`.

Reads the job config the operator rendered into the ConfigMap, connects to the job's Ray cluster,
runs the ranks with the Ray driver and ends with the driver-owned status block as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rljob.api import JobConfig, driver_failed_line

if TYPE_CHECKING:  # Ray is imported only once a config was read (so --help stays quick)
    from rljob_worker.driver.ray_driver import RayRun

log = logging.getLogger("rljob_worker.driver")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rljob driver",
        description="Run an RLJob's ranks as Ray actors on the connected Ray cluster "
        "(the RayJob's entrypoint).",
    )
    parser.add_argument(
        "--config", type=Path, required=True, help="job config (the mounted ConfigMap's job.yaml)"
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", "auto"),
        help="Ray cluster address (default: $RAY_ADDRESS, which a RayJob sets; else 'auto')",
    )
    parser.add_argument(
        "--status-out", type=Path, help="also write the final result (status block) as JSON here"
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=None,
        help="after one rank failed, how long the others get before they are killed",
    )
    parser.add_argument(
        "--verify-weights",
        action="store_true",
        help="after every weight update, check each engine weight equals the training tensor",
    )
    parser.add_argument(
        "--publish",
        action=argparse.BooleanOptionalAction,
        default="KUBERNETES_SERVICE_HOST" in os.environ,
        help="write the driver's part of the RLJob's status and its Events (default: on inside "
        "a Kubernetes pod)",
    )
    return parser


def result_document(run: RayRun, job: JobConfig) -> dict[str, Any]:
    """The driver's final word: ok, the failure reason, and the driver-owned RLJob status block
    (exactly driver_status, camelCase as in the RLJob)."""
    return {
        "job": {"name": job.name, "namespace": job.namespace},
        "ok": run.ok,
        "reason": run.reason,
        "status": run.status().model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def main(argv: list[str] | None = None) -> int:
    """`rljob driver`; returns the exit code: 0 succeeded, 1 the job failed, 2 bad config."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        job = JobConfig.from_yaml(args.config.read_text())
    except (OSError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        print(f"rljob driver: {args.config}: {error}", file=sys.stderr)
        return 2
    import ray

    from rljob_worker.driver.failure import plain
    from rljob_worker.driver.ray_driver import GRACE_SECONDS, run_ray

    log.info(
        "RLJob %s/%s: %d rank(s), engine %s, wakeUp %s, %d iteration(s); Ray at %s",
        job.namespace,
        job.name,
        job.effective_spec.world_size,
        job.effective_spec.rollout.engine,
        job.effective_spec.rollout.wake_up,
        job.effective_spec.algorithm.iterations,
        args.address,
    )
    try:
        ray.init(address=args.address, namespace="rljob", log_to_driver=True)
    except ConnectionError as error:
        # A failed job's last line, which the operator's Failed message is made of (KubeRay's
        # message ends with the job log's tail), not a bare one it would not find.
        why = f"no Ray cluster at {args.address}: {plain(str(error))[:500]}"
        print(driver_failed_line(job.name, why), file=sys.stderr)
        return 1
    listener = None
    if args.publish:
        # In the RayJob's head pod this authenticates as the per-job ServiceAccount, whose Role
        # allows patching this one RLJob's status and creating Events, nothing else.
        from rljob_worker.publish import PublishingListener, StatusPublisher

        listener = PublishingListener(
            StatusPublisher.from_env_or_kubeconfig(
                job.namespace, job.name, uid=job.uid, attempt=job.attempt
            ),
            job.effective_spec.world_size,
        )
    try:
        run = run_ray(
            job.effective_spec,
            job=job.name,
            job_uid=job.uid,
            on_event=listener,
            verify_weights=args.verify_weights,
            grace_seconds=GRACE_SECONDS if args.grace_seconds is None else args.grace_seconds,
        )
    except Exception as error:  # a Ray failure no rank accounts for: still a failed job's line
        log.exception("the driver failed")
        why = f"the driver: {type(error).__name__}: {plain(str(error))[:500]}"
        print(driver_failed_line(job.name, why), file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
        if listener is not None:
            listener.flush()
    document = result_document(run, job)
    text = json.dumps(document, indent=2)
    print(text)
    if args.status_out is not None:
        args.status_out.parent.mkdir(parents=True, exist_ok=True)
        args.status_out.write_text(text + "\n")
    if not run.ok:
        # The job log's last line: Ray's job message (shown in the RayJob status) ends with it.
        print(driver_failed_line(job.name, str(run.reason)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exit_:  # argparse's usage error
        code = exit_.code if isinstance(exit_.code, int) else 2
    except BaseException:  # printed, then the same quick exit below
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written (status, the result document, the last line). Interpreter shutdown
    # can spin in Ray's or gRPC's native threads after a node was lost (seen on kind: the driver
    # at 100% CPU after its last line, without a Python frame, the Ray job RUNNING for minutes
    # after a worker pod was deleted, so KubeRay never retried it): leave at once.
    os._exit(code)
