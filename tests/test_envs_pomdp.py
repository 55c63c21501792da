"""The POMDP suite: API conformance, determinism, clear errors, and the optimal values stated in the docstrings."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers seqrl/)
from envs.pomdp import (
    ShortCorridorEnv,
    TigerEnv,
    TMazeEnv,
    tiger_optimal_value,
    tiger_q_values,
    true_pass_probability,
)

ENV_NAMES = ["ThreeStateLine", "ShortCorridor", "TwoDoors", "TMaze", "MaskedCartPole", "Tiger"]
ENV_IDS = [f"seqrl/{name}-v0" for name in ENV_NAMES]


def rollout_returns(env, policy, episodes: int, seed: int = 0):
    """Run `policy(obs, t, history) -> action` for `episodes` episodes; return (returns, lengths, final infos)."""
    returns, lengths, infos = [], [], []
    for ep in range(episodes):
        obs, info = env.reset(seed=seed + ep)
        done, total, t, history = False, 0.0, 0, []
        while not done:
            action = policy(obs, t, history)
            obs, reward, terminated, truncated, info = env.step(action)
            history.append((action, obs, reward))
            total, t, done = total + reward, t + 1, terminated or truncated
        returns.append(total)
        lengths.append(t)
        infos.append(info)
    return np.array(returns), np.array(lengths), infos


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_env_and_ansi_render(env_id):
    env = gym.make(env_id, render_mode="ansi")
    check_env(env.unwrapped, skip_render_check=False)
    env.reset(seed=0)
    assert isinstance(env.render(), str)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_same_seed_same_trajectory(env_id):
    def trajectory(seed):
        env = gym.make(env_id)
        env.action_space.seed(seed)
        obs, _ = env.reset(seed=seed)
        out = [obs]
        for _ in range(30):
            obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            out += [obs, reward]
            if terminated or truncated:
                obs, _ = env.reset()
                out.append(obs)
        return np.concatenate([np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in out])

    np.testing.assert_array_equal(trajectory(3), trajectory(3))


@pytest.mark.parametrize("env_id", ENV_IDS)
@pytest.mark.parametrize("junk", [-1, 99, 1.5, "left", None])
def test_junk_action_gives_clear_error(env_id, junk):
    env = gym.make(env_id, disable_env_checker=True)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="invalid action"):
        env.step(junk)


def test_three_state_line_values():
    env = gym.make("seqrl/ThreeStateLine-v0").unwrapped
    rng = np.random.default_rng(0)
    n = 20_000
    # optimal memoryless policy: right with p = 1/2 -> 2 steps on average (Problem 21.1)
    returns, lengths, _ = rollout_returns(env, lambda o, t, h: int(rng.random() < 0.5), n)
    assert abs(lengths.mean() - ThreeStateLineValue.memoryless) < 4 * lengths.std() / np.sqrt(n)
    # with memory of its own actions: right, then left -> 1.5 steps
    _, lengths, _ = rollout_returns(env, lambda o, t, h: 1 if t == 0 else 0, 4000)
    assert set(lengths) == {1, 2} and abs(lengths.mean() - 1.5) < 0.05
    # a deterministic memoryless policy fails (hits the time limit) in half the episodes
    _, lengths, _ = rollout_returns(env, lambda o, t, h: 1, 4000)
    assert abs((lengths == env.max_steps).mean() - 0.5) < 0.05


class ThreeStateLineValue:
    memoryless = sum(k * 0.5**k for k in range(1, 20)) + 20 * 0.5**19  # E[min(Geometric(1/2), 20)] ~= 2


def test_two_doors_markov_model_pathology():
    env = gym.make("seqrl/TwoDoors-v0").unwrapped
    # data from a uniformly random memoryless policy
    rng = np.random.default_rng(1)
    returns, _, _ = rollout_returns(env, lambda o, t, h: int(rng.integers(2)), 20_000)
    assert abs(returns.mean() - env.OPTIMAL_MEMORYLESS_RETURN) < 0.01
    # the memory policy: try left, on failure try right
    returns, _, _ = rollout_returns(env, lambda o, t, h: 0 if t == 0 else 1, 20_000)
    assert abs(returns.mean() - env.OPTIMAL_MEMORY_RETURN) < 0.01
    # Markovian MLE p(passed | in_room, left) = 1/2, but the truth after a failed left try is 0
    counts = np.zeros((2, 2))  # (action, passed)
    for ep in range(4000):
        env.reset(seed=ep)
        done = False
        while not done:
            a = int(rng.integers(2))
            obs, _, terminated, truncated, info = env.step(a)
            counts[a, int(obs[1])] += 1
            done = terminated or truncated
    p_markov = counts[:, 1] / counts.sum(1)
    # random tries: each try passes with probability 1/2, independently of the door
    np.testing.assert_allclose(p_markov, 0.5, atol=0.03)
    assert true_pass_probability({0}, 0) == 0.0 and true_pass_probability({0}, 1) == 1.0
    assert true_pass_probability(set(), 0) == 0.5


@pytest.mark.parametrize("length", [1, 5, 10])
def test_tmaze_optimal_and_memoryless(length):
    env = TMazeEnv(corridor_length=length)

    def optimal(obs, t, history):
        if t < length:
            return TMazeEnv.EAST
        first_obs_up = history_first_obs["up"]
        return TMazeEnv.NORTH if first_obs_up else TMazeEnv.SOUTH

    returns, successes = [], []
    for ep in range(200):
        obs, info = env.reset(seed=ep)
        history_first_obs = {"up": bool(np.array_equal(obs, [0, 1, 1]))}
        assert history_first_obs["up"] == (info["cue"] == TMazeEnv.CUE_UP)
        total, t, done = 0.0, 0, False
        while not done:
            obs, r, terminated, truncated, info = env.step(optimal(obs, t, None))
            total, t, done = total + r, t + 1, terminated or truncated
        returns.append(total)
        successes.append(info["success"])
    assert np.allclose(returns, env.optimal_return()) and all(successes)

    rng = np.random.default_rng(0)
    memoryless = lambda o, t, h: TMazeEnv.EAST if o[0] == 1 or o[2] == 1 else rng.choice([0, 2])  # noqa: E731
    returns, _, infos = rollout_returns(env, memoryless, 4000)
    assert abs(np.mean([i["success"] for i in infos]) - 0.5) < 0.04
    assert abs(returns.mean() - env.memoryless_return()) < 0.15


def test_tmaze_info_state_is_the_state_after_the_step():
    env = TMazeEnv(corridor_length=3)
    _, info = env.reset(seed=0)
    assert info["state"] == (0, env.cue)
    for expected_pos in (1, 2, 3, 3):  # the last EAST bumps the junction's east wall
        _, _, _, _, info = env.step(TMazeEnv.EAST)
        assert info["state"] == (expected_pos, env.cue) and env.pos == expected_pos
    _, _, _, _, info = env.step(TMazeEnv.WEST)
    assert info["state"] == (2, env.cue)


def test_tmaze_cue_only_at_first_step():
    env = TMazeEnv(corridor_length=3)
    obs, _ = env.reset(seed=0)
    assert obs.tolist() in ([0, 1, 1], [1, 1, 0])
    obs, *_ = env.step(TMazeEnv.WEST)  # bump the west wall: still position 0, but the cue is gone
    assert obs.tolist() == [1, 0, 1]
    for _ in range(3):
        obs, *_ = env.step(TMazeEnv.EAST)
    assert obs.tolist() == [0, 1, 0]


def test_masked_cartpole_drops_velocities():
    env = gym.make("seqrl/MaskedCartPole-v0")
    obs, info = env.reset(seed=0)
    assert obs.shape == (2,)
    np.testing.assert_allclose(obs, info["state"][[0, 2]])
    full = gym.make("CartPole-v1")
    full_obs, _ = full.reset(seed=0)
    np.testing.assert_allclose(obs, full_obs[[0, 2]])
    total, done = 0.0, False
    while not done:
        obs, r, terminated, truncated, info = env.step(0)
        total, done = total + r, terminated or truncated
    assert 5 <= total < 500 and terminated


def test_tiger_dp_matches_threshold_policy_and_memoryless_bound():
    env = TigerEnv()
    v_star = tiger_optimal_value(env.max_steps)
    assert v_star > 0 > TigerEnv.MEMORYLESS_BEST_RETURN

    def count_policy(obs, t, history):  # greedy in the DP's Q-values of the count difference d
        d = sum(1 if o[0] else -1 for a, o, _ in history if a == TigerEnv.LISTEN)
        return int(np.argmax(tiger_q_values(d, env.max_steps - t)))

    n = 20_000
    returns, _, _ = rollout_returns(env, count_policy, n)
    assert abs(returns.mean() - v_star) < 4 * returns.std() / np.sqrt(n)

    def listen_once(obs, t, history):
        if obs[2] == 1:
            return TigerEnv.LISTEN
        return TigerEnv.OPEN_RIGHT if obs[0] == 1 else TigerEnv.OPEN_LEFT

    returns, _, _ = rollout_returns(env, listen_once, n)
    assert abs(returns.mean() - TigerEnv.MEMORYLESS_BEST_RETURN) < 4 * returns.std() / np.sqrt(n)


def short_corridor_chain(env: ShortCorridorEnv, p_right: float) -> np.ndarray:
    """Transition matrix among the non-goal cells under "right with probability p", read off the env itself."""
    chain = np.zeros((3, 3))
    for cell in range(3):
        for action, prob in ((ShortCorridorEnv.RIGHT, p_right), (ShortCorridorEnv.LEFT, 1.0 - p_right)):
            env.reset(seed=0)
            env.state = cell
            _, reward, terminated, _, info = env.step(action)
            assert reward == -1.0 and terminated == (info["state"] == ShortCorridorEnv.GOAL)
            if not terminated:
                chain[cell, info["state"]] += prob
    return chain


def test_short_corridor_dynamics():
    env = ShortCorridorEnv()
    obs, info = env.reset(seed=0)
    assert info["state"] == 0 and obs.tolist() == [1.0]
    moves = {(0, 1): 1, (0, 0): 0, (1, 1): 0, (1, 0): 2, (2, 1): 3, (2, 0): 1}  # (cell, action) -> next cell
    for (cell, action), nxt in moves.items():
        env.reset(seed=0)
        env.state = cell
        obs, _, terminated, _, info = env.step(action)
        assert info["state"] == nxt and terminated == (nxt == 3) and obs.tolist() == [1.0], (cell, action)
    # with memory: right, left, right reaches the goal in 3 steps
    _, lengths, _ = rollout_returns(env, lambda o, t, h: [1, 0, 1][t], 3)
    assert lengths.tolist() == [3, 3, 3] and ShortCorridorEnv.OPTIMAL_MEMORY_RETURN == -3.0
    # deterministic memoryless policies never arrive: truncated at the time limit
    for action in (0, 1):
        returns, lengths, _ = rollout_returns(env, lambda o, t, h, a=action: a, 2)
        assert lengths.tolist() == [env.max_steps] * 2 and returns.tolist() == [-env.max_steps] * 2


def test_short_corridor_best_memoryless_policy_exactly():
    """Exact linear solve of v = -1 + P_p v on the env's own transitions, over a fine grid of p = p(right)."""
    env = ShortCorridorEnv()
    grid = np.linspace(0.001, 0.999, 9981)  # step 1e-4
    values = np.array([np.linalg.solve(np.eye(3) - short_corridor_chain(env, p), -np.ones(3))[0] for p in grid])
    best = grid[values.argmax()]
    assert best == pytest.approx(2 - np.sqrt(2), abs=2e-4)  # 0.5858
    assert values.max() == pytest.approx(-11.6569, abs=1e-3)
    assert values.max() == pytest.approx(ShortCorridorEnv.OPTIMAL_MEMORYLESS_RETURN, abs=1e-6)
    np.testing.assert_allclose(values, [ShortCorridorEnv.memoryless_value(p) for p in grid], rtol=1e-9)
    # the time limit does not distort this: finite-horizon value after max_steps steps, under p*
    chain = short_corridor_chain(env, ShortCorridorEnv.OPTIMAL_MEMORYLESS_P_RIGHT)
    v_limit = np.zeros(3)
    for _ in range(env.max_steps):
        v_limit = -1.0 + chain @ v_limit
    assert abs(v_limit[0] - ShortCorridorEnv.OPTIMAL_MEMORYLESS_RETURN) < 1e-3
    near = np.linspace(0.55, 0.62, 701)  # the truncated optimum is still at p* (to 1e-4)
    truncated = []
    for p in near:
        chain, v = short_corridor_chain(env, p), np.zeros(3)
        for _ in range(env.max_steps):
            v = -1.0 + chain @ v
        truncated.append(v[0])
    assert near[int(np.argmax(truncated))] == pytest.approx(2 - np.sqrt(2), abs=2e-4)
    assert ShortCorridorEnv.memoryless_value(0.5) == pytest.approx(-12.0)  # the uniform policy is clearly worse
    # Monte Carlo with the env itself (truncation included)
    rng = np.random.default_rng(0)
    n = 20_000
    returns, _, _ = rollout_returns(env, lambda o, t, h: int(rng.random() < 2 - np.sqrt(2)), n)
    assert abs(returns.mean() - ShortCorridorEnv.OPTIMAL_MEMORYLESS_RETURN) < 4 * returns.std() / np.sqrt(n)
