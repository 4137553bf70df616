"""Action masks (``action_mask`` in a multi-agent observation or info): the legal actions of a
Discrete policy's step, one bool a row. Actors never choose an illegal action, and the losses
never bootstrap from one (Ape-X: the n-step target's argmax and max over the legal next
actions; IMPALA: logits of illegal actions pushed to MASKED_LOGIT, so their probability is 0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from apex.core.episode import Episode

# Not -inf: 0 * -inf in an entropy or a log-softmax gradient would be NaN; exp(-1e9) is 0.
MASKED_LOGIT = -1e9


def episode_masks(episodes: list[Episode], num_actions: int) -> np.ndarray | None:
    """The masks of these episodes' next steps, [B, A] bool (all legal where one has none),
    or None where no episode has one."""
    if all(episode.mask is None for episode in episodes):
        return None
    masks = np.ones((len(episodes), num_actions), bool)
    for i, episode in enumerate(episodes):
        if episode.mask is not None:
            masks[i] = episode.mask
    return masks


def masked_values(values: np.ndarray, mask: np.ndarray | None, fill: float = -np.inf) -> np.ndarray:
    """``values`` [B, A] with ``fill`` where an action is illegal (unchanged without a mask)."""
    return values if mask is None else np.where(mask, values, fill)


def legal_actions(rng: np.random.Generator, actions: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """``actions`` with each illegal one replaced by a legal one drawn uniformly (a random
    exploration step, or a held action no longer legal)."""
    if mask is None:
        return actions
    rows = np.flatnonzero(~mask[np.arange(len(actions)), actions])
    if len(rows):
        actions = actions.copy()
        for row in rows:
            actions[row] = rng.choice(np.flatnonzero(mask[row]))
    return actions
