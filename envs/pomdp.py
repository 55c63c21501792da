"""The POMDP suite: six small partially observed environments whose optimal values are known exactly.

Every env is a `gymnasium.Env` with seeded `reset(seed=...)`, `render_mode="ansi"`, a Box observation (one-hot
codes for discrete observations), a Discrete action space, and its own time limit (reported as `truncated`).
An action outside the action space raises a `ValueError` that names the space. `info["state"]` exposes the
hidden state for analysis and tests; agents must not read it.

| id                         | memoryless optimum                  | optimum with memory                |
|----------------------------|-------------------------------------|------------------------------------|
| seqrl/ThreeStateLine-v0    | p(right)=1/2, 2 steps (return -2)   | right then left, 1.5 steps (-1.5)  |
| seqrl/ShortCorridor-v0     | p(right)=2-sqrt(2)~0.586, -11.657   | right, left, right: -3             |
| seqrl/TwoDoors-v0          | p(left)=1/2, return 0.9             | other door after a failure, 0.95   |
| seqrl/TMaze-v0 (length L)  | success 1/2, return 1.5 - 0.1 L     | success 1, return 4 - 0.1 L        |
| seqrl/MaskedCartPole-v0    | far below 500                       | 500                                |
| seqrl/Tiger-v0 (horizon 10)| -7.5 (listen once, then open)       | `tiger_optimal_value()` = 5.01  |

References: Problems 21.1 and 21.2 of the lecture (../shared/seeds); R. Sutton, A. Barto, "Reinforcement Learning:
An Introduction", 2nd ed. 2018, Example 13.1 (short corridor); B. Bakker, "Reinforcement Learning with
Long Short-Term Memory", NeurIPS 2001 (T-maze); L. Kaelbling, M. Littman, A. Cassandra, "Planning and acting in
partially observable stochastic domains", AIJ 1998 (Tiger); POPGym (Morad et al. 2023) for masked CartPole.
"""

from functools import cache

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


def _check_action(space: spaces.Discrete, action, env_name: str) -> int:
    """Return `action` as an int, or raise a clear error if it is not an integer in the Discrete `space`."""
    if isinstance(action, (int, np.integer)) and not isinstance(action, bool):  # the common case, checked cheaply
        if space.start <= action < space.start + space.n:
            return int(action)
    value = np.asarray(action) if isinstance(action, (int, np.integer, np.ndarray)) else None
    if value is None or value.shape != () or value.dtype.kind not in "iu" or not space.contains(int(value)):
        raise ValueError(f"{env_name}: invalid action {action!r}; expected an integer in {{0, ..., {space.n - 1}}}")
    return int(value)


