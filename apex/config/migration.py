"""Older configs read under today's names: keys that moved (each algorithm's settings into its
own section) and keys that were retired. Configs, presets, ``--set`` overrides and the configs
saved in checkpoints all pass through here, so that runs written by an older apex still load
and resume."""

from __future__ import annotations

import logging
from typing import Any

from apex.core import ALGO_SECTIONS, ALGOS
from apex.errors import ConfigError

log = logging.getLogger("apex.config")


# Keys that older configs (and the configs saved in their checkpoints) hold and that no
# longer mean anything: dropped with a warning, so that those runs still load and resume.
RETIRED_KEYS = {
    ("actor", "num_actors"): "the exploration ladder now follows the actors that join",
}

# Keys that older configs hold under another name: each algorithm's settings moved into its
# own section. They are read as the new key, with one warning naming each; "{algo}" is the
# section of the config's own algorithm (both algorithms read learner.lr before). A whole
# "replay" section moves to apex_dqn.replay.
MOVED_KEYS = {
    **{
        ("learner", key): f"apex_dqn.{key}"
        for key in ("batch_size", "n_step", "target_update_interval", "prefetch_batches", "checkpoint_replay")
    },
    **{("learner", key): f"{{algo}}.{key}" for key in ("lr", "adam_eps", "gamma", "grad_clip", "publish_interval")},
    **{
        ("actor", key): f"apex_dqn.{key}"
        for key in ("eps_base", "eps_alpha", "eps_repeat_mu", "eval_envs", "eval_epsilon", "chunk_transitions")
    },
    ("actor", "weights_update_steps"): "{algo}.weights_update_steps",
    ("appo", "normalize_advantages"): "impala.normalize_advantages",  # IMPALA's too, since issue 47
    # the ratio is the algorithm's, since issue 48 (a key in a subsection: "replay.<key>")
    **{(algo, "replay.samples_per_insert"): f"{algo}.replay_ratio" for algo in ("apex_dqn", "apex_ddpg")},
}
MOVED_SECTIONS = {"replay": "apex_dqn.replay"}


def final_algo(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> str:
    """The algorithm the config will have once its overrides apply (the section its moved
    learner.lr and the like go to)."""
    algo = raw.get("algo") if isinstance(raw, dict) else None
    for override in overrides:
        key, sep, text = override.partition("=")
        if sep and key.strip() == "algo":
            algo = text.strip()
    return algo if isinstance(algo, str) and algo in ALGOS else "apex_dqn"


def newer_key(key: str, algo: str, moved: list[str]) -> str:
    """The key that a (dotted) key of an older config is now; ``key`` itself if not moved."""
    section, _, rest = key.partition(".")
    if section in MOVED_SECTIONS:
        new = f"{MOVED_SECTIONS[section]}.{rest}" if rest else MOVED_SECTIONS[section]
    elif (section, rest) in MOVED_KEYS:
        new = MOVED_KEYS[(section, rest)].format(algo=ALGO_SECTIONS[algo][0])  # (APPO's lr is IMPALA's)
    else:
        return key
    moved.append(f"{key} -> {new}")
    return new


def move_older_keys(raw: Any, algo: str, moved: list[str]) -> Any:
    """``raw`` with the keys of MOVED_KEYS and MOVED_SECTIONS at their new place (``moved``
    lists each); ConfigError where an older key and its new one are both set, differently."""
    if not isinstance(raw, dict):
        return raw  # said by _build
    raw = dict(raw)
    for section in [s for s in MOVED_SECTIONS if s in raw]:
        _put(raw, MOVED_SECTIONS[section], raw.pop(section), section, moved)
    for (section, key), target in MOVED_KEYS.items():
        path = [section, *key.split(".")]
        if _holds(raw, path):
            _put(raw, target.format(algo=algo), _pop(raw, path), f"{section}.{key}", moved)
    return raw


def _holds(raw: dict[str, Any], path: list[str]) -> bool:
    """Whether ``raw`` has a value at ``path`` (sections, then a key)."""
    node: Any = raw
    for part in path[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return False
    return path[-1] in node


def _pop(raw: dict[str, Any], path: list[str]) -> Any:
    """Takes the value at ``path`` out of ``raw``, copying each section on the way down (the
    caller's dicts stay as they were)."""
    node = raw
    for part in path[:-1]:
        node[part] = dict(node[part])
        node = node[part]
    return node.pop(path[-1])


def _put(raw: dict[str, Any], dotted: str, value: Any, old_name: str, moved: list[str]) -> None:
    node = raw
    *sections, key = dotted.split(".")
    for part in sections:
        child = node.get(part)
        child = dict(child) if isinstance(child, dict) else {} if child is None else child
        if not isinstance(child, dict):
            return  # the section is a value: _build names it
        node[part] = child
        node = child
    if isinstance(node.get(key), dict) and isinstance(value, dict):
        clash = [k for k in value if k in node[key] and node[key][k] != value[k]]
        value = {**value, **node[key]}
    else:
        clash = [key] if key in node and node[key] != value else []
    if clash:
        raise ConfigError(
            f"{old_name} (the older name of {dotted}) and {dotted} are both set, to different values: "
            f"keep {dotted} only"
        )
    node[key] = value
    moved.append(f"{old_name} -> {dotted}")


def drop_retired(raw: Any) -> Any:
    if not isinstance(raw, dict):
        return raw  # said by _build
    for (section, key), why in RETIRED_KEYS.items():
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raw = {**raw, section: {k: v for k, v in raw[section].items() if k != key}}
            log.warning("ignoring %s.%s (from an older config or checkpoint): %s", section, key, why)
    return raw
