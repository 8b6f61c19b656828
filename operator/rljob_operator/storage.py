"""Where a job's checkpoints and export land on a cluster: on a volume the pods mount, writable.

Not rules of the models (`rljob run` has no volumes: its paths are this machine's), so the
operator checks them when it reconciles (render.deeper_problems: InvalidSpec, nothing created).
A path on no volume is the container's own filesystem: what the job writes there goes with the
pod, so KubeRay's re-run after a lost pod and every OOM-policy retry start at iteration 0, and
the export is gone when KubeRay deletes the finished job's pods, while the job says Succeeded.
"""

from __future__ import annotations

from collections.abc import Callable

from rljob.api import RLJobSpec, VolumeMount

# Access modes of a claim that pods on more than one node can mount together.
SHARED_MODES = frozenset({"ReadWriteMany", "ReadOnlyMany"})


def _covering(path: str, mounts: list[VolumeMount]) -> VolumeMount | None:
    """The mount `path` lies in (the deepest one at or above it), or None."""
    found: VolumeMount | None = None
    for mount in mounts:
        root = mount.mount_path.rstrip("/") or "/"
        inside = path == root or path.startswith(root if root == "/" else root + "/")
        if inside and (found is None or len(root) > len(found.mount_path.rstrip("/"))):
            found = mount
    return found


def storage_problems(spec: RLJobSpec) -> list[tuple[str, str]]:
    """(field path, message) for checkpoint.path and export.path not on a writable volume of
    spec.volumes / spec.volumeMounts."""
    wanted = []
    if spec.checkpoint is not None:
        wanted.append(("spec.checkpoint.path", spec.checkpoint.path))
    if spec.export is not None:
        wanted.append(("spec.export.path", spec.export.path))
    volumes = {v.name: v for v in spec.volumes}
    problems = []
    for field, path in wanted:
        mount = _covering(path.rstrip("/") or "/", spec.volume_mounts)
        if mount is None:
            problems.append((field, (
                f"{path} is on no volume (no spec.volumeMounts entry at it or above it): what the "
                "job writes there goes with the pod, so a re-run or retry starts at iteration 0 "
                "and an export is lost when the job ends; mount a volume there (a "
                "persistentVolumeClaim, or an emptyDir for scratch): docs/volumes-and-env.md"
            )))  # fmt: skip
            continue
        volume = volumes.get(mount.name)
        claim = volume.persistent_volume_claim if volume is not None else None
        if mount.read_only or (claim is not None and claim.read_only):
            why = f"volumeMount {mount.name} at {mount.mount_path} is read-only"
        elif volume is not None and (volume.config_map is not None or volume.secret is not None):
            kind = "configMap" if volume.config_map is not None else "secret"
            why = f"volume {mount.name} at {mount.mount_path} is a {kind}, which is read-only"
        else:
            continue
        problems.append((field, f"{path} cannot be written: {why}; use a writable volume"))
    return problems


def claim_access_problems(
    spec: RLJobSpec, access_modes: Callable[[str], list[str] | None]
) -> list[tuple[str, str]]:
    """(claim, message) for each persistentVolumeClaim the job's pods mount that they cannot all
    mount: every pod (the Ray head, whose driver writes metrics.jsonl beside the checkpoints, and
    each worker) mounts every volume, and a ReadWriteOnce claim attaches to one node, a
    ReadWriteOncePod one to one pod. `access_modes`: the claim's spec.accessModes, or None where
    it cannot be read (not made yet: the scheduler's own Unschedulable says so)."""
    mounted = {m.name for m in spec.volume_mounts}
    pods = 1 + spec.resources.workers
    problems = []
    for volume in spec.volumes:
        claim = volume.persistent_volume_claim
        if claim is None or volume.name not in mounted:
            continue
        modes = access_modes(claim.claim_name)
        if not modes or SHARED_MODES & set(modes):
            continue
        where = f"persistentVolumeClaim {claim.claim_name} (volume {volume.name})"
        if "ReadWriteOnce" not in modes:  # ReadWriteOncePod alone
            problems.append((claim.claim_name, (
                f"{where} is ReadWriteOncePod: one pod may mount it, and the job's {pods} pods "
                "(the Ray head and each worker) all do: all but one wait in ContainerCreating. "
                "Use a ReadWriteMany claim (NFS, CephFS, a CSI file store): "
                "docs/volumes-and-env.md"
            )))  # fmt: skip
        else:
            problems.append((claim.claim_name, (
                f"{where} is ReadWriteOnce: it attaches to one node, and the job's {pods} pods "
                "(the Ray head and each worker) all mount it, so they run only if all are "
                "placed on that node; a pod on another waits in ContainerCreating (the kubelet's "
                "Multi-Attach error). Use a ReadWriteMany claim (NFS, CephFS, a CSI file store) "
                "where the pods span nodes: docs/volumes-and-env.md"
            )))  # fmt: skip
    return problems