class ThreeStateLineEnv(gym.Env):
    """Lecture Problem 21.1: states A - B - C in a line, the observation is the constant 1.

    Start in A or C with probability 1/2; actions 0 = left, 1 = right; moving into a wall leaves you in place;
    reward -1 per step; the episode terminates on reaching B; time limit `max_steps` (20).

    Optimal values. A memoryless policy that goes right with probability p needs 1/p steps from A and 1/(1-p)
    from C, T(p) = (1/p + 1/(1-p))/2, minimized at p = 1/2 with T = 2 (return -2; the time limit trims this
    by 2^-19). A deterministic memoryless policy never reaches B from one of the two starts (half the episodes
    fail, return -20). With memory of its own actions the agent plays "right, then left": 1.5 steps (-1.5).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    A, B, C = 0, 1, 2
    LEFT, RIGHT = 0, 1
    OPTIMAL_MEMORYLESS_STEPS = 2.0
    OPTIMAL_MEMORY_STEPS = 1.5

    def __init__(self, render_mode: str | None = None, max_steps: int = 20):
        self.render_mode = render_mode
        self.max_steps = max_steps
        self.observation_space = spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)

    def _obs(self) -> np.ndarray:
        return np.ones(1, dtype=np.float32)  # uninformative: the same in every state

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.state = self.A if self.np_random.random() < 0.5 else self.C
        self.t = 0
        return self._obs(), {"state": self.state}

    def step(self, action):
        action = _check_action(self.action_space, action, "ThreeStateLine")
        self.state = min(max(self.state + (1 if action == self.RIGHT else -1), self.A), self.C)
        self.t += 1
        terminated = self.state == self.B
        truncated = not terminated and self.t >= self.max_steps
        return self._obs(), -1.0, terminated, truncated, {"state": self.state}

    def render(self):
        cells = ["A", "B", "C"]
        cells[self.state] = f"[{cells[self.state]}]"
        return " - ".join(cells) + "\n"


class ShortCorridorEnv(gym.Env):
    """Sutton & Barto (2nd ed.), Example 13.1: the short corridor with switched actions.

    Cells 0 - 1 - 2 - G in a line; the episode starts in cell 0 and terminates on reaching the goal G (cell 3).
    Actions 0 = left, 1 = right. In cells 0 and 2 they move as labelled (left in cell 0 bumps the wall and stays);
    in cell 1 they are reversed (right moves to cell 0, left to cell 2). Reward -1 per step. The three non-goal
    cells give the same observation (the constant 1), so a memoryless policy is one number, p = p(right).

    Optimal values. With v_s the expected return from cell s under p, the Bellman equations
    v_0 = -1 + p v_1 + (1-p) v_0, v_1 = -1 + p v_0 + (1-p) v_2, v_2 = -1 + (1-p) v_1 (right from cell 2 ends)
    give J(p) = v_0 = -2 (2 - p) / (p (1 - p)), maximized at p* = 2 - sqrt(2) ~ 0.586 with J(p*) ~ -11.657.
    Both deterministic memoryless policies never arrive (always right: 0 <-> 1 forever; always left: stuck at
    the wall): return -`max_steps`. With memory (of the steps taken) "right, left, right" takes 3 steps (-3).

    Time limit `max_steps` = 100 (truncation): under p* an episode is still running after 100 steps with
    probability 2.8e-5, and the truncated value -11.6566 differs from J(p*) by 3e-4 (checked in the tests),
    while a near-deterministic policy shows up clearly as episodes of 100 steps.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    LEFT, RIGHT = 0, 1
    GOAL = 3
    SWITCHED = 1  # the cell whose actions are reversed
    OPTIMAL_MEMORYLESS_P_RIGHT = 2.0 - np.sqrt(2.0)
    OPTIMAL_MEMORYLESS_RETURN = -2.0 * np.sqrt(2.0) / ((2.0 - np.sqrt(2.0)) * (np.sqrt(2.0) - 1.0))  # -11.657
    OPTIMAL_MEMORY_RETURN = -3.0

    def __init__(self, render_mode: str | None = None, max_steps: int = 100):
        if max_steps < 1:
            raise ValueError(f"ShortCorridor: max_steps must be >= 1, got {max_steps}")
        self.render_mode = render_mode
        self.max_steps = max_steps
        self.observation_space = spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)

    @staticmethod
    def memoryless_value(p_right: float) -> float:
        """J(p) = -2 (2 - p) / (p (1 - p)), the expected return of "right with probability p" (no time limit)."""
        if not 0.0 < p_right < 1.0:
            return -np.inf  # a deterministic memoryless policy never reaches the goal
        return -2.0 * (2.0 - p_right) / (p_right * (1.0 - p_right))

    def _obs(self) -> np.ndarray:
        return np.ones(1, dtype=np.float32)  # uninformative: the same in every cell

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.state, self.t = 0, 0
        return self._obs(), {"state": self.state}

    def step(self, action):
        action = _check_action(self.action_space, action, "ShortCorridor")
        move = 1 if action == self.RIGHT else -1
        if self.state == self.SWITCHED:
            move = -move
        self.state = max(self.state + move, 0)
        self.t += 1
        terminated = self.state == self.GOAL
        truncated = not terminated and self.t >= self.max_steps
        return self._obs(), -1.0, terminated, truncated, {"state": self.state}

    def render(self):
        cells = ["0", "1*", "2", "G"]  # * marks the cell with reversed actions
        cells[self.state] = f"[{cells[self.state]}]"
        return f"t={self.t} " + " - ".join(cells) + "\n"


