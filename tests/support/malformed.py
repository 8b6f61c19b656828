"""Malformed RLJobs, each with the field its rejection must name: one table for both layers.

The unit layer checks that the models refuse each spec (what `rljob run` and the operator see);
the control-plane layer checks that `kubectl apply` is refused by the generated CRD's schema and
CEL rules. One table is what keeps the two checks from drifting apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Malformed:
    id: str
    spec: dict[str, Any]
    field: str  # the field path the rejection names
    name: str = ""  # metadata.name; empty: the id
    seen: bool = False  # one of issue 17's "Seen" cases

    @property
    def job_name(self) -> str:
        return self.name or self.id


def _res(**fields: Any) -> dict[str, Any]:
    return {"resources": fields}


def _pull(image: str) -> dict[str, Any]:
    return _res(image=image)


def _mount(mount: dict[str, Any], volume: dict[str, Any] | None = None) -> dict[str, Any]:
    """A spec with one volume (an emptyDir named data, unless given) and one mount of it."""
    return {
        "volumes": [volume or {"name": "data", "emptyDir": {}}],
        "volumeMounts": [{"name": "data", **mount}],
    }


def _env(*env: dict[str, Any]) -> dict[str, Any]:
    return {"env": list(env)}


def _shape(**fields: Any) -> dict[str, Any]:
    """spec.model.shape: a valid small decoder's fields, then `fields` over them."""
    return {"numHiddenLayers": 2, "hiddenSize": 64, "intermediateSize": 128,
            "numAttentionHeads": 4, "numKeyValueHeads": 2, "vocabSize": 320, **fields}  # fmt: skip


_HF_TOKEN = {"secretKeyRef": {"name": "hf-token", "key": "token"}}


