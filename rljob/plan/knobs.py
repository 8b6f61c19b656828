"""The spec's Auto knobs as the memory plan reads them (wakeUp, memFractionStatic,
weightSyncBucketMegabytes): whether Auto, their resolved values, and the spec with values set.
"""

from __future__ import annotations

from rljob.api import AUTO, RLJobSpec, WakeUp

# weightSyncBucketMegabytes Auto: the rollout's Auto is chosen at the smallest bucket (the
# spec's default), then the largest of the whole model in one bucket and these sizes (MiB)
# whose plan still fits under the margin's limit (auto_bucket); none fitting, the smallest.
AUTO_BUCKET_FALLBACK_MEGABYTES = 512
AUTO_BUCKET_MEGABYTES = (4096, 2048, 1024)


def rollout_is_auto(spec: RLJobSpec) -> bool:
    """Whether the rollout's mode or fraction is Auto (the candidates auto_choice compares)."""
    return AUTO in (spec.rollout.wake_up, spec.rollout.mem_fraction_static)


def is_auto(spec: RLJobSpec) -> bool:
    return rollout_is_auto(spec) or spec.rollout.weight_sync_bucket_megabytes == AUTO


def resolved_rollout(spec: RLJobSpec) -> tuple[WakeUp, float]:
    """(wakeUp, memFractionStatic) of a spec whose Auto is resolved (auto_choice)."""
    wake_up, fraction = spec.rollout.wake_up, spec.rollout.mem_fraction_static
    if rollout_is_auto(spec):
        raise ValueError(
            "rollout Auto is not resolved: plan it with auto_choice on the card first "
            "(rljob/plan/auto.py)"
        )
    assert isinstance(wake_up, WakeUp) and not isinstance(fraction, str)
    return wake_up, fraction


def bucket_megabytes(spec: RLJobSpec) -> int:
    """The spec's weight-sync bucket in MiB; under Auto not yet resolved, the smallest Auto
    tries (what the rollout's own Auto is chosen with)."""
    value = spec.rollout.weight_sync_bucket_megabytes
    return AUTO_BUCKET_FALLBACK_MEGABYTES if value == AUTO else int(value)


def resolved_bucket_bytes(spec: RLJobSpec) -> int:
    """The weight-sync bucket in bytes of a spec whose Auto is resolved (auto_choice)."""
    value = spec.rollout.weight_sync_bucket_megabytes
    if value == AUTO:
        raise ValueError(
            "weightSyncBucketMegabytes Auto is not resolved: plan it with auto_choice on the "
            "card first (rljob/plan/auto.py)"
        )
    return int(value) << 20


def _with(spec: RLJobSpec, wake_up: WakeUp, fraction: float) -> RLJobSpec:
    rollout = spec.rollout.model_copy(update={"wake_up": wake_up, "mem_fraction_static": fraction})
    return spec.model_copy(update={"rollout": rollout})


def _with_bucket(spec: RLJobSpec, megabytes: int) -> RLJobSpec:
    rollout = spec.rollout.model_copy(update={"weight_sync_bucket_megabytes": megabytes})
    return spec.model_copy(update={"rollout": rollout})