class TwoDoorsEnv(gym.Env):
    """Lecture Problem 21.2: one of two doors is unlocked (1/2 each, per episode); the lock is never observed.

    Observation: one-hot [in_room, passed]. Actions: 0 = try the left door, 1 = try the right door. Trying the
    locked door leaves you in the room with the same observation and reward `fail_reward` (-0.1); trying the
    unlocked one passes (observation `passed`, reward `pass_reward` = +1, terminated). Time limit `max_steps`.

    The pathology. A Markovian model fit by maximum likelihood learns p(passed | in_room, left) = 1/2, and so
    predicts that retrying the same door after a failure passes with probability 1/2 (and within k tries with
    1 - 2^-k); the truth, given the history, is 0 for the same door and 1 for the other (`true_pass_probability`).

    Optimal values: with memory, "try a door, on failure the other one": return 0.5*1 + 0.5*(1 - 0.1) = 0.95.
    Memoryless: every try passes with probability 1/2 whatever the door, so E[failures] = 1 with p(left) = 1/2,
    return 0.9; a deterministic memoryless policy is stuck behind the locked door in half the episodes.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    LEFT, RIGHT = 0, 1
    OPTIMAL_MEMORY_RETURN = 0.95
    OPTIMAL_MEMORYLESS_RETURN = 0.9

    def __init__(
        self, render_mode: str | None = None, max_steps: int = 10, pass_reward: float = 1.0, fail_reward: float = -0.1
    ):
        self.render_mode = render_mode
        self.max_steps = max_steps
        self.pass_reward, self.fail_reward = pass_reward, fail_reward
        self.observation_space = spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)

    def _obs(self) -> np.ndarray:
        return np.array([0.0, 1.0] if self.passed else [1.0, 0.0], dtype=np.float32)

    def _info(self) -> dict:
        return {"state": self.unlocked, "unlocked_door": self.unlocked, "failed_doors": sorted(self.failed)}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.unlocked = int(self.np_random.integers(2))
        self.passed, self.failed, self.t = False, set(), 0
        return self._obs(), self._info()

    def step(self, action):
        action = _check_action(self.action_space, action, "TwoDoors")
        self.t += 1
        self.passed = action == self.unlocked
        if not self.passed:
            self.failed.add(action)
        reward = self.pass_reward if self.passed else self.fail_reward
        truncated = not self.passed and self.t >= self.max_steps
        return self._obs(), reward, self.passed, truncated, self._info()

    def render(self):
        return f"t={self.t} unlocked={'LR'[self.unlocked]} tried={self.failed} passed={self.passed}\n"


def true_pass_probability(failed_doors: set[int] | list[int], door: int) -> float:
    """p(pass | history, try `door`) in TwoDoors, where `failed_doors` are the doors already tried in vain."""
    failed = set(failed_doors)
    if door in failed:
        return 0.0  # "no matter how many times you tried, it'll remain locked"
    if failed:
        return 1.0  # the other door failed, so this one is the unlocked one
    return 0.5


class TMazeEnv(gym.Env):
    """Bakker's T-maze: a cue seen only at the first step decides the correct turn `corridor_length` steps later.

    Positions 0..L along a corridor (L = `corridor_length`, default 10) end in a junction at L. Observation (3
    bits, as in Bakker 2001): at the start [0,1,1] (cue "up") or [1,1,0] (cue "down"), in the corridor [1,0,1],
    at the junction [0,1,0]. Actions: 0 = north, 1 = east, 2 = south, 3 = west; moves into walls leave the
    agent in place. Going north/south at the junction ends the episode: +4 if it matches the cue, -1 otherwise.
    Every other step costs -0.1. Time limit 3 (L + 1) + 10 steps by default (`max_steps`).

    Optimal values: walk east L steps (-0.1 each) then turn right: return 4 - 0.1 L, success 1 (3.0 for L=10).
    Without memory of the cue the turn is a coin flip: success 1/2, return 1.5 - 0.1 L (0.5 for L=10).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    NORTH, EAST, SOUTH, WEST = 0, 1, 2, 3
    GOAL_REWARD, WRONG_REWARD, STEP_REWARD = 4.0, -1.0, -0.1
    CUE_UP, CUE_DOWN = 0, 1
    _OBS = {
        "start_up": [0.0, 1.0, 1.0],
        "start_down": [1.0, 1.0, 0.0],
        "corridor": [1.0, 0.0, 1.0],
        "junction": [0.0, 1.0, 0.0],
    }

    def __init__(self, render_mode: str | None = None, corridor_length: int = 10, max_steps: int | None = None):
        if corridor_length < 1:
            raise ValueError(f"TMaze: corridor_length must be >= 1, got {corridor_length}")
        self.render_mode = render_mode
        self.corridor_length = corridor_length
        self.max_steps = max_steps if max_steps is not None else 3 * (corridor_length + 1) + 10
        self.observation_space = spaces.Box(0.0, 1.0, shape=(3,), dtype=np.float32)
        self.action_space = spaces.Discrete(4)

    def optimal_return(self) -> float:
        return self.GOAL_REWARD + self.STEP_REWARD * self.corridor_length

    def memoryless_return(self) -> float:
        return 0.5 * (self.GOAL_REWARD + self.WRONG_REWARD) + self.STEP_REWARD * self.corridor_length

    def _obs(self) -> np.ndarray:
        if self.pos == self.corridor_length:
            key = "junction"
        elif self.pos == 0 and self.t == 0:
            key = "start_up" if self.cue == self.CUE_UP else "start_down"
        else:
            key = "corridor"
        return np.array(self._OBS[key], dtype=np.float32)

    def _info(self) -> dict:
        return {"state": (self.pos, self.cue), "cue": self.cue}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.cue = int(self.np_random.integers(2))
        self.pos, self.t = 0, 0
        return self._obs(), self._info()

    def step(self, action):
        action = _check_action(self.action_space, action, "TMaze")
        self.t += 1
        terminated, success = False, None
        if self.pos == self.corridor_length and action in (self.NORTH, self.SOUTH):
            success = (action == self.NORTH) == (self.cue == self.CUE_UP)
            reward = self.GOAL_REWARD if success else self.WRONG_REWARD
            terminated = True
        else:
            reward = self.STEP_REWARD
            if action == self.EAST:
                self.pos = min(self.pos + 1, self.corridor_length)
            elif action == self.WEST:
                self.pos = max(self.pos - 1, 0)
        truncated = not terminated and self.t >= self.max_steps
        info = self._info()  # built after the move: info["state"] is the state the returned obs belongs to
        if terminated or truncated:
            info["success"] = bool(success)
        return self._obs(), reward, terminated, truncated, info

    def render(self):
        corridor = ["."] * (self.corridor_length + 1)
        corridor[self.pos] = "@"
        return f"cue={'up' if self.cue == self.CUE_UP else 'down'} " + "".join(corridor) + "T\n"