MALFORMED: list[Malformed] = [
    # Issue 17, "Seen": accepted before, and each could never run.
    Malformed("memory-negative", _res(memory="-4Gi"), "spec.resources.memory", seen=True),
    Malformed("memory-zero", _res(memory="0"), "spec.resources.memory", seen=True),
    Malformed("cpu-lone-dot", _res(cpu="."), "spec.resources.cpu", seen=True),
    Malformed("cpu-two-dots", _res(cpu="1.2.3"), "spec.resources.cpu", seen=True),
    Malformed("shm-negative", _res(sharedMemory="-1Gi"), "spec.resources.sharedMemory", seen=True),
    Malformed("fs-group-negative", _res(fsGroup=-1), "spec.resources.fsGroup"),
    Malformed("fs-group-lowercase-none", _res(fsGroup="none"), "spec.resources.fsGroup"),
    Malformed(
        "image-space", _pull("ghcr.io/rljob/worker 0.1.0"), "spec.resources.image", seen=True
    ),
    Malformed(
        "image-newline", _pull("ghcr.io/rljob/worker:0.1.0\n"), "spec.resources.image", seen=True
    ),
    Malformed(
        "priority-class-not-a-name",
        _res(priorityClassName="Not_A_Name!"),
        "spec.resources.priorityClassName",
        seen=True,
    ),
    Malformed(
        "model-builtin-unknown", {"model": {"path": "builtin:gpt-17"}}, "spec.model.path", seen=True
    ),
    Malformed(
        "data-builtin-unknown",
        {"data": {"source": "builtin:poetry"}},
        "spec.data.source",
        seen=True,
    ),
    Malformed(
        "data-ftp",
        {"data": {"source": "ftp://example.com/prompts.jsonl"}},
        "spec.data.source",
        seen=True,
    ),
    Malformed("name-too-long", {}, "metadata.name", name="n" * 48, seen=True),
    # More of our own.
    Malformed(
        "warmup-past-the-end",
        {"algorithm": {"iterations": 3, "warmupIterations": 4}},
        "spec.algorithm.warmupIterations",
    ),
    Malformed(
        "min-rate-without-cosine",
        {"algorithm": {"minLearningRateRatio": 0.1}},
        "spec.algorithm.minLearningRateRatio",
    ),
    Malformed(
        "validation-ftp",
        {"data": {"validation": {"source": "ftp://example.com/test.jsonl"}}},
        "spec.data.validation.source",
    ),
    Malformed(
        "validation-greedy-samples",
        {"data": {"validation": {"source": "builtin:digit", "samplesPerPrompt": 4}}},
        "spec.data.validation.samplesPerPrompt",
    ),
    Malformed(
        "validation-every-zero",
        {"data": {"validation": {"source": "builtin:digit", "everyIterations": 0}}},
        "spec.data.validation.everyIterations",
    ),
    Malformed("memory-gb-suffix", _res(memory="64GB"), "spec.resources.memory"),
    Malformed("memory-no-number", _res(memory="Gi"), "spec.resources.memory"),
    Malformed("memory-double-suffix", _res(memory="1GiKi"), "spec.resources.memory"),
    Malformed("head-memory-zero-gi", _res(headMemory="0Gi"), "spec.resources.headMemory"),
    Malformed("head-cpu-negative", _res(headCpu="-1"), "spec.resources.headCpu"),
    Malformed("cpu-dangling-exponent", _res(cpu="1e"), "spec.resources.cpu"),
    Malformed("cpu-trailing-space", _res(cpu="8 "), "spec.resources.cpu"),
    Malformed("cpu-zero-millis", _res(cpu="0m"), "spec.resources.cpu"),
    Malformed(
        "shm-larger-than-memory",
        _res(memory="16Gi", sharedMemory="32Gi"),
        "spec.resources.sharedMemory",
    ),
    Malformed("image-empty", _pull(""), "spec.resources.image"),
    Malformed("image-upper-case-path", _pull("ghcr.io/RLJob/worker:1"), "spec.resources.image"),
    Malformed("image-empty-tag", _pull("ghcr.io/rljob/worker:"), "spec.resources.image"),
    Malformed(
        "image-short-digest", _pull("ghcr.io/rljob/worker@sha256:abc"), "spec.resources.image"
    ),
    Malformed("image-empty-component", _pull("ghcr.io//worker"), "spec.resources.image"),
    Malformed(
        "priority-class-leading-dash",
        _res(priorityClassName="-high"),
        "spec.resources.priorityClassName",
    ),
    Malformed(
        "priority-class-upper-case",
        _res(priorityClassName="High"),
        "spec.resources.priorityClassName",
    ),
    Malformed(
        "priority-class-too-long",
        _res(priorityClassName="p" * 254),
        "spec.resources.priorityClassName",
    ),
    Malformed(
        "node-selector-bad-key",
        _res(nodeSelector={"gpu type": "h100"}),
        "spec.resources.nodeSelector",
    ),
    Malformed(
        "node-selector-bad-value",
        _res(nodeSelector={"gpu": "h100 sxm"}),
        "spec.resources.nodeSelector",
    ),
    Malformed(
        "toleration-bad-key",
        _res(tolerations=[{"key": "a/b/c", "operator": "Exists"}]),
        "spec.resources.tolerations[0].key",
    ),
    Malformed(
        "toleration-bad-value",
        _res(tolerations=[{"key": "gpu", "value": "yes please"}]),
        "spec.resources.tolerations[0].value",
    ),
    Malformed("model-s3", {"model": {"path": "s3://bucket/qwen"}}, "spec.model.path"),
    Malformed(
        "shape-heads-not-dividing-hidden",
        {"model": {"path": "Qwen/Qwen3-4B", "shape": _shape(numAttentionHeads=24)}},
        "spec.model.shape.numAttentionHeads",
    ),
    Malformed(
        "shape-bias-without-type",
        {"model": {"path": "meta-llama/Llama-3.1-8B", "shape": _shape(attentionBias=True)}},
        "spec.model.shape.attentionBias",
    ),
    Malformed(
        "shape-type-unknown",
        {"model": {"path": "google/gemma-2-2b", "shape": _shape(modelType="gemma2")}},
        "spec.model.shape.modelType",
    ),
    Malformed("model-builtin-empty", {"model": {"path": "builtin:"}}, "spec.model.path"),
    Malformed(
        "data-https",
        {"data": {"source": "https://example.com/prompts.jsonl"}},
        "spec.data.source",
    ),
    Malformed(
        "data-builtin-wrong-case", {"data": {"source": "builtin:Arithmetic"}}, "spec.data.source"
    ),
    # Issue 29: the user's data keys and reward function.
    Malformed("prompt-key-empty", {"data": {"promptKey": ""}}, "spec.data.promptKey"),
    Malformed(
        "answer-key-empty-part", {"data": {"answerKey": "reward_model."}}, "spec.data.answerKey"
    ),
    Malformed(
        "chat-template-unknown", {"data": {"chatTemplate": "Always"}}, "spec.data.chatTemplate"
    ),
    Malformed("overflow-unknown", {"data": {"promptOverflow": "Drop"}}, "spec.data.promptOverflow"),
    Malformed(
        "reward-without-colon",
        {"reward": {"function": "my_rewards.compute_score"}},
        "spec.reward.function",
    ),
    Malformed(
        "reward-parallel-calls-zero", {"reward": {"parallelCalls": 0}}, "spec.reward.parallelCalls"
    ),
    Malformed(
        "reward-builtin-unknown", {"reward": {"function": "exactmatch"}}, "spec.reward.function"
    ),
    Malformed(
        "reward-no-callable", {"reward": {"function": "/data/reward.py:"}}, "spec.reward.function"
    ),
    Malformed(
        "reward-callable-not-a-name",
        {"reward": {"function": "reward.py:score-v2"}},
        "spec.reward.function",
    ),
    Malformed(
        "reward-timeout-negative", {"reward": {"timeoutSeconds": -1}}, "spec.reward.timeoutSeconds"
    ),
    Malformed(
        "reward-timeout-zero", {"reward": {"timeoutSeconds": 0}}, "spec.reward.timeoutSeconds"
    ),
    Malformed("reward-on-error-unknown", {"reward": {"onError": "Retry"}}, "spec.reward.onError"),
    Malformed("startup-timeout-zero", {"startupTimeoutSeconds": 0}, "spec.startupTimeoutSeconds"),
    Malformed(
        "startup-timeout-negative", {"startupTimeoutSeconds": -5}, "spec.startupTimeoutSeconds"
    ),
    # Issue 29: the trainer's log-probs are those of the untruncated softmax(logits / T).
    Malformed(
        "sampling-top-p", {"rollout": {"sampling": {"topP": 0.9}}}, "spec.rollout.sampling.topP"
    ),
    Malformed(
        "sampling-top-k", {"rollout": {"sampling": {"topK": 20}}}, "spec.rollout.sampling.topP"
    ),
    Malformed(
        "sampling-greedy",
        {"rollout": {"sampling": {"temperature": 0}}},
        "spec.rollout.sampling.temperature",
    ),
    Malformed("ppo-epochs-zero", {"algorithm": {"ppoEpochs": 0}}, "spec.algorithm.ppoEpochs"),
    Malformed("tis-cap-zero", {"algorithm": {"tisCap": 0}}, "spec.algorithm.tisCap"),
    # Issue 30: the user's volumes, mounts and env; the operator's own names and paths refused.
    Malformed(
        "volume-named-job-config",
        {"volumes": [{"name": "job-config", "emptyDir": {}}]},
        "spec.volumes[0].name",
    ),
    Malformed(
        "volume-named-dshm",
        {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]},
        "spec.volumes[0].name",
    ),
    Malformed("mount-at-job-config", _mount({"mountPath": "/etc/rljob"}), "spec.volumeMounts[0]"),
    Malformed("mount-under-dev-shm", _mount({"mountPath": "/dev/shm/x"}), "spec.volumeMounts[0]"),
    Malformed("mount-dot-path", _mount({"mountPath": "/etc/./rljob"}), "spec.volumeMounts[0]"),
    Malformed("mount-relative-path", _mount({"mountPath": "data"}), "spec.volumeMounts[0]"),
    Malformed(
        "mount-sub-path-escapes",
        _mount({"mountPath": "/data", "subPath": "../etc"}),
        "spec.volumeMounts[0].subPath",
    ),
    Malformed(
        "mount-of-undeclared-volume",
        {"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
        "spec.volumeMounts",
    ),
    Malformed(
        "volume-two-sources",
        {
            "volumes": [
                {"name": "data", "emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}
            ]
        },
        "spec.volumes[0]",
    ),
    Malformed("volume-no-source", {"volumes": [{"name": "data"}]}, "spec.volumes[0]"),
    Malformed(
        "volume-name-not-a-label",
        {"volumes": [{"name": "my.data", "emptyDir": {}}]},
        "spec.volumes[0].name",
    ),
    Malformed(
        "host-path-relative",
        {"volumes": [{"name": "cache", "hostPath": {"path": "models"}}]},
        "spec.volumes[0].hostPath.path",
    ),
    Malformed(
        "volume-names-repeated",
        {"volumes": [{"name": "d", "emptyDir": {}}, {"name": "d", "secret": {"secretName": "s"}}]},
        "spec.volumes",
    ),
    Malformed(
        "env-operator-memory-monitor",
        _env({"name": "RAY_memory_monitor_refresh_ms", "value": "250"}),
        "spec.env[0].name",
    ),
    Malformed(
        "env-operator-sglang-tp",
        _env({"name": "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "value": "true"}),
        "spec.env[0].name",
    ),
    Malformed(
        "env-value-and-value-from",
        _env({"name": "HF_TOKEN", "value": "hf_x", "valueFrom": _HF_TOKEN}),
        "spec.env[0]",
    ),
    Malformed(
        "env-value-from-two-sources",
        _env(
            {
                "name": "HF_TOKEN",
                "valueFrom": {**_HF_TOKEN, "configMapKeyRef": {"name": "c", "key": "k"}},
            }
        ),
        "spec.env[0].valueFrom",
    ),
    Malformed("env-name-with-equals", _env({"name": "A=B", "value": "1"}), "spec.env[0].name"),
    Malformed(
        "env-names-repeated",
        _env({"name": "A", "value": "1"}, {"name": "A", "value": "2"}),
        "spec.env",
    ),
    Malformed(
        "env-from-two-sources",
        {"envFrom": [{"secretRef": {"name": "s"}, "configMapRef": {"name": "c"}}]},
        "spec.envFrom[0]",
    ),
    # Issue 35: rollout Auto is spelled exactly; a fraction stays in (0, 1).
    Malformed(
        "fraction-auto-lower-case",
        {"rollout": {"memFractionStatic": "auto"}},
        "spec.rollout.memFractionStatic",
    ),
    Malformed(
        "fraction-one", {"rollout": {"memFractionStatic": 1.0}}, "spec.rollout.memFractionStatic"
    ),
    Malformed(
        "fraction-list", {"rollout": {"memFractionStatic": [0.9]}}, "spec.rollout.memFractionStatic"
    ),
    Malformed("wake-up-automatic", {"rollout": {"wakeUp": "automatic"}}, "spec.rollout.wakeUp"),
    # The weight-sync bucket: a whole number of MiB in [1, 65536], or Auto spelled exactly.
    Malformed(
        "bucket-auto-lower-case",
        {"rollout": {"weightSyncBucketMegabytes": "auto"}},
        "spec.rollout.weightSyncBucketMegabytes",
    ),
    Malformed(
        "bucket-fractional",
        {"rollout": {"weightSyncBucketMegabytes": 1.5}},
        "spec.rollout.weightSyncBucketMegabytes",
    ),
    Malformed(
        "bucket-true",
        {"rollout": {"weightSyncBucketMegabytes": True}},
        "spec.rollout.weightSyncBucketMegabytes",
    ),
    Malformed(
        "bucket-text-number",
        {"rollout": {"weightSyncBucketMegabytes": "512"}},
        "spec.rollout.weightSyncBucketMegabytes",
    ),
    Malformed(
        "fraction-true", {"rollout": {"memFractionStatic": True}}, "spec.rollout.memFractionStatic"
    ),
    Malformed(
        "fraction-text-number",
        {"rollout": {"memFractionStatic": "0.5"}},
        "spec.rollout.memFractionStatic",
    ),
    Malformed(
        "bucket-too-large",
        {"rollout": {"weightSyncBucketMegabytes": 65537}},
        "spec.rollout.weightSyncBucketMegabytes",
    ),
    Malformed("margin-half", {"memoryPlan": {"margin": 0.5}}, "spec.memoryPlan.margin"),
    Malformed("name-starts-with-digit", {}, "metadata.name", name="1job"),
    Malformed("name-with-dots", {}, "metadata.name", name="job.v2"),
    # Issue 32: multi-turn settings, tools and budgets.
    Malformed(
        "multi-turn-without-mode",
        {"rollout": {"engine": "torch", "multiTurn": {"maxTurns": 2}}},
        "spec.rollout.multiTurn",
    ),
    Malformed(
        "multi-turn-unknown-builtin-tool",
        {"rollout": {"mode": "multiTurn", "multiTurn": {"tools": ["builtin:search"]}}},
        "spec.rollout.multiTurn.tools[0]",
    ),
    Malformed(
        "multi-turn-tool-twice",
        {
            "rollout": {
                "mode": "multiTurn",
                "multiTurn": {
                    "tools": ["builtin:calculator", "builtin:python", "builtin:calculator"]
                },
            }
        },
        "spec.rollout.multiTurn.tools",
    ),
    Malformed(
        "multi-turn-tool-without-callable",
        {"rollout": {"mode": "multiTurn", "multiTurn": {"tools": ["my_tools.py"]}}},
        "spec.rollout.multiTurn.tools[0]",
    ),
    Malformed(
        "multi-turn-tool-response-over-budget",
        {
            "rollout": {
                "mode": "multiTurn",
                "multiTurn": {"maxResponseLength": 64, "maxToolResponseLength": 64},
            }
        },
        "spec.rollout.multiTurn.maxToolResponseLength",
    ),
    Malformed(
        "partial-rollout-turn-by-turn",
        {
            "rollout": {
                "mode": "multiTurn",
                "multiTurn": {"schedule": "turnByTurn", "partialRollout": {"overSample": 0.5}},
            }
        },
        "spec.rollout.multiTurn.partialRollout",
    ),
    Malformed(
        "partial-rollout-no-over-sample",
        {"rollout": {"mode": "multiTurn", "multiTurn": {"partialRollout": {"overSample": 0}}}},
        "spec.rollout.multiTurn.partialRollout.overSample",
    ),
    Malformed(
        "multi-turn-zero-turns",
        {"rollout": {"mode": "multiTurn", "multiTurn": {"maxTurns": 0}}},
        "spec.rollout.multiTurn.maxTurns",
    ),
    Malformed(
        "multi-turn-tensor-parallel",
        {"rollout": {"mode": "multiTurn", "tensorParallelSize": 2}},
        "spec.rollout.mode",
    ),
    Malformed(
        "multi-turn-without-chat-template",
        {"rollout": {"mode": "multiTurn"}, "data": {"chatTemplate": "None"}},
        "spec.data.chatTemplate",
    ),
    Malformed("rollout-mode-unknown", {"rollout": {"mode": "agentic"}}, "spec.rollout.mode"),
    Malformed(
        "multi-turn-schedule-unknown",
        {"rollout": {"mode": "multiTurn", "multiTurn": {"schedule": "sync"}}},
        "spec.rollout.multiTurn.schedule",
    ),
    # Decidable from the spec, and refused only by the worker (GPUs held) before these rules.
    Malformed(
        "torch-engine-tensor-parallel",
        {"rollout": {"engine": "torch", "tensorParallelSize": 2}, **_res(gpusPerWorker=2)},
        "spec.rollout.tensorParallelSize",
    ),
    Malformed(
        "train-batch-not-a-multiple-of-ranks",
        {"data": {"trainBatchSize": 6}, **_res(workers=2, gpusPerWorker=2)},
        "spec.data.trainBatchSize",
    ),
    Malformed(
        "train-batch-not-a-multiple-of-cpu-ranks",
        {"data": {"trainBatchSize": 5}, **_res(gpusPerWorker=0, cpuRanksPerWorker=2)},
        "spec.data.trainBatchSize",
    ),
    Malformed(
        "ppo-mini-batches-over-responses-per-rank",
        {
            "algorithm": {"groupSize": 2, "ppoMiniBatches": 5},
            "data": {"trainBatchSize": 4},
            **_res(gpusPerWorker=2),
        },
        "spec.algorithm.ppoMiniBatches",
    ),
    Malformed(
        "export-at-checkpoint-path",
        {"checkpoint": {"path": "/data/ckpt"}, "export": {"path": "/data/ckpt/"}},
        "spec.export.path",
    ),
    Malformed(
        "export-above-checkpoint-path",
        {"checkpoint": {"path": "/data/run/ckpt"}, "export": {"path": "/data/run"}},
        "spec.export.path",
    ),
    # Spelled so the strings differ where pathlib opens the same directory: refused by shape.
    Malformed(
        "export-at-checkpoint-path-with-an-empty-component",
        {"checkpoint": {"path": "/data/ckpt"}, "export": {"path": "/data//ckpt"}},
        "spec.export.path",
    ),
    Malformed(
        "export-at-checkpoint-path-with-a-dot-component",
        {"checkpoint": {"path": "/data/ckpt"}, "export": {"path": "/data/ckpt/."}},
        "spec.export.path",
    ),
    Malformed(
        "checkpoint-path-with-a-dot-dot-component",
        {"checkpoint": {"path": "/data/export/../ckpt"}},
        "spec.checkpoint.path",
    ),
]
