"""The figures and the verdict of `apex bench flood` (``apex.bench.flood``): a phase's row
from the learner's metrics, each phase against the unloaded baseline, the table and the
report."""

from __future__ import annotations

from typing import Any

from apex.bench.flooder import CONTROL_GARBAGE, CONTROL_PEERS, HELLO, TRAJECTORY_GARBAGE, TRAJECTORY_PEERS
from apex.bench.timing import print_table

MIN_RATIO = 0.5
SIGTERM_LIMIT_S = 2.0  # "the learner acts on SIGTERM within 2 s under any flood"
PEERS = {
    HELLO: f"{CONTROL_PEERS} control",
    CONTROL_GARBAGE: f"{CONTROL_PEERS} control",
    TRAJECTORY_GARBAGE: f"{TRAJECTORY_PEERS} trajectory",
}
RATES = (("updates_per_s", "updates_ratio"), ("env_steps_per_s", "env_steps_ratio"))


def _rate(first: dict[str, Any], last: dict[str, Any], key: str) -> float | None:
    elapsed = last.get("time", 0) - first.get("time", 0)
    if elapsed <= 0:
        return None
    rate: float = (last.get(key, 0) - first.get(key, 0)) / elapsed
    return rate


def phase_row(
    name: str,
    kinds: tuple[str, ...],
    before: dict[str, Any],
    first: dict[str, Any],
    last: dict[str, Any],
    cpu: list[float],
    rss: float | None,
    sent: dict[str, Any] | None,
) -> dict[str, Any]:
    """A phase's figures: ``before`` its start, ``first`` and ``last`` the metrics rows that
    bound its measured part; ``cpu`` the CPU % of learner, actor (and flooder); ``sent``
    what the flooder says it sent."""
    reasons_before = before.get("rejected_by_reason", {})
    reasons = {
        reason: count - reasons_before.get(reason, 0)
        for reason, count in last.get("rejected_by_reason", {}).items()
        if count - reasons_before.get(reason, 0) > 0
    }
    updates, steps = _rate(first, last, "learner_updates"), _rate(first, last, "env_steps")
    flood_s = (sent or {}).get("seconds") or 0
    return {
        "phase": name,
        "flooders": ", ".join(f"{PEERS[k]} {k.replace('_', ' ')}" for k in kinds) or "none",
        "measured_s": round(last.get("time", 0) - first.get("time", 0), 2),
        "updates_per_s": None if updates is None else round(updates, 1),
        "env_steps_per_s": None if steps is None else round(steps, 1),
        "rejected_messages": last.get("rejected_messages", 0) - before.get("rejected_messages", 0),
        "rejected_by_reason": reasons,
        "flood_messages_sent": (sent or {}).get("sent", 0),
        "flood_msgs_per_s": round((sent or {}).get("sent", 0) / flood_s) if flood_s else 0,
        "flood_replies_received": (sent or {}).get("replies", 0),
        "learner_cpu_percent": round(cpu[0]),
        "actor_cpu_percent": round(cpu[1]),
        "flooder_cpu_percent": round(cpu[2]) if len(cpu) > 2 else 0,
        "learner_rss_mb": None if rss is None else round(rss, 1),
        "actors_connected": last.get("actors_connected"),
    }


def report(
    rows: list[dict[str, Any]],
    seconds: float,
    pinning: str,
    sigterm: dict[str, Any],
    learner_exit: int | None,
    skip_s: float,
    overrides: tuple[str, ...],
) -> dict[str, Any]:
    """Judges the phases (adding their ratios to the baseline to ``rows``), prints the table
    and the verdict, returns the report."""
    unloaded = [r for r in rows if r["flooders"] == "none"]
    base = {key: _mean([r[key] for r in unloaded]) for key, _ in RATES}
    problems = _judge_phases(rows, base)
    problems += _judge_run(base, sigterm, learner_exit)
    first, again = unloaded[0]["updates_per_s"], unloaded[-1]["updates_per_s"]
    drift = 100 * (again / first - 1) if len(unloaded) > 1 and first and again is not None else None
    _print_table(rows, seconds, pinning, skip_s)
    _print_verdict(len(unloaded), base, drift, sigterm, learner_exit, problems)
    return {
        "baseline": "the unloaded phases (mean of the one before and the one after the single attacks)",
        "seconds": seconds,
        "skip_s": skip_s,
        "pinning": pinning,
        "overrides": list(overrides),
        "min_ratio": MIN_RATIO,
        "unloaded_updates_per_s": None if base["updates_per_s"] is None else round(base["updates_per_s"], 1),
        "unloaded_env_steps_per_s": None if base["env_steps_per_s"] is None else round(base["env_steps_per_s"], 1),
        "unloaded_drift_percent": None if drift is None else round(drift, 1),
        "results": rows,
        "sigterm_exit_s": sigterm.get("learner"),
        "sigterm_summary_s": sigterm.get("summary"),
        "sigterm_actor_exit_s": sigterm.get("actor"),
        "sigterm_limit_s": SIGTERM_LIMIT_S,
        "learner_exit": learner_exit,
        "passed": not problems,
        "problems": problems,
    }