class MaskedCartPoleEnv(CartPoleEnv):
    """CartPole-v1 whose observation keeps the cart position and the pole angle and drops both velocities.

    The velocities are what makes CartPole Markov; from single frames a policy cannot tell which way the pole
    is falling. Reward +1 per step, time limit 500 (the optimum, also with memory: velocities are
    finite differences of two consecutive frames). A memoryless policy stays far below 500.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 50}
    KEPT = np.array([0, 2])  # indices of (x, theta) in CartPole's (x, x_dot, theta, theta_dot)

    def __init__(self, render_mode: str | None = None, max_steps: int = 500):
        super().__init__(render_mode=None)
        self.render_mode = render_mode
        self.max_steps = max_steps
        full = self.observation_space
        self.observation_space = spaces.Box(full.low[self.KEPT], full.high[self.KEPT], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = super().reset(seed=seed, options=options)
        self.t = 0
        return obs[self.KEPT], {**info, "state": obs.copy()}

    def step(self, action):
        action = _check_action(self.action_space, action, "MaskedCartPole")
        obs, reward, terminated, _, info = super().step(action)
        self.t += 1
        truncated = not terminated and self.t >= self.max_steps
        return obs[self.KEPT], float(reward), terminated, truncated, {**info, "state": obs.copy()}

    def render(self):
        x, _, theta, _ = self.state
        return f"t={self.t} x={x:+.3f} theta={theta:+.3f}\n"


class TigerEnv(gym.Env):
    """The Tiger problem: a tiger hides behind the left or right door (1/2 each, never observed directly).

    Actions: 0 = listen (reward -1; you hear the tiger on its true side with probability 0.85), 1 = open left,
    2 = open right. Opening the tiger's door gives -100, the other door +10; opening ends the episode. The
    horizon is `max_steps` (10) decisions. Observation one-hot [hear_left, hear_right, nothing] (`nothing` at the
    start). A memoryless policy acts on the last sound only; its best is "listen once, open the other door":
    -1 + 0.85*10 - 0.15*100 = -7.5. With memory the agent listens until the counts of left and right differ by
    enough, which earns `tiger_optimal_value(10)` = 5.01 (exact dynamic programming over the belief, below).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    LISTEN, OPEN_LEFT, OPEN_RIGHT = 0, 1, 2
    TIGER_LEFT, TIGER_RIGHT = 0, 1
    MEMORYLESS_BEST_RETURN = -7.5

    def __init__(
        self,
        render_mode: str | None = None,
        max_steps: int = 10,
        listen_accuracy: float = 0.85,
        listen_reward: float = -1.0,
        tiger_reward: float = -100.0,
        treasure_reward: float = 10.0,
    ):
        self.render_mode = render_mode
        self.max_steps = max_steps
        self.listen_accuracy = listen_accuracy
        self.listen_reward, self.tiger_reward, self.treasure_reward = listen_reward, tiger_reward, treasure_reward
        self.observation_space = spaces.Box(0.0, 1.0, shape=(3,), dtype=np.float32)
        self.action_space = spaces.Discrete(3)

    def optimal_value(self) -> float:
        consts = (self.listen_accuracy, self.listen_reward, self.tiger_reward, self.treasure_reward)
        return tiger_optimal_value(self.max_steps, *consts)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.tiger = int(self.np_random.integers(2))
        self.t, self.last = 0, None
        return np.array([0.0, 0.0, 1.0], dtype=np.float32), {"state": self.tiger}

    def step(self, action):
        action = _check_action(self.action_space, action, "Tiger")
        self.t += 1
        obs = np.array([0.0, 0.0, 1.0], dtype=np.float32)
        terminated, info = False, {"state": self.tiger, "opened": action != self.LISTEN}
        if action == self.LISTEN:
            reward = self.listen_reward
            heard = self.tiger if self.np_random.random() < self.listen_accuracy else 1 - self.tiger
            obs = np.eye(3, dtype=np.float32)[heard]
        else:
            opened = self.TIGER_LEFT if action == self.OPEN_LEFT else self.TIGER_RIGHT
            reward = self.tiger_reward if opened == self.tiger else self.treasure_reward
            terminated, info["success"] = True, opened != self.tiger
        self.last = action
        truncated = not terminated and self.t >= self.max_steps
        if truncated:
            info["success"] = False
        return obs, reward, terminated, truncated, info

    def render(self):
        return f"t={self.t} tiger={'LR'[self.tiger]} last_action={self.last}\n"


