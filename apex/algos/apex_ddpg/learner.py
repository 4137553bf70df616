"""Ape-X DDPG's learner core: Ape-X's (``apex.algos.replay_learner``: the prioritized replay
of frame-deduplicated n-step transitions, its rate limiter, initial priorities held to a cap,
poisoned batches dropped, the prefetch pipeline) training a deterministic policy and TD3's
twin critics (``apex.algos.apex_ddpg.loss``) instead of a Q network.

Each update trains the critics; every ``apex_ddpg.policy_delay``-th also trains the policy
and moves the target networks towards the online ones (Polyak, ``apex_ddpg.tau``). One Adam
holds the policy (``apex_ddpg.actor_lr``) and the critics (``apex_ddpg.lr``) as two groups;
an update without the policy leaves its parameters out of the step (no gradient, no moment
update).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from apex.algos.apex_ddpg.exploration import actor_noise_scales
from apex.algos.apex_ddpg.loss import TargetSettings, bootstrap_targets, critic_loss, policy_loss
from apex.algos.replay_learner import ReplayLearner, batch_limits, batch_schema
from apex.config import Config
from apex.core import Policy
from apex.envs.make import EnvSpec
from apex.envs.spaces import bounds_finite, check_algo_actions
from apex.nets.deterministic import DeterministicActorCritic, DeterministicPolicy
from apex.nets.torch_nets import check_fits, numpy_weights
from apex.training import optim
from apex.training.distributed import NO_BATCH, step_without_batch
from apex.training.pipeline import Pending, Staged, fetch
from apex.wire.schema import ArrayRule, Range


def action_rule(spec: EnvSpec) -> ArrayRule:
    """A batch's actions: float32 vectors within the action bounds."""
    return ArrayRule(
        "action", "f", np.dtype(np.float32), ("transitions", spec.num_actions), Range(spec.action_low, spec.action_high)
    )


