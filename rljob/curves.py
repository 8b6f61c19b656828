"""Learning curves: the per-iteration metrics table and the learning-curve PNG, drawn the same way
from `rljob run`'s reports and from a cluster's status.metrics (`kubectl rljob curve`).

Only rich and matplotlib: the operator side (kubectl plugin) uses it without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from rich.table import Table

from rljob.report import IterationMetrics

# The table's rows: the newest this many iterations (the PNG draws them all).
TABLE_ROWS = 20


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _turns(metrics: IterationMetrics, name: str) -> float | None:
    """A figure of the iteration's multi-turn rollout (None: a single-turn iteration)."""
    return None if metrics.multi_turn is None else float(getattr(metrics.multi_turn, name))


def _validated(metrics: IterationMetrics, name: str) -> float | None:
    """A figure of the iteration's validation (None: not validated at that iteration)."""
    figure = None if metrics.validation is None else getattr(metrics.validation, name)
    return None if figure is None else float(figure)


def metrics_table(metrics: Sequence[IterationMetrics], title: str, rows: int = TABLE_ROWS) -> Table:
    """Reward, loss, KL, entropy and response length of the newest `rows` iterations. Training
    figures are those of the update before the iteration's rollout (none at iteration 0)."""
    shown = list(metrics)[-rows:]
    if len(shown) < len(metrics):
        title += f" (the last {len(shown)} of {len(metrics)})"
    table = Table(title=title)
    columns: list[tuple[str, Callable[[IterationMetrics], str]]] = [
        ("iteration", lambda m: str(m.iteration)),
        ("reward mean", lambda m: _number(m.reward_mean, ".3f")),
        ("min..max", lambda m: f"{_number(m.reward_min, '.2f')}..{_number(m.reward_max, '.2f')}"),
        ("correct", lambda m: _number(m.correct_share, ".0%")),
        ("policy loss", lambda m: _number(m.policy_loss, ".4f")),
        ("KL", lambda m: _number(m.kl_mean, ".2e")),
        ("entropy", lambda m: _number(m.entropy_mean, ".3f")),
        ("length", lambda m: _number(m.response_length_mean, ".1f")),
        ("seconds", lambda m: _number(m.seconds, ".1f")),
    ]
    if any(m.multi_turn is not None for m in shown):  # spec.rollout.mode multiTurn
        columns[-1:-1] = [
            ("turns", lambda m: _number(_turns(m, "turns_mean"), ".2f")),
            ("tool calls", lambda m: _number(_turns(m, "tool_calls"), ".0f")),
            ("errors", lambda m: _number(_turns(m, "tool_errors"), ".0f")),
            ("timeouts", lambda m: _number(_turns(m, "tool_timeouts"), ".0f")),
            ("cut off", lambda m: _number(_turns(m, "cut_off"), ".0f")),
        ]
    if any(m.multi_turn is not None and m.multi_turn.paused for m in shown):  # partialRollout
        columns[-1:-1] = [
            ("resumed", lambda m: _number(_turns(m, "resumed"), ".0f")),
            ("paused", lambda m: _number(_turns(m, "paused"), ".0f")),
        ]
    if any(m.validation is not None for m in shown):  # spec.data.validation
        columns[-1:-1] = [
            ("val reward", lambda m: _number(_validated(m, "reward_mean"), ".3f")),
            ("val correct", lambda m: _number(_validated(m, "correct_share"), ".0%")),
        ]
    for name, _ in columns:
        table.add_column(name, justify="right")
    for entry in shown:
        table.add_row(*(cell(entry) for _, cell in columns))
    return table


def _series(
    metrics: Sequence[IterationMetrics], value: Callable[[IterationMetrics], float | None]
) -> tuple[list[int], list[float]]:
    """(iterations, values) where the value is known (no training figures at iteration 0)."""
    points = [(m.iteration, v) for m in metrics if (v := value(m)) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_learning_curve(metrics: Sequence[IterationMetrics], path: Path, title: str) -> None:
    """Four panels over the iterations: reward mean with its min..max band (and +-std) and the
    validation mean where it ran, policy loss, KL to the reference, response length (mean and max). Raises ValueError without any
    iteration's reward, as there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(m.reward_mean is not None for m in metrics):
        raise ValueError("no iteration has reported a reward yet: no learning curve to draw")
    figure, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    reward, loss, kl, length = axes.flat
    xs, means = _series(metrics, lambda m: m.reward_mean)
    band = [m for m in metrics if m.reward_min is not None and m.reward_max is not None]
    if band:
        reward.fill_between(
            [m.iteration for m in band],
            [m.reward_min or 0.0 for m in band],
            [m.reward_max or 0.0 for m in band],
            alpha=0.15,
            color="C0",
            lw=0,
            label="min..max",
        )
    spread = [m for m in band if m.reward_mean is not None and m.reward_std is not None]
    if spread:
        # mean +- std, inside min..max: rewards of 0 and 1 have a std that reaches past both.
        reward.fill_between(
            [m.iteration for m in spread],
            [max((m.reward_mean or 0.0) - (m.reward_std or 0.0), m.reward_min or 0.0)
             for m in spread],
            [min((m.reward_mean or 0.0) + (m.reward_std or 0.0), m.reward_max or 0.0)
             for m in spread],
            alpha=0.25,
            color="C0",
            lw=0,
            label="mean +- std (within min..max)",
        )  # fmt: skip
    reward.plot(xs, means, color="C0", marker=".", label="mean")
    validated = _series(metrics, lambda m: _validated(m, "reward_mean"))
    if validated[0]:  # spec.data.validation: the held-out prompts' mean, where it ran
        reward.plot(*validated, color="C4", marker="s", ls="--", label="validation mean")
    reward.set_ylabel("reward")
    reward.legend(fontsize=7, loc="upper left")
    loss.plot(*_series(metrics, lambda m: m.policy_loss), color="C1", marker=".")
    loss.set_ylabel("policy loss")
    kl.plot(*_series(metrics, lambda m: m.kl_mean), color="C2", marker=".")
    kl.set_ylabel("KL to reference")
    length.plot(*_series(metrics, lambda m: m.response_length_mean), color="C3", label="mean")
    length.plot(*_series(metrics, lambda m: m.response_length_max), color="C3", ls=":", label="max")
    length.set_ylabel("response tokens")
    # From 0, with room above the longest: a bare autoscale magnifies a few tokens' noise.
    longest = max((m.response_length_max or 0 for m in metrics), default=0)
    length.set_ylim(0, max(longest, 1) * 1.15)
    length.legend(fontsize=7, loc="upper left")
    for axis in (kl, length):
        axis.set_xlabel("iteration")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
        if not axis.has_data():  # e.g. KL with klCoef 0: say so rather than leave it blank
            axis.text(0.5, 0.5, "not reported", ha="center", transform=axis.transAxes)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def curve_title(name: str, device: str | None, seed: int | None) -> str:
    """What the curve's title names: the job, the device and the seed (the run's identity)."""
    return f"RLJob {name}: learning curve ({device or 'device unknown'}, seed {seed})"
