"""Small envs with structured observation spaces (MultiDiscrete, Dict, Tuple), for the scripts' space encoding.

POPGym tasks (CountRecall, Battleship, ...) observe `MultiDiscrete` spaces, and other suites `Dict`/`Tuple` ones.
The scripts encode any of these with gymnasium's `FlattenObservation` (`spaces.flatten`): Discrete and each
MultiDiscrete component become one-hot vectors, Box is flattened, Tuple/Dict parts are concatenated (Dict in
sorted key order). These envs exercise that without a new dependency.

Dynamics are trivial on purpose: the hidden state is the step t of the episode; the observation encodes t;
action 0/1 earns reward 1 if it equals t mod 2 (learnable from the observation, so a policy can do better than
chance), 0 otherwise; the episode terminates after `EPISODE_LENGTH` steps.

Importing this module registers the ids, so scripts reach them as `tests.spaces_env:<id>` (gymnasium imports the
module named before the colon), e.g. `--env-id tests.spaces_env:SpacesDict-v0`.
"""

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import register

EPISODE_LENGTH = 6  # steps per episode (terminated)
DIGITS = (3, 4)  # MultiDiscrete nvec: the components are t mod 3 and t mod 4


class _ParityEnv(gym.Env):
    """Reward 1 for action t mod 2 at step t; subclasses define the observation of t."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, render_mode: str | None = None):
        self.render_mode = render_mode
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {"state": self.t}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"{type(self).__name__}: invalid action {action!r}; expected 0 or 1")
        reward = 1.0 if int(action) == self.t % 2 else 0.0
        self.t += 1
        return self._obs(), reward, self.t >= EPISODE_LENGTH, False, {"state": self.t}

    def render(self):
        return f"t={self.t}\n"


class MultiDiscreteObsEnv(_ParityEnv):
    """Observation MultiDiscrete([3, 4]): (t mod 3, t mod 4). Flattened: 7 one-hot bits."""

    def __init__(self, render_mode: str | None = None):
        super().__init__(render_mode)
        self.observation_space = spaces.MultiDiscrete(DIGITS)

    def _obs(self):
        return np.array([self.t % DIGITS[0], self.t % DIGITS[1]], dtype=np.int64)


class DictObsEnv(_ParityEnv):
    """Observation Dict(digits=MultiDiscrete([3, 4]), level=Box(-1, 1, (2,))): the digits of t and
    (t / L, -t / L). Flattened: 7 one-hot bits of `digits`, then the 2 floats of `level` (keys sorted)."""

    def __init__(self, render_mode: str | None = None):
        super().__init__(render_mode)
        self.observation_space = spaces.Dict(
            {"digits": spaces.MultiDiscrete(DIGITS), "level": spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)}
        )

    def _obs(self):
        level = np.array([self.t, -self.t], dtype=np.float32) / EPISODE_LENGTH
        return {"digits": np.array([self.t % DIGITS[0], self.t % DIGITS[1]], dtype=np.int64), "level": level}


class TupleObsEnv(_ParityEnv):
    """Observation Tuple(Discrete(2), MultiDiscrete([3, 4]), Box(0, 1, (1,))): t mod 2, the digits of t, t / L.
    Flattened: 2 + 7 one-hot bits, then 1 float."""

    def __init__(self, render_mode: str | None = None):
        super().__init__(render_mode)
        self.observation_space = spaces.Tuple(
            (
                spaces.Discrete(2),
                spaces.MultiDiscrete(DIGITS),
                spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32),
            )
        )

    def _obs(self):
        digits = np.array([self.t % DIGITS[0], self.t % DIGITS[1]], dtype=np.int64)
        return (self.t % 2, digits, np.array([self.t / EPISODE_LENGTH], dtype=np.float32))


class TextObsEnv(_ParityEnv):
    """An observation space the scripts cannot encode (Text), to test their clear error."""

    def __init__(self, render_mode: str | None = None):
        super().__init__(render_mode)
        self.observation_space = spaces.Text(max_length=4)

    def _obs(self):
        return str(self.t)


for _name, _cls in (
    ("MultiDiscrete", MultiDiscreteObsEnv),
    ("Dict", DictObsEnv),
    ("Tuple", TupleObsEnv),
    ("Text", TextObsEnv),
):
    if f"Spaces{_name}-v0" not in gym.registry:
        register(id=f"Spaces{_name}-v0", entry_point=_cls)

MODULE_IDS = [f"tests.spaces_env:Spaces{name}-v0" for name in ("MultiDiscrete", "Dict", "Tuple")]


def expected_flat(obs) -> np.ndarray:
    """The flat vector the scripts should see, written out by hand (independently of gymnasium's flatten)."""

    def onehot(value, n):
        out = np.zeros(n, dtype=np.float32)
        out[int(value)] = 1.0
        return out

    def digits(d):
        return np.concatenate([onehot(d[0], DIGITS[0]), onehot(d[1], DIGITS[1])])

    if isinstance(obs, dict):
        return np.concatenate([digits(obs["digits"]), obs["level"]]).astype(np.float32)
    if isinstance(obs, tuple):
        return np.concatenate([onehot(obs[0], 2), digits(obs[1]), obs[2]]).astype(np.float32)
    return digits(obs)
