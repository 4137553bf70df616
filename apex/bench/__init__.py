"""`apex bench`: throughput benchmarks that print tables and can write one JSON report.

Each benchmark module has ``run(seconds) -> dict``: it prints its own table and returns its
figures, units in the key names, with the baseline it was compared against in the same run.
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

from apex.errors import ApexError
from apex.system.files import write_atomic

# Benchmark name -> its module in apex.bench (each with ``run(**options) -> dict``). Imported
# only when run: building the command line must not import torch, zmq and gymnasium.
BENCHMARKS: tuple[str, ...] = (
    "sumtree",
    "replay",
    "codec",
    "transport",
    "ingest",
    "checkpoint",
    "learner",
    "e2e",
    "soak",
    "flood",
    "learn",
    "serve",
)
# Not part of `all`: minutes long (to hours for learn), a check (pass/fail) or learning more
# than a throughput figure.
LONG = ("soak", "flood", "learn", "serve")


def run(
    names: list[str],
    json_path: str | None = None,
    seconds: float | None = None,
    e2e_options: dict[str, Any] | None = None,
    soak_options: dict[str, Any] | None = None,
    learn_options: dict[str, Any] | None = None,
    serve_options: dict[str, Any] | None = None,
    learner_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs the named benchmarks (``all`` for every one); writes the JSON report if asked.

    ``seconds``: time per measured operation (each benchmark's own default when None);
    ``e2e_options``: algo, env, actors and plot for the e2e benchmark; ``soak_options``:
    actors, churn_s, overrides and plot for the soak; ``learn_options``: tasks, algos, seeds,
    minutes and plot for learn; ``serve_options``: seeds and tasks for serve; ``learner_options``: ranks
    for learner. Raises ApexError (after writing the
    report) if a benchmark that checks something (the soak) failed.
    """
    # (bench imports this package to name its choices: what running them needs, only when they run)
    from apex.bench.timing import machine_info
    from apex.system.malloc import keep_large_blocks

    selected = [n for n in BENCHMARKS if n not in LONG] if "all" in names else names
    keep_large_blocks()  # as the learner does: large decoded arrays stay off fresh mmap pages
    machine = machine_info()
    report = {}
    for name in selected:
        started = time.perf_counter()
        kwargs = {} if seconds is None else {"seconds": seconds}
        if name == "e2e":
            kwargs.update(e2e_options or {})
        if name == "soak":
            kwargs.update(soak_options or {})
        if name == "learn":
            kwargs.update(learn_options or {})
        if name == "serve":
            kwargs.update(serve_options or {})
        if name == "learner":
            kwargs.update(learner_options or {})
        result = importlib.import_module(f"apex.bench.{name}").run(**kwargs)
        result["machine"] = machine
        result["wall_seconds"] = round(time.perf_counter() - started, 1)
        report[name] = result
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (json.dumps(report, indent=2) + "\n").encode()
        write_atomic(path, lambda f: f.write(text))
        print(f"\nwrote {path}")
    failed = [f"{name}: {'; '.join(r['problems'])}" for name, r in report.items() if r.get("passed") is False]
    if failed:
        raise ApexError(" | ".join(failed))
    return report
