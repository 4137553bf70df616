"""Small environments with known optima, registered here (and nowhere else) under
``apex-test/...`` ids: a run names them with ``env.id: tests.envs:apex-test/Corridor-v0``
or ``env.imports: [tests.envs]`` (from the repository root, where ``tests`` imports).

Each exercises one kind of space through apex's adapters (apex.envs.spaces):

- ``apex-test/Corridor-v0``: Discrete observations (one-hot), Discrete actions; optimum 1.0.
- ``apex-test/DictGoal-v0``: Dict observations {goal: Box one-hot, position: Discrete}; optimum 1.0.
- ``apex-test/MultiDial-v0``: MultiDiscrete observations and actions (IMPALA); optimum 1.0.
- ``apex-test/Catch-v0``: pixels, a 40 x 40 uint8 image by default; optimum 1.0.
- ``apex-test/Recall-v0``: memory: a cue seen on the first step only, to be named ``delay``
  steps later; optimum 1.0 for a recurrent policy, 0.0 (chance) for a feed-forward one.
- ``apex-test/Reach-v0``: continuous control: a point steered by bounded 2-D velocities to a
  random goal in a square; a dense distance penalty and +10 on arrival, 50 steps at most.
  A straight path scores about 5 on average; doing nothing about -50.

``SlowSteps`` (``env.wrappers: [{type: tests.envs.SlowSteps, kwargs: {seconds: S}}]``) makes
any environment take at least S seconds a step: actors slower than their learner.
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Corridor(gym.Env):
    """A combination lock along a corridor of ``len(key) + 1`` cells, starting in cell 0:
    in cell i, action ``key[i]`` moves one cell on and the other one back to cell 0. Reaching
    the last cell ends the episode with 1.0, the optimum, within the time limit of
    ``3 * len(key)`` steps (registered for the default key). No constant policy gets there:
    the right action depends on the cell, which the observation gives as a Discrete."""

    def __init__(self, key: str = "1011001") -> None:
        self.key = [int(k) for k in key]
        self.observation_space = spaces.Discrete(len(self.key) + 1)
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.cell = 0
        return self.cell, {}

    def step(self, action):
        self.cell = self.cell + 1 if int(action) == self.key[self.cell] else 0
        done = self.cell == len(self.key)
        return self.cell, float(done), done, False, {}


class DictGoal(gym.Env):
    """A line of ``length`` cells; the agent starts in one and a goal is in another, both at
    random. Observations: {"goal": the goal cell one-hot, a Box; "position": the agent's
    cell, a Discrete}. Reaching the goal ends the episode with 1.0 (always possible within
    the time limit of ``length`` steps: the optimum); moving off the line does nothing."""

    def __init__(self, length: int = 6) -> None:
        self.length = length
        self.observation_space = spaces.Dict(
            {
                "position": spaces.Discrete(length),
                "goal": spaces.Box(0.0, 1.0, (length,), np.float32),
            }
        )
        self.action_space = spaces.Discrete(2)  # 0 left, 1 right

    def _obs(self) -> dict:
        goal = np.zeros(self.length, np.float32)
        goal[self.goal] = 1.0
        return {"position": self.position, "goal": goal}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position, self.goal = (int(x) for x in self.np_random.choice(self.length, 2, replace=False))
        return self._obs(), {}

    def step(self, action):
        self.position = int(np.clip(self.position + (1 if int(action) == 1 else -1), 0, self.length - 1))
        reached = self.position == self.goal
        return self._obs(), float(reached), reached, False, {}


class MultiDial(gym.Env):
    """Set ``len(sizes)`` dials to the targets shown: the observation is the targets, a
    MultiDiscrete, the action the dials' settings, a MultiDiscrete of the same sizes. Each
    of ``steps`` steps pays 1 / (steps * dials) per dial set right (new targets each step):
    the optimum is 1.0, a uniformly random policy gets mean(1 / sizes)."""

    def __init__(self, sizes: tuple[int, ...] = (3, 4), steps: int = 4) -> None:
        self.sizes = np.asarray(sizes, np.int64)
        self.steps = steps
        self.observation_space = spaces.MultiDiscrete(self.sizes)
        self.action_space = spaces.MultiDiscrete(self.sizes)

    def _new_targets(self) -> np.ndarray:
        self.targets = self.np_random.integers(0, self.sizes)
        return self.targets.copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._new_targets(), {}

    def step(self, action):
        action = np.asarray(action)
        assert action.shape == self.sizes.shape and self.action_space.contains(action.astype(np.int64)), action
        reward = float((action == self.targets).sum()) / (self.steps * len(self.sizes))
        self.t += 1
        return self._new_targets(), reward, self.t == self.steps, False, {}


class Catch(gym.Env):
    """A ball falls one row a step down a ``rows`` x ``columns`` grid from a random column of
    the top row; the paddle on the bottom row starts in the middle and moves left, stays or
    moves right. When the ball reaches the bottom row the episode ends with +1 if the paddle
    is under it, else -1: the optimum is 1.0 (the paddle can always get there in time).

    Rendered as pixels, ``cell`` x ``cell`` per grid cell (40 x 40 by default), ball and
    paddle at 255 (uint8), True (bool) or 1.0 (float32). ``channels`` 1 draws both in one
    plane; 2 draws the ball in plane 0 and the paddle in plane 1. ``layout``: ``hw`` (one
    channel only), ``hwc`` or ``chw``."""

    def __init__(
        self,
        rows: int = 5,
        columns: int = 5,
        cell: int = 8,
        channels: int = 1,
        layout: str = "hw",
        dtype: str = "uint8",
    ) -> None:
        assert layout in ("hw", "hwc", "chw") and (layout != "hw" or channels == 1)
        self.rows, self.columns, self.cell, self.channels, self.layout = rows, columns, cell, channels, layout
        self.dtype = np.dtype(dtype)
        height, width = rows * cell, columns * cell
        shape = {"hw": (height, width), "hwc": (height, width, channels), "chw": (channels, height, width)}[layout]
        self.on = {"u": 255, "b": True, "f": 1.0}[self.dtype.kind]
        self.observation_space = spaces.Box(0, int(self.on), shape, self.dtype)
        self.action_space = spaces.Discrete(3)  # left, stay, right

    def _render(self) -> np.ndarray:
        c = self.cell
        planes = np.zeros((self.channels, self.rows * c, self.columns * c), self.dtype)
        planes[0, self.ball_row * c : (self.ball_row + 1) * c, self.ball_column * c : (self.ball_column + 1) * c] = (
            self.on
        )
        paddle = planes[self.channels - 1]
        paddle[(self.rows - 1) * c :, self.paddle * c : (self.paddle + 1) * c] = self.on
        if self.layout == "hw":
            return planes[0]
        return planes.transpose(1, 2, 0).copy() if self.layout == "hwc" else planes

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.ball_row, self.ball_column = 0, int(self.np_random.integers(self.columns))
        self.paddle = self.columns // 2
        return self._render(), {}

    def step(self, action):
        self.paddle = int(np.clip(self.paddle + int(action) - 1, 0, self.columns - 1))
        self.ball_row += 1
        if self.ball_row == self.rows - 1:
            return self._render(), 1.0 if self.paddle == self.ball_column else -1.0, True, False, {}
        return self._render(), 0.0, False, False, {}


class Recall(gym.Env):
    """Partial observability: one of ``cues`` cues is shown on the first observation only,
    then ``delay - 1`` blank ones, then a query (observation t = ``delay``); the action taken
    at the query ends the episode with +1 if it names the cue, -1 otherwise (actions before
    it earn nothing). Observations: the cue one-hot, then a query flag. A policy that
    remembers scores 1.0; one that sees only the present guesses, 2 / cues - 1 on average
    (0.0 for two cues)."""

    def __init__(self, delay: int = 10, cues: int = 2) -> None:
        assert delay >= 1 and cues >= 2
        self.delay, self.cues = delay, cues
        self.observation_space = spaces.Box(0.0, 1.0, (cues + 1,), np.float32)
        self.action_space = spaces.Discrete(cues)

    def _observe(self) -> np.ndarray:
        obs = np.zeros(self.cues + 1, np.float32)
        if self.t == 0:
            obs[self.cue] = 1.0
        elif self.t == self.delay:
            obs[-1] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.cue, self.t = int(self.np_random.integers(self.cues)), 0
        return self._observe(), {}

    def step(self, action):
        if self.t == self.delay:
            return self._observe(), 1.0 if int(action) == self.cue else -1.0, True, False, {}
        self.t += 1
        return self._observe(), 0.0, False, False, {}


class Reach(gym.Env):
    """A point in the square [-1, 1]^2 and a goal drawn uniformly in it: the observation is
    (position, goal), the action a velocity in [-1, 1]^2 that moves the point ``speed`` times
    it (held in the square). Each step costs the distance left; arriving within ``radius``
    of the goal ends the episode with ``bonus``. The time limit (registered: 50 steps) ends
    it otherwise: a truncation, not a termination."""

    def __init__(self, speed: float = 0.1, radius: float = 0.1, bonus: float = 10.0) -> None:
        self.speed, self.radius, self.bonus = speed, radius, bonus
        self.observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)

    def _obs(self) -> np.ndarray:
        return np.concatenate([self.position, self.goal]).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position = self.np_random.uniform(-1.0, 1.0, 2)
        self.goal = self.np_random.uniform(-1.0, 1.0, 2)
        return self._obs(), {}

    def step(self, action):
        velocity = np.clip(np.asarray(action, np.float64), -1.0, 1.0)
        self.position = np.clip(self.position + self.speed * velocity, -1.0, 1.0)
        distance = float(np.linalg.norm(self.goal - self.position))
        if distance < self.radius:
            return self._obs(), self.bonus, True, False, {}
        return self._obs(), -distance, False, False, {}


class SlowSteps(gym.Wrapper):
    """Sleeps ``seconds`` in every step."""

    def __init__(self, env: gym.Env, seconds: float) -> None:
        super().__init__(env)
        self.seconds = seconds

    def step(self, action):
        time.sleep(self.seconds)
        return self.env.step(action)


def _register(env_id: str, entry_point, **kwargs) -> None:
    if env_id not in gym.registry:  # imported twice (as tests.envs and by path): once is enough
        gym.register(env_id, entry_point=entry_point, **kwargs)


_register("apex-test/Corridor-v0", Corridor, max_episode_steps=21)
_register("apex-test/DictGoal-v0", DictGoal, max_episode_steps=6)
_register("apex-test/MultiDial-v0", MultiDial)
_register("apex-test/Catch-v0", Catch)
_register("apex-test/Recall-v0", Recall)
_register("apex-test/Reach-v0", Reach, max_episode_steps=50)