def _judge_phases(rows: list[dict[str, Any]], base: dict[str, float | None]) -> list[str]:
    """Adds each phase's ratios to the baseline and whether it passed; returns the problems
    of the attack phases."""
    problems: list[str] = []
    for row in rows:
        attacked = row["flooders"] != "none"
        for key, ratio_key in RATES:
            ok = bool(base[key]) and row[key] is not None
            row[ratio_key] = round(row[key] / base[key], 3) if ok else None
            if attacked and (row[ratio_key] is None or row[ratio_key] < MIN_RATIO):
                problems.append(
                    f"{row['phase']}: {key} {row[key]} is {_percent(row[ratio_key])} of the unloaded "
                    f"{base[key]:.1f} (at least {MIN_RATIO:.0%} required)"
                )
        if attacked and row["rejected_messages"] == 0:
            problems.append(f"{row['phase']}: no message refused; the flood did not reach the learner")
        row["passed"] = not attacked or not any(p.startswith(row["phase"] + ":") for p in problems)
    return problems


def _judge_run(base: dict[str, float | None], sigterm: dict[str, Any], learner_exit: int | None) -> list[str]:
    """The problems of the run as a whole: no baseline, a slow or failed exit on SIGTERM."""
    problems = []
    if not base["updates_per_s"] or not base["env_steps_per_s"]:
        problems.append("the unloaded run made no update or no env step: nothing to compare with")
    sigterm_exit_s = sigterm.get("learner")
    if sigterm_exit_s is None:
        problems.append("the learner did not exit within 60 s of SIGTERM under the full flood")
    elif sigterm_exit_s > SIGTERM_LIMIT_S:
        problems.append(
            f"the learner took {sigterm_exit_s:.2f} s from SIGTERM to its exit under the full flood "
            f"(at most {SIGTERM_LIMIT_S:g} s)"
        )
    if learner_exit not in (0, None):
        problems.append(f"the learner exited with {learner_exit} after SIGTERM")
    return problems


def _print_table(rows: list[dict[str, Any]], seconds: float, pinning: str, skip_s: float) -> None:
    print_table(
        f"flood: CartPole Ape-X learner + 1 honest actor (epsilon 1), {seconds:g} s per phase, first {skip_s:g} s "
        f"not measured; pinning: {pinning}",
        [
            "phase",
            "updates/s",
            "vs unloaded",
            "env steps/s",
            "vs unloaded",
            "refused",
            "refused by reason",
            "flood msgs/s",
            "refused after (s)",
            "learner / actor / flooder CPU %",
            "learner RSS MB",
            "ok",
        ],
        [
            [
                r["phase"],
                r["updates_per_s"],
                _percent(r["updates_ratio"]),
                r["env_steps_per_s"],
                _percent(r["env_steps_ratio"]),
                r["rejected_messages"],
                ", ".join(f"{k} {v:,}" for k, v in sorted(r["rejected_by_reason"].items(), key=lambda kv: -kv[1]))
                or "-",
                r["flood_msgs_per_s"],
                f"{r['refused_after_flood']:,} ({r['drain_s']:g})" if "drain_s" in r else "-",
                f"{r['learner_cpu_percent']} / {r['actor_cpu_percent']} / {r['flooder_cpu_percent']}",
                r["learner_rss_mb"],
                "-" if r["flooders"] == "none" else ("yes" if r["passed"] else "NO"),
            ]
            for r in rows
        ],
    )


def _print_verdict(
    unloaded: int,
    base: dict[str, float | None],
    drift: float | None,
    sigterm: dict[str, Any],
    learner_exit: int | None,
    problems: list[str],
) -> None:
    print(
        f"unloaded (the baseline, mean of the {unloaded} unloaded phases): "
        f"{_number(base['updates_per_s'], '.1f')} updates/s, {_number(base['env_steps_per_s'], '.0f')} env steps/s; "
        "the second unloaded phase differs from the first by "
        f"{'-' if drift is None else f'{drift:+.0f}%'} in updates/s"
    )
    print(
        f"SIGTERM under the full flood: the learner wrote summary.json after {_seconds(sigterm.get('summary'))} and "
        f"exited after {_seconds(sigterm.get('learner'))} (limit {SIGTERM_LIMIT_S:g} s; exit code {learner_exit}); "
        f"the honest actor exited after {_seconds(sigterm.get('actor'))}"
    )
    print("passed" if not problems else "FAILED: " + "; ".join(problems))


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"
