"""A multi-agent run's figures by policy: what its metrics rows and summary.json say of each
policy beside the run's (team) figures."""

from __future__ import annotations

from typing import Any

from apex.learner.runtime import TrainingRuntime
from apex.multiagent.learner import MultiPolicyLearner


def policy_metrics(runtime: TrainingRuntime) -> dict[str, Any]:
    """The learner's metrics (each policy's under ``policies``), self-play's matches counted
    first, each policy's own returns added."""
    record_matches(runtime)
    metrics = runtime.learner.metrics()
    add_policy_returns(metrics["policies"], runtime)
    return metrics


def record_matches(runtime: TrainingRuntime) -> None:
    """Hands self-play's matches counted since the last call to the pool (its rates and rating)."""
    counters, learner = runtime.counters, runtime.learner
    with counters.lock:
        matches, counters.matches = counters.matches, []
    if isinstance(learner, MultiPolicyLearner):
        learner.record_matches(matches)


def add_policy_returns(policies: dict[str, dict[str, Any]], runtime: TrainingRuntime) -> None:
    """Adds each policy's own returns (its agents' episodes) to its figures in a metrics row."""
    counters = runtime.counters
    with counters.lock:
        for name, stats in counters.policy_stats.items():
            policies[name].update(
                {
                    "return_mean_100": stats.return_mean,
                    "train_return_mean_100": stats.train_return_mean,
                    "episodes": stats.episodes,
                }
            )


def policy_summary(runtime: TrainingRuntime) -> dict[str, dict[str, Any]]:
    """Each policy's figures for summary.json: its returns, updates and whether it trained."""
    figures: dict[str, dict[str, Any]] = {
        name: {"learner_updates": core.updates, "trained": name in runtime.ingest.targets}
        for name, core in runtime.policies.items()
    }
    counters = runtime.counters
    with counters.lock:
        for name, stats in counters.policy_stats.items():
            figures[name]["return_mean_100"] = stats.return_mean
            figures[name]["best_return_mean_100"] = stats.best_return_mean if stats.full_window else None
            figures[name]["episodes"] = stats.episodes
    return figures


def replay_size(metrics: dict[str, Any]) -> int:
    """What a learner's replay (or queue) holds, from its metrics: its policies' together in a
    multi-agent run."""
    if "policies" in metrics:
        return sum(int(figures.get("replay_size", 0)) for figures in metrics["policies"].values())
    return int(metrics.get("replay_size", 0))
