"""APPO's learner core: IMPALA's (its actors, unrolls, batch schema and network,
``apex.algos.impala.learner``) with PPO's clipped surrogate against a target network
(``apex.algos.appo.loss``), several passes over each batch in minibatches of unrolls, and a
circular buffer of unrolls (``apex.replay.UnrollRing``) in place of IMPALA's queue.

One staged batch of ``impala.batch_unrolls`` unrolls makes ``appo.epochs`` x
``appo.minibatches`` updates (optimizer steps): each pass shuffles the unrolls and splits
them into minibatches, keeping each unroll whole (a recurrent core runs from its first
observation). The target network, pi_old, is a copy of the network every
``appo.target_update_every`` updates. A learner group's rank without a batch takes as many
steps without one, so that every rank's all-reduces pair up.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch

from apex.algos.appo.loss import SurrogateSettings, appo_loss
from apex.algos.impala.learner import POLICY, ImpalaLearner
from apex.algos.masks import MASKED_LOGIT
from apex.config import Config
from apex.envs.make import EnvSpec
from apex.nets.torch_nets import check_fits
from apex.replay import UnrollRing
from apex.training import optim
from apex.training.distributed import NO_BATCH, step_without_batch
from apex.training.pipeline import Pending, Staged, collect, fetch

FIGURES = ("loss", "pg_loss", "baseline_loss", "entropy", "kl", "clip_fraction")
# An adaptive KL weight moves by this factor when the KL is this far off its target (PPO's).
KL_STEP, KL_TOLERANCE = 2.0, 1.5
KL_COEFF_RANGE = (1e-8, 1e8)  # bounds, so that a long stretch off target cannot run it away


def surrogate_settings(config: Config, spec: EnvSpec) -> SurrogateSettings:
    im, ap = config.impala, config.appo
    return SurrogateSettings(
        ap.clip,
        ap.kl_coeff,
        ap.value_clip,
        ap.advantages,
        spec.resolve_auto(im.normalize_advantages),
        ap.gae_lambda,
        im.rho_bar,
        im.c_bar,
        im.baseline_cost,
        im.entropy_cost,
    )


class AppoLearner(ImpalaLearner):
    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        super().__init__(config, spec, device)
        im, ap = config.impala, config.appo
        self.ring = UnrollRing(im.queue_size, im.queue_policy == "block", ap.replay_ratio, seed=config.seed)
        self.queue = self.ring
        self.target = copy.deepcopy(self.net).requires_grad_(False)
        # True while the target holds the network's weights: its outputs are then the network's
        # own, detached, and its forward pass is skipped (every target_update_every-th update).
        self._target_is_net = True
        self.settings = surrogate_settings(config, spec)
        self.kl_coeff = ap.kl_coeff  # adapted by finish() where appo.kl_target is set
        self.steps = 0  # optimizer steps taken, skipped ones too: the target network's clock
        self.steps_per_batch = ap.epochs * ap.minibatches
        self.samples_per_update = im.batch_unrolls * im.unroll_length // ap.minibatches
        self._shuffle = torch.Generator().manual_seed(config.seed)

    def train(self, staged: Staged) -> Pending:
        """Enqueues the batch's epochs x minibatches updates; their results come back together."""
        staged.wait()
        batch = staged.tensors
        unrolls = batch["obs"].shape[1]
        rows = []
        for _ in range(self.config.appo.epochs):
            order = torch.randperm(unrolls, generator=self._shuffle)
            for part in order.tensor_split(self.config.appo.minibatches):
                rows.append(self._update(self._minibatch(batch, part.to(self.device))))
        return fetch([torch.cat(rows)])

    def _minibatch(self, batch: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unrolls ``index`` of a time-major batch (the core's states are [B, L])."""
        return {
            name: tensor.index_select(0 if name in ("core_h", "core_c") else 1, index) for name, tensor in batch.items()
        }

    def _update(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        state = (batch["core_h"], batch["core_c"]) if self.recurrent else None
        params, values = self.net.unroll(batch["obs"], batch.get("done"), state)
        if self._target_is_net:
            old_params, old_values = params.detach(), values.detach()
        else:
            with torch.no_grad():
                old_params, old_values = self.target.unroll(batch["obs"], batch.get("done"), state)
        if "mask" in batch:  # illegal actions have probability 0 under both policies
            illegal = batch["mask"] == 0
            params = torch.cat([params[:-1].masked_fill(illegal, MASKED_LOGIT), params[-1:]])
            old_params = torch.cat([old_params[:-1].masked_fill(illegal, MASKED_LOGIT), old_params[-1:]])
        settings = self.settings if self.kl_coeff == self.settings.kl_coeff else self._settings_now()
        out = appo_loss(
            params,
            values,
            old_params,
            old_values,
            batch["action"],
            batch["behaviour_logp"],
            batch["reward"],
            batch["discount"],
            settings,
            self.spec,
        )
        results = optim.guarded_step(
            self.optimizer,
            out.loss,
            self.net.parameters(),
            self.config.impala.grad_clip,
            [out.loss, out.pg_loss, out.baseline_loss, out.entropy, out.kl, out.clip_fraction],
            self.all_reduce,
        )
        self._stepped()
        return results

    def _settings_now(self) -> SurrogateSettings:
        """The settings with the KL weight as adapted so far."""
        self.settings = dataclasses.replace(self.settings, kl_coeff=self.kl_coeff)
        return self.settings

    def _stepped(self) -> None:
        self.steps += 1
        self._target_is_net = self.steps % self.config.appo.target_update_every == 0
        if self._target_is_net:
            self.target.load_state_dict(self.net.state_dict())

    def train_without_batch(self) -> Pending:
        """A learner group's batch of steps on this rank without a batch: as many steps as a
        batch makes, each the other ranks' gradient applied."""
        if self.all_reduce is None:
            raise RuntimeError("a step without a batch is a learner group's: all_reduce is not set")
        rows = []
        for _ in range(self.steps_per_batch):
            rows.append(
                step_without_batch(
                    self.optimizer, self.net.parameters(), self.config.impala.grad_clip, len(FIGURES), self.all_reduce
                )
            )
            self._stepped()
        return fetch([torch.cat(rows)], NO_BATCH)

    def finish(self, pending: list[Pending]) -> list[dict[str, float]]:
        """Each batch's metrics (the means over its applied updates; {} for a group's batch
        this rank took without one, or one whose every update was skipped as non-finite); the
        adaptive KL weight follows each batch's KL."""
        metrics: list[dict[str, float]] = []
        for step, row in zip(pending, collect(pending)):
            rows = row.reshape(self.steps_per_batch, -1)  # skipped, *FIGURES, grad_norm
            applied = rows[rows[:, 0] == 0]
            self.skipped_updates += len(rows) - len(applied)
            self.updates += len(applied)
            if step.context is NO_BATCH or not len(applied):
                metrics.append({})
                continue
            means = applied[:, 1:].mean(axis=0)
            figures = dict(zip((*FIGURES, "grad_norm"), means.tolist()))
            self._adapt_kl(figures["kl"])
            metrics.append(figures)
        return metrics

    def _adapt_kl(self, kl: float) -> None:
        target = self.config.appo.kl_target
        if self.config.appo.kl_coeff == 0 or target is None:
            return
        if kl > target * KL_TOLERANCE:
            self.kl_coeff = min(self.kl_coeff * KL_STEP, KL_COEFF_RANGE[1])
        elif kl < target / KL_TOLERANCE:
            self.kl_coeff = max(self.kl_coeff / KL_STEP, KL_COEFF_RANGE[0])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "target": self.target.state_dict(), "kl_coeff": self.kl_coeff}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.target.load_state_dict(state["target"])
        self._target_is_net = False
        self.kl_coeff = float(state["kl_coeff"])

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        check_fits(self.target, state["target"], "target")
        coeff = state.get("kl_coeff")
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 <= coeff < np.inf:
            raise ValueError(f"kl_coeff must be a finite number >= 0, got {coeff!r}")

    def metrics(self) -> dict[str, Any]:
        return {**super().metrics(), "kl_coeff": self.kl_coeff, "queue_reused_unrolls": self.ring.reused}


__all__ = ["POLICY", "AppoLearner"]
