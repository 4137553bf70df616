"""What a learning run's summary.json must say for the run to have learned its task."""

from __future__ import annotations


def assert_reached(summary: dict, stop_return: float) -> None:
    """The learner stopped because return_mean_100, over a full window of 100 evaluation
    episodes, reached ``stop_return`` (summary.json's own figure may include a few episodes
    played while stopping)."""
    assert summary["stop_reason"].startswith("return_mean_100"), summary
    assert summary["best_return_mean_100"] >= stop_return - 0.05, summary