class ApexDdpgLearner(ReplayLearner[DeterministicActorCritic]):
    """A deterministic policy and its critics over Ape-X's prioritized replay."""

    figures = ("loss", "policy_loss", "policy_step", "q_mean", "td_abs_mean", "priority_sum")

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        torch.manual_seed(config.seed)
        finite = bounds_finite(spec.action_low, spec.action_high)
        if not spec.continuous or not finite:  # env_spec(..., algo) says so first, in the parent
            kind = "Box" if spec.continuous else "MultiDiscrete" if spec.action_nvec else "Discrete"
            check_algo_actions(kind, spec.action_nvec or (spec.num_actions,), "apex_ddpg", config.env.id, finite)
        self.config = config
        self.settings = s = config.apex_ddpg
        self.spec = spec
        self.device = device
        self.online = DeterministicActorCritic(spec, config.model, critics=2 if s.twin_critics else 1).to(device)
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.policy_params = list(self.online.policy.parameters())
        self.critic_params = list(self.online.critics.parameters())
        # (the target's and the online's parameters in the same order, for the Polyak step)
        self._polyak: tuple[list[torch.Tensor], list[torch.Tensor]] = (
            list(self.target.parameters()),
            list(self.online.parameters()),
        )
        groups = [{"params": self.policy_params, "lr": s.policy_lr}, {"params": self.critic_params, "lr": s.lr}]
        self.optimizer = optim.make("adam", groups, s.lr, s.adam_eps, fused=True)
        self.target_settings = TargetSettings(s.twin_critics, s.target_noise, s.target_noise_clip)
        self._smoothing = torch.Generator(device).manual_seed(config.seed)
        self._replay_and_counters(None)
        self.schema = batch_schema(spec, config, s.n_step, action_rule(spec))
        self.policy_updates = 0
        self.last_policy_loss: float | None = None

    def batch_limits(self, num_envs: int) -> dict[str, int]:
        return batch_limits(num_envs, self.spec, self.config, self.settings)

    def actor_setup(self, actor_index: int, num_envs: int) -> dict[str, Any]:
        scales, eval_mask = actor_noise_scales(actor_index, num_envs, self.config.apex_ddpg)
        return {"noise_scales": scales, "eval_envs": eval_mask}

    def _policy_step(self) -> bool:
        """Whether the next update trains the policy too (every policy_delay-th, counting
        skipped and batchless ones: every rank of a group agrees)."""
        return (self.steps + 1) % self.config.apex_ddpg.policy_delay == 0

    def train(self, staged: Staged) -> Pending:
        """Enqueues the update on a staged batch (see the module's docstring); a non-finite
        loss, gradient or priority skips it."""
        staged.wait()
        batch = staged.tensors
        with_policy = self._policy_step()
        y = bootstrap_targets(
            self.target, batch["reward"], batch["discount"], batch["next_obs"], self.target_settings, self._smoothing
        )
        out = critic_loss(self.online, batch["obs"], batch["action"], y, batch["weights"])
        actor_loss = policy_loss(self.online, batch["obs"]) if with_policy else out.loss.new_zeros(())
        results = optim.guarded_step(
            self.optimizer,
            out.loss + actor_loss,
            self.policy_params + self.critic_params if with_policy else self.critic_params,
            self.config.apex_ddpg.grad_clip,
            [
                out.loss,
                actor_loss,
                out.loss.new_tensor(float(with_policy)),
                out.q_mean,
                out.td_abs_mean,
                out.priorities.sum(),
            ],
            self.all_reduce,
        )
        self._stepped()
        return fetch([results, out.priorities], staged.context)

    def train_without_batch(self) -> Pending:
        """A learner group's step on this rank without a batch: the other ranks' gradient
        applied to the same parameters as theirs."""
        if self.all_reduce is None:
            raise RuntimeError("a step without a batch is a learner group's: all_reduce is not set")
        params = self.policy_params + self.critic_params if self._policy_step() else self.critic_params
        results = step_without_batch(
            self.optimizer, params, self.config.apex_ddpg.grad_clip, len(self.figures), self.all_reduce
        )
        self._stepped()
        return fetch([results, results.new_zeros(self.config.apex_ddpg.batch_size)], NO_BATCH)

    def _stepped(self) -> None:
        """After every policy update, the targets move towards the online networks."""
        self.steps += 1
        if self.steps % self.config.apex_ddpg.policy_delay == 0:
            with torch.no_grad():
                torch._foreach_lerp_(*self._polyak, self.config.apex_ddpg.tau)

    def finish(self, pending: list[Pending]) -> list[dict[str, float]]:
        """Ape-X DQN's write-back; a step's metrics hold policy_loss only where it trained the
        policy (the last such loss is kept for ``metrics``)."""
        out = super().finish(pending)
        for metrics in out:
            if metrics.pop("policy_step", 0.0):
                self.policy_updates += 1
                self.last_policy_loss = metrics["policy_loss"]
            else:
                metrics.pop("policy_loss", None)
        return out

    def weights(self) -> dict[str, np.ndarray]:
        """What actors act with: the policy and the first critic (their initial priorities)."""
        return {
            name: array
            for name, array in numpy_weights(self.online).items()
            if name.startswith(("policy.", "critics.0."))
        }

    def state_dict(self) -> dict[str, Any]:
        """Ape-X DQN's, and the policy on its own (a copy of online's policy.*): what `apex
        eval` and apex.load_policy read, whatever the number of critics."""
        return {
            **super().state_dict(),
            "policy": self.online.policy.state_dict(),
            "policy_updates": self.policy_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.policy_updates = int(state.get("policy_updates", 0))

    def check_state(self, state: dict[str, Any]) -> None:
        check_fits(self.online, state["online"], "online")
        check_fits(self.target, state["target"], "target")
        check_fits(self.online.policy, state["policy"], "policy")
        optim.check_state(self.optimizer, state["optimizer"])
        count = state.get("policy_updates", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"policy_updates must be an integer >= 0, got {count!r}")

    def metrics(self) -> dict[str, Any]:
        extra = {} if self.last_policy_loss is None else {"policy_loss_last": self.last_policy_loss}
        return {**super().metrics(), "policy_updates": self.policy_updates, **extra}


def _act(
    net: DeterministicPolicy, obs: torch.Tensor, state: None = None, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, None]:
    return net(obs), None


# `apex eval` and apex.load_policy act with the online policy mu(s), without noise.
POLICY = Policy("policy", "the online policy mu(s)", DeterministicPolicy, _act)