@cache
def tiger_q_values(
    d: int,
    steps_left: int,
    accuracy: float = 0.85,
    listen_reward: float = -1.0,
    tiger_reward: float = -100.0,
    treasure_reward: float = 10.0,
) -> tuple[float, float, float]:
    """Exact optimal Q-values (listen, open left, open right) of Tiger, by dynamic programming over the belief.

    The belief after n_left and n_right "heard left/right" sounds depends only on d = n_left - n_right:
    p(tiger left | d) = a^d / (a^d + (1-a)^d) with a = accuracy. `steps_left` decisions remain (>= 1).
    """
    consts = (accuracy, listen_reward, tiger_reward, treasure_reward)
    b = accuracy ** max(d, 0) * (1 - accuracy) ** max(-d, 0)
    b = b / (b + accuracy ** max(-d, 0) * (1 - accuracy) ** max(d, 0))  # p(tiger left | d)
    open_left = b * tiger_reward + (1 - b) * treasure_reward
    open_right = (1 - b) * tiger_reward + b * treasure_reward
    listen = listen_reward
    if steps_left > 1:
        p_hear_left = b * accuracy + (1 - b) * (1 - accuracy)
        listen += p_hear_left * max(tiger_q_values(d + 1, steps_left - 1, *consts))
        listen += (1 - p_hear_left) * max(tiger_q_values(d - 1, steps_left - 1, *consts))
    return listen, open_left, open_right


def tiger_optimal_value(horizon: int = 10, *consts: float) -> float:
    """Optimal expected return of Tiger with `horizon` decisions (5.01 for the defaults)."""
    return max(tiger_q_values(0, horizon, *consts))
