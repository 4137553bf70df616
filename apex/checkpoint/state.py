"""A checkpoint's learner state (ckpt-N.pt): read without running code, then checked."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from apex.checkpoint.common import CorruptCheckpoint, is_int, memory_bytes, show
from apex.core import FACTS
from apex.system.files import RefusedFile, open_regular

# What every apex learner state holds beside its algorithm's networks, as torch.load
# (weights_only) returns it; bool is excluded where an int is wanted.
_STATE_KEYS: dict[str, type | tuple[type, ...]] = {
    "updates": int,
    "env_steps": int,
    "time": (int, float),
    "episode_stats": dict,
    "config": dict,
}
MAX_COUNT = 2**53  # counters beyond it are no run's (and 2**64 would not go on the wire as a weights version)
_DEFAULT_ALGO = "apex_dqn"  # Config.algo's default: a config written without one means it
_WEIGHTS_ONLY_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
# Values a state_dict walk visits at most. A learner's state holds a few hundred; pickle's
# memo lets a file of kilobytes hold lists shared so often that walking every path through
# them would take for ever (each is looked into once, and a million values is no state).
MAX_STATE_NODES = 1_000_000


def read_state(path: Path, max_bytes: int | None = None) -> Any:
    """What ``torch.load`` finds in ``path`` (a regular file of at most ``max_bytes``: by
    default this machine's memory), loaded without running any code (tensors and plain
    containers only); CorruptCheckpoint with a one-line reason if it cannot."""
    try:
        f = open_regular(path, memory_bytes() if max_bytes is None else max_bytes)
    except RefusedFile as e:
        raise CorruptCheckpoint(str(e)) from None
    except OSError as e:
        raise CorruptCheckpoint(f"{Path(path).name} cannot be loaded: {load_failure(e)}") from None
    try:
        with f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. a forged file's pickle protocol: the error says enough
            import torch  # here, not at import: `apex run` and the CLI start without torch

            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptCheckpoint(f"{Path(path).name} cannot be loaded: {load_failure(e)}") from None


def load_failure(error: Exception) -> str:
    text = str(error).strip()
    if text.startswith("Weights only load failed"):
        found = _WEIGHTS_ONLY_GLOBAL.search(text)
        what = (
            f"it would call {found.group(1)}" if found else "it holds objects other than tensors and plain containers"
        )
        return f"{what}, and a checkpoint is loaded without running code (a forged or foreign file?)"
    first = text.splitlines()[0].split(". ")[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def check_state(state: Any, source: str) -> dict[str, Any]:
    """``state`` if it holds what every apex learner checkpoint does (the counters, the
    episode stats, the config and its algorithm's networks and optimizer);
    CorruptCheckpoint naming the first thing missing or of the wrong type."""
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"{source} holds a {type(state).__name__}, not an apex learner state (a dict)")
    for key, kind in _STATE_KEYS.items():
        if key not in state:
            raise CorruptCheckpoint(f"{source} lacks {key!r}: not an apex learner checkpoint")
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CorruptCheckpoint(f"{source}: {key!r} is a {type(value).__name__}, expected {_type_names(kind)}")
    if not (
        0 <= state["updates"] <= MAX_COUNT
        and 0 <= state["env_steps"] <= MAX_COUNT
        and 0 <= state["time"] < float("inf")
    ):
        raise CorruptCheckpoint(
            f"{source}: updates, env_steps and time must be finite, >= 0 and at most 2**53, got "
            f"{show(state['updates'])}, {show(state['env_steps'])}, {show(state['time'])}"
        )
    _check_episode_stats(state["episode_stats"], source)
    policy_stats = state.get("policy_episode_stats", {})
    if not isinstance(policy_stats, dict):
        raise CorruptCheckpoint(f"{source}: 'policy_episode_stats' must map policy names to episode stats")
    for stats in policy_stats.values():
        _check_episode_stats(stats if isinstance(stats, dict) else {}, source)
    _check_optional(state, source)
    algo = state["config"].get("algo", _DEFAULT_ALGO)
    if not isinstance(algo, str) or algo not in FACTS:
        raise CorruptCheckpoint(f"{source}: config.algo is {show(algo)}, expected one of {sorted(FACTS)}")
    seen: set[int] = set()
    budget = [MAX_STATE_NODES]  # for all the state_dicts: they may share
    policies = state.get("policies")
    if policies is None:
        _check_networks(state, FACTS[algo].state_keys, algo, "", source, seen, budget)
        return state
    if not (isinstance(policies, dict) and policies and all(isinstance(k, str) for k in policies)):
        raise CorruptCheckpoint(f"{source}: 'policies' must map policy names to their learners' state_dicts")
    for name, part in policies.items():
        if not isinstance(part, dict):
            raise CorruptCheckpoint(f"{source}: policies.{show(name)} is not a learner's state_dict")
        _check_networks(part, FACTS[algo].state_keys, algo, f"policies.{name}.", source, seen, budget)
    return state


def _check_networks(
    state: dict[str, Any], keys: tuple[str, ...], algo: str, prefix: str, source: str, seen: set[int], budget: list[int]
) -> None:
    """CorruptCheckpoint unless each of ``keys`` is a state_dict of finite tensors."""
    for key in keys:
        if not isinstance(state.get(key), dict):
            raise CorruptCheckpoint(
                f"{source} lacks {prefix}{key!r}, which every {algo} checkpoint holds (a state_dict)"
            )
        try:
            where = _not_finite(state[key], f"{prefix}{key}", seen, budget)
        except RecursionError:
            raise CorruptCheckpoint(f"{source}: {prefix}{key!r} is nested too deep for a state_dict") from None
        except _TooLarge:
            raise CorruptCheckpoint(
                f"{source}: the state_dicts up to {prefix}{key!r} hold more than {MAX_STATE_NODES} "
                "values, which no learner's do (a forged file?)"
            ) from None
        if where is not None:
            raise CorruptCheckpoint(
                f"{source}: {where} holds NaN or infinity (the learner never writes such a "
                "checkpoint: a damaged or forged file)"
            )


class _TooLarge(Exception):
    pass


def _not_finite(value: Any, where: str, seen: set[int], budget: list[int]) -> str | None:
    """Where in a state_dict (nested dicts and lists of tensors) a float tensor holds NaN or
    infinity, or None. Each container and tensor is looked into once however often it is
    shared (``seen``: their ids; the state holds them all alive meanwhile); _TooLarge once
    ``budget[0]`` values (and references to them) have been visited."""
    import torch

    budget[0] -= 1
    if budget[0] < 0:
        raise _TooLarge
    is_tensor = isinstance(value, torch.Tensor)
    if not (is_tensor or isinstance(value, (dict, list, tuple))) or id(value) in seen:
        return None
    seen.add(id(value))
    if is_tensor:
        return where if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        if (found := _not_finite(item, f"{where}.{key}", seen, budget)) is not None:
            return found
    return None


def _check_episode_stats(stats: dict[str, Any], source: str) -> None:
    """What EpisodeStats.load_state_dict reads."""
    numbers = all(
        isinstance(stats.get(k), list) and all(isinstance(x, (int, float)) for x in stats[k]) for k in ("eval", "train")
    )
    if not (numbers and is_int(stats.get("episodes")) and isinstance(stats.get("best"), (int, float))):
        raise CorruptCheckpoint(
            f"{source}: 'episode_stats' must hold lists 'eval' and 'train' of returns, "
            "an int 'episodes' and a number 'best'"
        )


def _check_optional(state: dict[str, Any], source: str) -> None:
    """Keys that older checkpoints may lack, checked when present (the learner reads them)."""
    hosts = state.get("env_steps_by_host", {})
    if not (
        isinstance(hosts, dict) and all(isinstance(k, str) and is_int(v) and v <= MAX_COUNT for k, v in hosts.items())
    ):
        raise CorruptCheckpoint(f"{source}: 'env_steps_by_host' must map host names to ints >= 0")
    limiter = state.get("limiter", {"inserts": 0, "samples": 0})
    if not (
        isinstance(limiter, dict)
        and all(is_int(limiter.get(k)) and limiter[k] <= MAX_COUNT for k in ("inserts", "samples"))
    ):
        raise CorruptCheckpoint(f"{source}: 'limiter' must hold ints 'inserts' and 'samples' in 0..2**53")


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
