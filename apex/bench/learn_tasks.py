"""The tasks of `apex bench learn` (``apex.bench.learn``): each one's environment, the
return that counts as learned and the time it should take, by algorithm, its time limit,
and the published figure it is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from apex.core import FACTS

T = TypeVar("T")


@dataclass(frozen=True)
class Task:
    env_id: str
    thresholds: dict[str, float]  # by algorithm (those it runs): the return_mean_100 that counts as learned
    target_s: dict[str, float | None]  # by algorithm: issue 15's goal for the time to it (None: report only)
    minutes: float  # time limit per run unless --minutes
    reference: str  # a published figure to compare with, and its source
    # False: no preset, `apex run --env ENV_ID --algo A` (the algorithm's defaults), with
    # --allow-import for a module:Id of ours (the test envs: run from a checkout)
    preset: bool = True
    allow_import: str | None = None

    def run_args(self, task: str, algo: str) -> list[str]:
        """`apex run`'s arguments for this task and algorithm (before --seed and the stops)."""
        if self.preset:
            return ["--config", FACTS[algo].preset(task)]
        extra = ["--allow-import", self.allow_import] if self.allow_import else []
        return ["--env", self.env_id, "--algo", algo, *extra]


def _every(value: T) -> dict[str, T]:
    return {"apex_dqn": value, "impala": value, "appo": value}


# MinAtar's DQN at 5M frames, read off the learning curves of kenjyoung/MinAtar's README
# (img/learning_curves.gif: "DQN", replay and a target network, 30 runs, the mean over 100
# training episodes at epsilon 0.1, v0's six actions) by measuring the plot at 5M frames.
MINATAR_DQN = {"breakout": 10.0, "spaceinvaders": 43.0, "asterix": 17.0, "freeway": 50.0, "seaquest": 20.0}
MINATAR_IDS = {
    "breakout": "Breakout",
    "spaceinvaders": "SpaceInvaders",
    "asterix": "Asterix",
    "freeway": "Freeway",
    "seaquest": "Seaquest",
}

TASKS = {
    "cartpole": Task(
        "CartPole-v1",
        _every(475.0),
        {"apex_dqn": 12.0, "impala": 8.0, "appo": 8.0},
        2.0,
        "CleanRL DQN 488.7 at 500k steps (CleanRL benchmark, dqn.py on CartPole-v1)",
    ),
    "acrobot": Task(
        "Acrobot-v1",
        {"apex_dqn": -75.0, "impala": -100.0, "appo": -100.0},
        {"apex_dqn": 30.0, "impala": 60.0, "appo": 60.0},
        2.0,
        "CleanRL DQN -91.5 at 500k steps; rl-zoo DQN -76.6 at 100k",
    ),
    "mountaincar": Task(
        "MountainCar-v0",
        _every(-110.0),
        {"apex_dqn": 60.0, "impala": None, "appo": None},
        5.0,
        "CleanRL DQN -194.95 at 500k steps; rl-zoo DQN -101 at 120k",
    ),
    "lunarlander": Task(
        "LunarLander-v3",
        _every(200.0),
        _every(300.0),
        5.0,
        "rl-zoo DQN 154 at 100k steps, PPO 242 at 1M (benchmark.md, LunarLander-v2)",
    ),
    # Continuous actions: IMPALA and APPO (a Gaussian policy; issue 18's targets) and Ape-X
    # DDPG (issue 33's).
    "pendulum": Task(
        "Pendulum-v1",
        {"impala": -250.0, "appo": -250.0, "apex_ddpg": -200.0},
        {"impala": 300.0, "appo": 300.0, "apex_ddpg": 120.0},
        5.0,
        "rl-zoo PPO -172 at 100k steps (benchmark.md, Pendulum-v1)",
    ),
    "lunarlandercontinuous": Task(
        "LunarLanderContinuous-v3",
        {"impala": 200.0, "appo": 200.0, "apex_ddpg": 200.0},
        {"impala": 900.0, "appo": 900.0, "apex_ddpg": 600.0},
        15.0,
        "rl-zoo PPO 270 at 1M steps (benchmark.md, LunarLanderContinuous-v2)",
    ),
    "bipedalwalker": Task(
        "BipedalWalker-v3",
        {"impala": 300.0, "appo": 300.0, "apex_ddpg": 300.0},
        {"impala": None, "appo": None, "apex_ddpg": None},
        20.0,
        "300 is the environment's own definition of solved (Gymnasium's BipedalWalker docs); "
        "rl-zoo PPO 213 at 5M steps, SAC 298 at 500k (benchmark.md)",
    ),
    # Issue 47: the continuous rows with each algorithm's defaults (no preset), beside SB3's
    # PPO and SAC measured with tests/support/sb3_peer.py on the same machine.
    "reach": Task(
        "tests.envs:apex-test/Reach-v0",
        {"impala": 0.0, "appo": 0.0, "apex_ddpg": 0.0},
        {"impala": None, "appo": None, "apex_ddpg": None},
        2.0,
        "SB3 PPO (8 envs, n_steps 256): 0 in 8.6-10.1 s, 24-25k env steps here; random actions -52",
        preset=False,
        allow_import="tests",
    ),
    "mountaincarcontinuous": Task(
        "MountainCarContinuous-v0",
        {"impala": 90.0, "appo": 90.0, "apex_ddpg": 90.0},
        {"impala": None, "appo": None, "apex_ddpg": None},
        5.0,
        "rl-zoo SAC 94.7 at 50k steps, PPO 88.3 at 20k (benchmark.md); 90 is the task's own "
        "solved: a policy near 0 avoids the action cost (-0.1 a^2 a step) and never finds the flag",
        preset=False,
    ),
    # Multi-agent (PettingZoo): the run's return_mean_100 is the team's (simple_spread) or,
    # in self-play, the learning seat's against a uniformly random player (tictactoe).
    "tictactoe": Task(
        "pettingzoo.classic:tictactoe_v3",
        _every(0.9),
        _every(None),
        5.0,
        "a uniformly random player scores 0.0 against another over both seats; perfect play "
        "against one about 0.95 (1 a win, -1 a loss)",
    ),
    "simple_spread": Task(
        "mpe2:simple_spread_v3",
        _every(-20.0),
        _every(None),
        10.0,
        "team return, mpe2 1.1.1 defaults: a uniformly random team -27.9, agent i steering to "
        "landmark i -12.7 (both measured here)",
    ),
    **{
        f"minatar_{game}": Task(
            f"MinAtar/{MINATAR_IDS[game]}-v1",
            _every(score),
            _every(1200.0),
            20.0,
            f"MinAtar DQN {score:g} at 5M frames (Young & Tian 2019; README curves)",
        )
        for game, score in MINATAR_DQN.items()
    },
}
