"""What a rank's process runs under every driver: its RankConfig, quiet libraries, the job's
process group around run_rank. local.py starts ranks as processes, ray_driver.py as actors.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rljob.api import RLJobSpec
from rljob_worker.loop import RankConfig, RankEvent
from rljob_worker.memory import OOMInjection

ExitReport = Callable[[str | None], None]


@dataclass(frozen=True)
class RankLaunch:
    """What every rank of a job is started with, besides its RankConfig and the event queue."""

    spec_json: str
    init_method: str  # the process group's rendezvous
    threads_per_rank: int
    collective_timeout_seconds: float


def rank_configs(
    devices: Sequence[str],
    nodes: Sequence[str],
    *,
    inject_oom: OOMInjection | None,
    verify_weights: bool,
    job: str | None = None,
) -> list[RankConfig]:
    """One RankConfig per rank: rank r runs on devices[r] of host nodes[r]."""
    if len(devices) != len(nodes):
        raise ValueError(f"{len(devices)} devices for {len(nodes)} nodes: one of each per rank")
    return [
        RankConfig(
            rank=rank,
            world_size=len(devices),
            device=device,
            node=node,
            inject_oom=inject_oom,
            verify_weights=verify_weights,
            job=job,
        )
        for rank, (device, node) in enumerate(zip(devices, nodes, strict=True))
    ]


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def quiet_environment() -> None:
    """No Hugging Face progress bars or tokenizer fork warnings in the ranks' logs; set before
    transformers is imported, which reads them then."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_in_process_group(
    launch: RankLaunch,
    config: RankConfig,
    put: Callable[[RankEvent], None],
    *,
    build_model: bool = False,
    report_exit: ExitReport | None = None,
) -> None:
    """Join the job's process group, run every iteration (each event goes to `put` before the
    rank moves on, so what it measured survives its death) and leave the group.

    `build_model`: build a builtin model into this node's cache before the group exists (with
    torch.distributed initialised, transformers' save_pretrained writes only on rank 0 and
    another rank would publish a copy without weights). `report_exit`: called with None or the
    traceback before the group is destroyed (which can block on NCCL while the others wait in a
    collective), and the error is not raised; without it the error propagates.
    """
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from rljob_worker.loop import join_process_group, run_rank

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    error: str | None = None
    try:
        spec = RLJobSpec.model_validate_json(launch.spec_json)
        if build_model:
            from rljob_worker.model import resolve_model_path

            resolve_model_path(spec.model.path)
        join_process_group(
            config, launch.init_method, launch.threads_per_rank, launch.collective_timeout_seconds
        )
        run_rank(spec, config, put)
    except BaseException:  # reported to the driver, which decides; nothing is swallowed
        if report_exit is None:
            raise
        error = traceback.format_exc()
    finally:
        if report_exit is not None:
            report_exit(error)
        if dist.is_initialized():
            dist.destroy_process_group()
