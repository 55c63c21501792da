"""DQN with a frame stack: Q-learning on the last k observations of a POMDP (k = 1 is Q-learning on o).

The lecture's claim: Q-learning on raw observations is invalid in a POMDP (the value of o depends on how you got
there, and the greedy argmax is a deterministic policy, which fails where only stochastic memoryless policies are
optimal). A short window of k frames, DQN-style, is "not as terrible an idea as it seems": it recovers what the last
k observations show (velocities in MaskedCartPole), but fails once the needed information lies further back than the
window (the cue of a T-maze whose corridor is longer than k - 1 steps). This script measures all three statements.

Key equations (s_t := (o_{t-k+1}, ..., o_t), frames before the episode start are zeros; a* = argmax_a' Q(s', a')):
    y_t = sum_{j<m} gamma^j r_{t+j} + gamma^m (1 - terminated_{t+m}) Q_target(s_{t+m}, a*)   (m = n, fewer where the
          episode ends first; n = 1 with max_a' Q_target is plain DQN),   loss = mean_batch (Q(s_t, a_t) - y_t)^2

Implementation details:
1. The replay keeps one ring of single observations per env (`FrameStackReplay`) with each one's step in its episode;
   `build_stacks` builds a stack by index, zeroing frames of an earlier episode: O(capacity * obs_dim) memory.
2. gymnasium's NEXT_STEP autoreset: an episode's final observation is an ordinary slot whose "transition" into the
   reset observation is marked invalid and never sampled; nothing needs `infos["final_obs"]`.
3. The target multiplies by (1 - terminated) only: a time-limit truncation bootstraps from the final observation.
4. Sampling is uniform over (slot, env) pairs whose k-frame window is still in the ring. The n-step target [6] stops
   at a terminated step or before a slot without a transition; it is not corrected for exploratory actions.
5. Acting builds stacks from the replay's newest slots; evaluation keeps its own rolling stack (`roll_stack`), which
   the tests check against the replay's stacks.
6. Observations are flattened (one-hot for discrete parts) and divided by their bounds (`--scale-obs`, a pure scale
   so zero padding stays zero).
7. Per-env epsilon-greedy, a hard target copy after every training phase, double Q, MSE, an annealed learning rate
   and 10-step targets: a cart drifting off the track costs hundreds of steps later, and n-step targets carry that
   cost back n steps per target copy (the other settings as rl-baselines3-zoo's CartPole entry [5]).
8. The network also reads `--difference-scale` times the differences of consecutive frames: on MaskedCartPole these
   are velocities, which the raw stack shows only as changes of 1e-3 that the failing networks ignored.
9. A frame stack shows observations, not actions: in TMaze a wall bump and a step east give the same stack, and one
   wasted step pushes the cue out of the window. `--stack-actions` appends onehot(a_{t-1}) to every frame.
10. `--select-frequency N --keep-best` evaluates the greedy policy every N steps on disjoint env seeds and keeps the
   best network (as SB3's EvalCallback); the final evaluation reports the kept and the last network.
11. `--eval-only` rebuilds the env and the network from the checkpoint's args.json (`ARCH_FIELDS`).

References:
[1] V. Mnih et al., "Human-level control through deep reinforcement learning", Nature 2015 (DQN, 4-frame stack).
[2] CleanRL `dqn.py` / `dqn_atari.py` (S. Huang et al., JMLR 2022): the script order, schedule, target copies.
[3] H. van Hasselt, A. Guez, D. Silver, "Deep Reinforcement Learning with Double Q-learning", AAAI 2016.
[4] B. Bakker, "Reinforcement Learning with Long Short-Term Memory", NeurIPS 2001 (the T-maze).
[5] rl-baselines3-zoo `hyperparams/dqn.yml` (CartPole-v1), A. Raffin et al.
[6] M. Hessel et al., "Rainbow: Combining Improvements in Deep Reinforcement Learning", AAAI 2018 (n-step targets).
Details, measurements and results: docs/dqn_framestack.md.
Reproduce: python algos/dqn_framestack.py --seed 1   (MaskedCartPole, k = 4, the defaults)
"""

import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
import envs as seqrl_envs  # noqa: E402, F401  (registers the seqrl/ environments)

EVAL_SEED_STRIDE = 10_000  # eval env i of training seed s gets seed 10_000 (s + 1) + i: disjoint sets per seed
SELECT_SEED_BASE = 10**9  # evaluations during training: env seeds 1e9 + 1e7 s + global_step + i, disjoint from
SELECT_SEED_STRIDE = 10**7  # the final evaluation's and across training seeds (global_step + i < 1e7)
LATE_TRAINING_FRACTION = 0.1  # `select/late_episodic_return`: mean of the evaluations in the last 10% of the steps
LOG_EVERY_UPDATES = 100  # write losses/SPS to tensorboard every 100 gradient steps


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """use the GPU if one is available (the default runs are sized for a CPU)"""
    threads: int = 1
    """torch CPU threads: 1 lets runs side by side share the cores; more can speed up one run of a real model alone"""
    runs_dir: str = "runs"
    """folder that receives the run directory (tensorboard, summary.json, model.safetensors)"""
    eval_episodes: int = 100
    """number of evaluation episodes of the greedy policy at the end (one per evaluation env)"""
    eval_epsilon: float = 0.0
    """epsilon of the evaluation policy (0 = purely greedy, the deterministic policy the lecture talks about)"""
    eval_only: bool = False
    """skip training: load `--checkpoint` and evaluate it"""
    checkpoint: str | None = None
    """run directory or model.safetensors file to load for `--eval-only` (the env, --frame-stack, --scale-obs and
    --hidden-size come from its args.json when present)"""
    select_frequency: int = 0
    """environment steps between greedy evaluations during training (0 = none), logged as select/episodic_return;
    summary.json gets their mean over the last 10% of the steps (`select/late_episodic_return`)"""
    select_episodes: int = 10
    """episodes per evaluation during training (env seeds disjoint from the training and the final evaluation)"""
    keep_best: bool = False
    """keep the network of the best evaluation during training (ties: the later one) as the final model, like
    SB3's EvalCallback; the final evaluation runs on fresh episodes, and summary.json also reports the last
    network (`eval/last_network_episodic_return`). Needs --select-frequency"""

    # Environment
    env_id: str = "seqrl/MaskedCartPole-v0"
    """the id of the environment (any gymnasium env with a Discrete action space; observations Box, Discrete,
    MultiBinary, MultiDiscrete, or Tuple/Dict of these, flattened; also `module:EnvId`)"""
    env_kwargs: str = "{}"
    """JSON dict of keyword arguments for gym.make, e.g. '{"corridor_length": 4}' for seqrl/TMaze-v0"""
    num_envs: int = 4
    """number of parallel environments (SyncVectorEnv)"""
    frame_stack: int = 4
    """k, the number of most recent observations concatenated into the Q-network input (1 = memoryless)"""
    stack_actions: bool = False
    """append the one-hot previous action a_{t-1} to each of the k frames (zeros at the episode start), so the
    window also shows what the agent did: in TMaze a wall bump and a step east give the same observations
    (detail 9). Off by default (the Atari frame stack [1] holds frames only; with k = 1 it would add memory)"""
    scale_obs: bool = True
    """divide each Box observation dimension by its finite bound max(|low|, |high|), so inputs lie in [-1, 1]
    (MaskedCartPole: x / 4.8, theta / 0.419; a no-op for the 0/1 codes of TMaze and ThreeStateLine)"""

    # DQN
    total_timesteps: int = 100_000
    """total environment steps (summed over the parallel envs)"""
    learning_rate: float = 5e-4
    """Adam learning rate (zoo's 2.3e-3 plateaus on MaskedCartPole: the cart drifts off the track)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over training (stabilizes the final greedy policy)"""
    buffer_size: int = 100_000
    """replay capacity in transitions (summed over envs; each env gets buffer_size // num_envs slots)"""
    gamma: float = 0.995
    """discount factor (0.995, a ~200-step horizon: at 0.99 the cost of a cart drifting off the track is seen late)"""
    tau: float = 1.0
    """target network update rate (1 = hard copy)"""
    target_network_frequency: int = 256
    """environment steps between target network updates (256 = after every training phase, zoo's effective CartPole
    setting [5])"""
    batch_size: int = 128
    """minibatch size sampled from the replay (128 instead of zoo's 64: less noisy targets)"""
    start_e: float = 1.0
    """starting epsilon of the exploration schedule"""
    end_e: float = 0.04
    """final epsilon of the exploration schedule"""
    exploration_fraction: float = 0.16
    """fraction of `total_timesteps` over which epsilon decays linearly from start_e to end_e"""
    learning_starts: int = 1_000
    """environment steps collected with the schedule before the first gradient step"""
    train_frequency: int = 64
    """vector steps (of num_envs env steps each) between training phases"""
    gradient_steps: int = 64
    """gradient steps per training phase (per env step: gradient_steps / (train_frequency * num_envs)); half of zoo's
    128, enough for MaskedCartPole (docs/tuning.md)"""
    n_step: int = 10
    """n of the n-step target r_t + ... + gamma^(n-1) r_{t+n-1} + gamma^n Q_target(s_{t+n}, a*), cut at the episode
    end (1 = the DQN target; 10 carries the cost of a cart drifting off the track back ten steps a copy, detail 7)"""
    double_q: bool = True
    """use the double-Q target: the online network picks a', the target network evaluates it"""
    loss: Literal["huber", "mse"] = "mse"
    """TD loss: squared error, or Huber (smooth L1, delta 1, the Nature DQN's error clipping [1]); Huber caps the
    gradient of the rare, large terminal errors that MaskedCartPole learns from (it did markedly worse there)"""
    hidden_size: int = 256
    """width of the two hidden layers of the Q-network MLP"""
    difference_scale: float = 50.0
    """scale of the consecutive-frame differences the network also reads (0 = the raw stack), see detail 8"""

    # filled in at runtime
    obs_dim: int = 0
    """size of one flattened observation"""


def observation_scale(space: gym.spaces.Box) -> np.ndarray:
    """Per-dimension factor 1 / max(|low|, |high|) of a flat Box; 1 where a bound is infinite or both are 0.

    A pure scale (no shift), so the zero frames that pad a stack before the episode start stay zero.
    """
    bound = np.maximum(np.abs(space.low), np.abs(space.high)).astype(np.float64)  # (D,)
    usable = np.isfinite(bound) & (bound > 0)
    return np.where(usable, 1.0 / np.where(usable, bound, 1.0), 1.0).astype(np.float32)


def make_env(env_id: str, env_kwargs: dict, scale_obs: bool = False):
    """Return a thunk building one env with a flat float32 Box observation, optionally divided by its bounds
    (`observation_scale`). gymnasium's FlattenObservation encodes Discrete and each MultiDiscrete component as a
    one-hot vector and concatenates the parts of a Tuple/Dict (Dict in sorted key order)."""

    def thunk():
        env = gym.wrappers.DtypeObservation(gym.wrappers.FlattenObservation(gym.make(env_id, **env_kwargs)), np.float32)
        if scale_obs:
            space = env.observation_space
            scale = observation_scale(space)
            new_space = gym.spaces.Box(space.low * scale, space.high * scale, dtype=np.float32)
            env = gym.wrappers.TransformObservation(env, lambda o: (o * scale).astype(np.float32), new_space)
        return env

    return thunk


def eval_env_seed(seed: int) -> int:
    """First env seed of the final evaluation of training seed `seed`; episode i uses eval_env_seed(seed) + i. Blocks
    of EVAL_SEED_STRIDE seeds: disjoint across training seeds and from the training envs' seeds (seed + i)."""
    return EVAL_SEED_STRIDE * (seed + 1)


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """epsilon(t): linear from start_e to end_e over `duration` steps, then constant (CleanRL's schedule)."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


# ALGO LOGIC: stacks by index, replay, and the TD target as small pure functions
def build_stacks(
    obs_ring: np.ndarray,
    ep_step_ring: np.ndarray,
    slots: np.ndarray,
    env_ids: np.ndarray,
    k: int,
    action_ring: np.ndarray | None = None,
    num_actions: int = 0,
):
    """The k-frame stacks ending at `slots` of the rings of `env_ids`, oldest frame first, flattened.

    obs_ring: (C, N, D) observations; ep_step_ring: (C, N) step index of each observation within its episode
    (0 = the reset observation). Frame j of a stack (j = 0 oldest) lies d = k - 1 - j slots back; it is used
    if d <= ep_step[slot] (same episode) and zero otherwise. The ring wraps (slot - d) modulo C. With `action_ring`
    (C, N) (the action taken at each slot), each frame is [o, onehot(a_prev)] with a_prev the action of the slot
    before it, zeros if that lies before the episode start. Returns (B, k * D), or (B, k * (D + A)) with actions.
    """
    capacity = obs_ring.shape[0]
    back = np.arange(k - 1, -1, -1)  # (k,) how many slots back each frame lies, oldest first
    hist_slots = (slots[:, None] - back[None, :]) % capacity  # (B, k)
    ep_step = ep_step_ring[slots, env_ids][:, None]  # (B, 1)
    same_episode = back[None, :] <= ep_step  # (B, k)
    frames = obs_ring[hist_slots, env_ids[:, None]] * same_episode[..., None]  # (B, k, D)
    if action_ring is not None:
        has_prev = back[None, :] < ep_step  # (B, k) the frame's previous slot is in the same episode
        prev = action_ring[(hist_slots - 1) % capacity, env_ids[:, None]]  # (B, k)
        onehot = np.eye(num_actions, dtype=np.float32)[prev] * has_prev[..., None]  # (B, k, A)
        frames = np.concatenate([frames, onehot], axis=-1)  # (B, k, D + A)
    return frames.reshape(len(slots), -1)


def roll_stack(stack: np.ndarray, frame: np.ndarray) -> np.ndarray:
    """Shift a (N, k, F) rolling stack by one frame and append `frame` (N, F) as the newest (evaluation)."""
    return np.concatenate([stack[:, 1:], frame[:, None]], axis=1)


def eval_frame(obs: np.ndarray, prev_actions: np.ndarray | None, num_actions: int) -> np.ndarray:
    """(N, D) observations -> (N, F) frames: the observation, plus onehot(a_prev) if `prev_actions` (N,) is given
    (-1 = no previous action, at the episode start: zeros)."""
    if prev_actions is None:
        return obs
    onehot = np.eye(num_actions, dtype=np.float32)[np.maximum(prev_actions, 0)] * (prev_actions >= 0)[:, None]
    return np.concatenate([obs, onehot], axis=1).astype(np.float32)


class FrameStackReplay:
    """One ring of single observations per env; transitions are (slot, slot + 1) pairs within one episode.

    Slot i of env n holds o = obs[i, n], its step index in the episode, and, once the agent acted on it, the action,
    the reward and `terminated` of the step o -> obs[i + 1, n]. `valid[i, n]` is False for the newest slot (no
    action yet) and for the final observation of an episode (its "step" is the NEXT_STEP autoreset into the next
    episode's reset observation, which is not a transition).
    """

    def __init__(self, capacity: int, num_envs: int, obs_dim: int, k: int, num_actions: int = 0):
        if capacity < k + 2:
            raise SystemExit(f"error: replay capacity per env ({capacity}) must be >= frame_stack + 2 ({k + 2})")
        self.capacity, self.num_envs, self.k = capacity, num_envs, k
        self.num_actions = num_actions  # > 0: frames carry onehot(a_prev) (--stack-actions)
        self.obs = np.zeros((capacity, num_envs, obs_dim), dtype=np.float32)
        self.ep_step = np.zeros((capacity, num_envs), dtype=np.int64)
        self.actions = np.zeros((capacity, num_envs), dtype=np.int64)
        self.rewards = np.zeros((capacity, num_envs), dtype=np.float32)
        self.terminated = np.zeros((capacity, num_envs), dtype=np.float32)
        self.valid = np.zeros((capacity, num_envs), dtype=bool)
        self.pos, self.size = -1, 0  # newest slot, number of filled slots
        self.env_ids = np.arange(num_envs)

    def _write_obs(self, obs: np.ndarray, ep_step: np.ndarray) -> None:
        self.pos = (self.pos + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        self.obs[self.pos], self.ep_step[self.pos], self.valid[self.pos] = obs, ep_step, False

    def reset(self, obs: np.ndarray) -> None:
        """Store the first observations (N, D) after envs.reset()."""
        self._write_obs(obs, np.zeros(self.num_envs, dtype=np.int64))

    def add(self, actions, rewards, terminated, next_obs, autoreset) -> None:
        """Record one vector step taken from the newest slot.

        `autoreset` (N,) is True where the previous step ended the episode, i.e. this step was the NEXT_STEP reset:
        the newest slot is a final observation, its transition is invalid, and `next_obs` starts a new episode.
        `truncated` is not stored: a truncated transition is an ordinary one (it bootstraps from the final obs).
        """
        p = self.pos
        self.actions[p], self.rewards[p], self.terminated[p] = actions, rewards, terminated
        self.valid[p] = ~autoreset
        self._write_obs(next_obs, np.where(autoreset, 0, self.ep_step[p] + 1))

    def current_stacks(self) -> np.ndarray:
        """(N, k * D) stacks ending at each env's newest observation, for acting."""
        return self.stacks(np.full(self.num_envs, self.pos), self.env_ids)

    def stacks(self, slots: np.ndarray, env_ids: np.ndarray) -> np.ndarray:
        """`build_stacks` of this replay, with the previous actions if it was made with num_actions > 0."""
        actions = self.actions if self.num_actions else None
        return build_stacks(self.obs, self.ep_step, slots, env_ids, self.k, actions, self.num_actions)

    def sample_slots(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Uniform (slot, env) pairs with a valid transition whose whole k-frame window is still in the ring."""
        max_age = self.size - self.k  # ages 1..size-k: slot + 1 exists and slot - (k - 1) not overwritten
        if max_age < 1 or not self.valid.any():
            raise RuntimeError("replay holds no valid transition yet")
        slots, env_ids = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        while len(slots) < batch_size:  # rejection of autoreset slots (a small fraction), vectorized
            s = (self.pos - rng.integers(1, max_age + 1, size=2 * batch_size)) % self.capacity
            e = rng.integers(0, self.num_envs, size=2 * batch_size)
            keep = self.valid[s, e]
            slots, env_ids = np.concatenate([slots, s[keep]]), np.concatenate([env_ids, e[keep]])
        return slots[:batch_size], env_ids[:batch_size]

    def sample(self, batch_size: int, rng: np.random.Generator, n_step: int = 1, gamma: float = 1.0) -> dict:
        """A minibatch of n-step transitions: the discounted reward sum over up to n steps, cut where the episode
        ends (terminated: no bootstrap) or the next slot has no transition (a final observation, or the newest
        slot: bootstrap from the stack there), and `discount` = gamma^m (1 - terminated) for the m steps taken."""
        slots, env_ids = self.sample_slots(batch_size, rng)
        rewards = self.rewards[slots, env_ids]  # (B,) step 0
        terminated = self.terminated[slots, env_ids]  # (B,)
        next_slots = (slots + 1) % self.capacity  # (B,) the slot to bootstrap from
        discount = np.full(len(slots), gamma, dtype=np.float32)  # (B,) gamma^m
        going = (terminated == 0) & self.valid[next_slots, env_ids]  # (B,) may take one more step
        for _ in range(n_step - 1):  # steps 1 .. n - 1
            s = next_slots
            rewards = np.where(going, rewards + discount * self.rewards[s, env_ids], rewards)
            terminated = np.where(going, self.terminated[s, env_ids], terminated)
            next_slots = np.where(going, (s + 1) % self.capacity, s)
            discount = np.where(going, discount * gamma, discount).astype(np.float32)
            going = going & (terminated == 0) & self.valid[next_slots, env_ids]
        return {
            "obs": self.stacks(slots, env_ids),  # (B, k * F), F = D (+ A with --stack-actions)
            "actions": self.actions[slots, env_ids],  # (B,)
            "rewards": rewards.astype(np.float32),  # (B,) n-step discounted sum
            "discount": (discount * (1.0 - terminated)).astype(np.float32),  # (B,) gamma^m (1 - terminated)
            "next_obs": self.stacks(next_slots, env_ids),  # (B, k * F)
        }


def td_target(rewards, discount, next_q_target, next_q_online=None):
    """y = r + discount Q_target(s', a*), a* = argmax of Q_target, or of Q_online for double Q.

    rewards, discount: (B,), discount = gamma^m (1 - terminated) after m steps (`FrameStackReplay.sample`);
    next_q_target, next_q_online: (B, A). Truncated transitions have terminated = 0 and bootstrap. Returns (B,).
    """
    if next_q_online is None:
        next_v = next_q_target.max(dim=1).values  # (B,)
    else:
        next_v = next_q_target.gather(1, next_q_online.argmax(dim=1, keepdim=True)).squeeze(1)  # (B,)
    return rewards + discount * next_v


def td_loss(q_taken: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean TD loss over the batch (B,): Huber with delta 1 (quadratic for |delta| <= 1, linear beyond) or MSE."""
    if kind == "huber":
        return F.smooth_l1_loss(q_taken, y)
    return F.mse_loss(q_taken, y)


class QNetwork(nn.Module):
    """MLP from the flattened k-frame stack (B, k * D), and the scaled differences of its consecutive frames
    (detail 8), to Q-values (B, A)."""

    def __init__(self, frame_dim: int, frame_stack: int, num_actions: int, hidden_size: int, difference_scale: float):
        super().__init__()
        self.k, self.difference_scale = frame_stack, difference_scale
        num_differences = frame_stack - 1 if difference_scale != 0 else 0
        self.network = nn.Sequential(
            nn.Linear((frame_stack + num_differences) * frame_dim, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, num_actions),
        )

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """(B, k * D) stack -> (B, (2k - 1) * D): the stack, then the scaled differences of consecutive frames."""
        if self.k == 1 or self.difference_scale == 0:
            return x
        frames = x.view(x.shape[0], self.k, -1)  # (B, k, D), oldest first
        real = (frames[:, :-1] != 0).any(-1, keepdim=True)  # (B, k - 1, 1): the older frame is not padding
        differences = (frames[:, 1:] - frames[:, :-1]) * real * self.difference_scale  # (B, k - 1, D)
        return torch.cat([x, differences.flatten(1)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(self.inputs(x))


def main():
    args = parse_args()  # tyro + validation (`--eval-only`: env and architecture from the checkpoint's args.json)
    env_kwargs = json.loads(args.env_kwargs)  # a JSON object (parse_args checked)

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)

    # env setup: NEXT_STEP autoreset (gymnasium's default), see implementation detail 2
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, env_kwargs, args.scale_obs) for _ in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )
    args.obs_dim = int(np.prod(envs.single_observation_space.shape))
    num_actions = int(envs.single_action_space.n)
    frame_dim = args.obs_dim + (num_actions if args.stack_actions else 0)  # one frame: o (and onehot(a_prev))
    q_network = QNetwork(frame_dim, args.frame_stack, num_actions, args.hidden_size, args.difference_scale)
    run = start_run(args)  # device, run dir, tensorboard
    if args.eval_only:
        run.load_model(q_network)  # the checkpoint's weights (its architecture came with its args.json)
    device = run.device
    q_network.to(device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
    target_network = QNetwork(frame_dim, args.frame_stack, num_actions, args.hidden_size, args.difference_scale)
    target_network = target_network.to(device)
    target_network.load_state_dict(q_network.state_dict())
    rb = FrameStackReplay(
        args.buffer_size // args.num_envs,
        args.num_envs,
        args.obs_dim,
        args.frame_stack,
        num_actions if args.stack_actions else 0,
    )
    num_iterations = 0 if args.eval_only else args.total_timesteps // args.num_envs  # `--eval-only`: no training

    global_step = 0
    obs, _ = envs.reset(seed=args.seed)
    rb.reset(obs)
    autoreset = np.zeros(args.num_envs, dtype=bool)  # True where the previous step ended an episode
    ep_return, ep_length = np.zeros(args.num_envs), np.zeros(args.num_envs, dtype=np.int64)
    num_updates = 0
    best_return, best_step, best_state = -float("inf"), 0, None  # --keep-best
    late_selects = []  # returns of the evaluations during the last 10% of the steps: where the curve ends
    for iteration in range(num_iterations):
        # 1. act epsilon-greedily on the k-frame stacks built from the replay's newest slots
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
        )
        with torch.no_grad():
            q_values = q_network(torch.as_tensor(rb.current_stacks(), device=device))  # (N, A)
        actions = q_values.argmax(dim=1).cpu().numpy()
        explore = rng.random(args.num_envs) < epsilon
        actions = np.where(explore, rng.integers(0, num_actions, size=args.num_envs), actions)

        # 2. step the envs; in NEXT_STEP mode envs with autoreset=True ignore the action and return a reset obs
        next_obs, rewards, terminated, truncated, infos = envs.step(actions)
        global_step += args.num_envs

        # 3. store: CRUCIAL step easy to overlook, the autoreset step is not a transition (valid = False)
        rb.add(actions, rewards, terminated, next_obs, autoreset)

        # 4. episode statistics (the autoreset step's reward is 0 and belongs to no episode)
        ep_return += np.where(autoreset, 0.0, rewards)
        ep_length += ~autoreset
        done = terminated | truncated
        for i in np.flatnonzero(done):
            run.log(global_step, {"charts/episodic_return": ep_return[i], "charts/episodic_length": ep_length[i]})
            if "success" in infos and infos["_success"][i]:
                run.log(global_step, {"charts/success": float(infos["success"][i])})
        if done.any():
            run.log(global_step, {"charts/epsilon": epsilon})
        ep_return[done], ep_length[done] = 0.0, 0
        autoreset = done

        # 5. training: one gradient step on a minibatch of stacked transitions
        if global_step > args.learning_starts and iteration % args.train_frequency == 0:
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1.0 - iteration / num_iterations)
            for _ in range(args.gradient_steps):
                batch = rb.sample(args.batch_size, rng, args.n_step, args.gamma)
                batch = {key: torch.as_tensor(value, device=device) for key, value in batch.items()}
                with torch.no_grad():
                    next_q_target = target_network(batch["next_obs"])  # (B, A)
                    next_q_online = q_network(batch["next_obs"]) if args.double_q else None  # (B, A)
                    y = td_target(batch["rewards"], batch["discount"], next_q_target, next_q_online)
                q_taken = q_network(batch["obs"]).gather(1, batch["actions"][:, None]).squeeze(1)  # (B,)
                loss = td_loss(q_taken, y, args.loss)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                num_updates += 1
                if num_updates % LOG_EVERY_UPDATES == 0:
                    sps = int(global_step / (time.time() - run.start_time))
                    run.log(
                        global_step,
                        {
                            "losses/td_loss": loss.item(),
                            "losses/q_values": q_taken.mean().item(),
                            "charts/learning_rate": optimizer.param_groups[0]["lr"],
                            "charts/SPS": sps,
                        },
                    )
                    print(f"global_step={global_step} epsilon={epsilon:.3f} td_loss={loss.item():.4f} SPS={sps}")

        # 6. target network: hard copy (tau = 1) or Polyak average every target_network_frequency env steps
        if (
            global_step // args.target_network_frequency
            != (global_step - args.num_envs) // args.target_network_frequency
        ):
            for target_param, param in zip(target_network.parameters(), q_network.parameters(), strict=True):
                target_param.data.copy_(args.tau * param.data + (1.0 - args.tau) * target_param.data)

        # 7. evaluation during training (--select-frequency), and the kept network (--keep-best)
        if (
            args.select_frequency
            and global_step // args.select_frequency != (global_step - args.num_envs) // args.select_frequency
        ):
            sel_seed = SELECT_SEED_BASE + SELECT_SEED_STRIDE * args.seed + global_step
            sel = evaluate(q_network, args, env_kwargs, device, args.select_episodes, sel_seed)
            sel_return = sel["eval/episodic_return"]
            run.log(global_step, {"select/episodic_return": sel_return})
            print(f"SELECT global_step={global_step} return={sel_return:.1f}")
            if global_step > (1.0 - LATE_TRAINING_FRACTION) * args.total_timesteps:
                late_selects.append(sel_return)
            if sel_return >= best_return:
                best_return, best_step = sel_return, global_step
                best_state = {key: value.clone() for key, value in q_network.state_dict().items()}
    envs.close()

    # 8. evaluation of the greedy policy (epsilon = eval_epsilon); --keep-best: the last network is evaluated on the
    #    same episodes, then the kept one replaces it (and is the one saved)
    kept = {}
    if args.keep_best and best_state is not None:
        last = evaluate(q_network, args, env_kwargs, device)
        kept = {f"eval/last_network_{key[len('eval/') :]}": value for key, value in last.items()}
        kept |= {"select/best_episodic_return": best_return, "select/best_global_step": float(best_step)}
        q_network.load_state_dict(best_state)
    metrics = kept | evaluate(q_network, args, env_kwargs, device)
    if late_selects:  # the end of the training curve, next to the final evaluation
        metrics["select/late_episodic_return"] = float(np.mean(late_selects))
    run.log(global_step, metrics)
    run.finish(metrics, {"model": q_network}, global_step)


def evaluate(q_network, args: Args, env_kwargs: dict, device, episodes: int = 0, seed: int = -1) -> dict[str, float]:
    """Run `episodes` (default `eval_episodes`) episodes, one per env so short episodes are not over-counted, on env
    seeds seed + i (default `eval_env_seed`), epsilon-greedy (epsilon = `eval_epsilon`) on rolling k-frame stacks.
    Returns the eval/... metrics."""
    n, k = episodes or args.eval_episodes, args.frame_stack
    seed = eval_env_seed(args.seed) if seed < 0 else seed
    eval_envs = gym.vector.SyncVectorEnv([make_env(args.env_id, env_kwargs, args.scale_obs) for _ in range(n)])
    num_actions = int(eval_envs.single_action_space.n)
    rng = np.random.default_rng(seed)
    obs, _ = eval_envs.reset(seed=seed)
    prev_actions = np.full(n, -1) if args.stack_actions else None  # -1: no previous action yet
    frame = eval_frame(obs, prev_actions, num_actions)  # (n, F)
    stack = roll_stack(np.zeros((n, k, frame.shape[1]), dtype=np.float32), frame)  # (n, k, F), zeros before start
    returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
    running, timed_out = np.ones(n, dtype=bool), np.zeros(n, dtype=bool)
    success, has_success = np.zeros(n), False
    while running.any():
        with torch.no_grad():
            q_values = q_network(torch.as_tensor(stack.reshape(n, -1), device=device))  # (n, A)
        actions = q_values.argmax(dim=1).cpu().numpy()
        explore = rng.random(n) < args.eval_epsilon
        actions = np.where(explore, rng.integers(0, eval_envs.single_action_space.n, size=n), actions)
        obs, rewards, terminated, truncated, infos = eval_envs.step(actions)
        returns += rewards * running
        lengths += running
        done = running & (terminated | truncated)
        timed_out |= done & truncated
        if "success" in infos:
            has_success = True
            success = np.where(done & infos["_success"], infos["success"], success)
        running &= ~done
        stack = roll_stack(stack, eval_frame(obs, actions if args.stack_actions else None, num_actions))
    eval_envs.close()
    metrics = {
        "eval/episodic_return": float(returns.mean()),
        "eval/episodic_return_std": float(returns.std()),
        "eval/episodic_length": float(lengths.mean()),
        "eval/timeout_rate": float(timed_out.mean()),
    }
    if has_success:
        metrics["eval/success_rate"] = float(success.mean())
    if "ThreeStateLine" in args.env_id:  # failure = never reaching B, i.e. hitting the time limit
        metrics["eval/failure_rate"] = float(timed_out.mean())
    return metrics


# === RUN MANAGEMENT (not the algorithm: validation, run dir, tensorboard, summary, the saved model) ===
SCRIPT = Path(__file__).stem  # the script's name in summary.json
# the Args that `--eval-only` takes from the checkpoint's args.json: the env, the network and its inputs
ARCH_FIELDS = ("env_id", "env_kwargs", "frame_stack", "stack_actions", "scale_obs", "hidden_size", "difference_scale")
POSITIVE_FIELDS = "threads num_envs frame_stack n_step batch_size train_frequency gradient_steps hidden_size".split()


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work; `--eval-only`: ARCH_FIELDS of the checkpoint."""
    args = tyro.cli(Args)
    for ok, message in [
        (args.checkpoint or not args.eval_only, "--eval-only needs --checkpoint PATH (a run dir or model.safetensors)"),
        *[(getattr(args, field) >= 1, f"--{field.replace('_', '-')} must be >= 1") for field in POSITIVE_FIELDS],
        (0 <= args.difference_scale < float("inf"), "--difference-scale must be a finite number >= 0"),  # not nan
        (1 <= args.eval_episodes <= EVAL_SEED_STRIDE, f"need 1 <= --eval-episodes <= {EVAL_SEED_STRIDE}"),
        (0.0 <= args.eval_epsilon <= 1.0, f"--eval-epsilon must be in [0, 1], got {args.eval_epsilon}"),
        (args.eval_only or args.learning_starts >= args.batch_size, "--learning-starts must be >= --batch-size"),
        (args.select_frequency >= 0, f"--select-frequency must be >= 0, got {args.select_frequency}"),
        (1 <= args.select_episodes <= EVAL_SEED_STRIDE, f"need 1 <= --select-episodes <= {EVAL_SEED_STRIDE}"),
        (args.total_timesteps < SELECT_SEED_STRIDE // 2, f"--total-timesteps must be < {SELECT_SEED_STRIDE // 2}"),
        (args.select_frequency > 0 or not args.keep_best, "--keep-best needs --select-frequency > 0"),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    if args.eval_only:  # the env and the network the checkpoint was trained with
        saved = load_checkpoint(args.checkpoint)[1]
        saved = {"difference_scale": 0.0, **saved} if saved else {}  # runs saved before --difference-scale: 0
        vars(args).update({field: saved[field] for field in ARCH_FIELDS if field in saved})
    check_env(args.env_id, args.env_kwargs)
    return args


def check_env(env_id: str, env_kwargs: str) -> int:
    """The env made once: a bad id, module, JSON kwargs or space is a one-line error. Returns the number of actions."""
    try:
        with gym.make(env_id, **json.loads(env_kwargs)) as probe:
            obs_space, act_space = probe.observation_space, probe.action_space
    except (gym.error.Error, ImportError, AttributeError, TypeError, ValueError) as err:  # id, module, JSON, kwargs
        raise SystemExit(f"error: cannot make env {env_id!r} with --env-kwargs {env_kwargs}: {err}") from None
    if not isinstance(act_space, gym.spaces.Discrete):
        raise SystemExit(f"error: {env_id} has action space {act_space}; only Discrete action spaces are supported")
    if not flattenable(obs_space):
        spaces = "Box, Discrete, MultiBinary, MultiDiscrete, and Tuple/Dict of these"
        raise SystemExit(f"error: {env_id} has observation space {obs_space}; supported: {spaces}")
    return int(act_space.n)


def flattenable(space: gym.spaces.Space) -> bool:
    """What FlattenObservation makes one vector of: Box, Discrete, MultiBinary, MultiDiscrete, Tuple/Dict of these."""
    if isinstance(space, gym.spaces.Tuple | gym.spaces.Dict):
        return all(map(flattenable, space.spaces.values() if isinstance(space, gym.spaces.Dict) else space.spaces))
    return isinstance(space, gym.spaces.Box | gym.spaces.Discrete | gym.spaces.MultiBinary | gym.spaces.MultiDiscrete)


def load_checkpoint(path: str) -> tuple[dict, dict]:
    """(state_dict, the run's args.json or {}) from a run dir or a .safetensors file; a one-line error otherwise."""
    model_path = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
    try:
        state_dict = load_file(str(model_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise SystemExit(f"error: cannot read checkpoint {model_path}: {err}") from None
    args_path = model_path.parent / "args.json"
    return state_dict, json.loads(args_path.read_text()) if args_path.is_file() else {}


class Run:
    """The device, a new run dir (made after every check) with tensorboard and args.json; log, load_model, finish."""

    def __init__(self, args: Args):
        self.args, self.start_time = args, time.time()
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        name = f"{args.env_id.replace('/', '-').replace(':', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
        for suffix in range(10**6):  # a new run dir (mkdir is atomic): runs in the same second get -1, -2, ...
            self.run_dir = Path(args.runs_dir) / (f"{name}-{suffix}" if suffix else name)
            try:
                self.run_dir.mkdir(parents=True)
                break
            except FileExistsError:  # taken: the next suffix
                continue
            except OSError as err:
                raise SystemExit(f"error: --runs-dir {args.runs_dir}: {err.strerror}") from None
        self.writer = SummaryWriter(str(self.run_dir))
        table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        (self.run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))

    def log(self, step: int, metrics: dict) -> None:
        """tensorboard at env step `step`: each tag -> value as a scalar (a str value as text)."""
        for tag, value in metrics.items():
            (self.writer.add_text if isinstance(value, str) else self.writer.add_scalar)(tag, value, step)

    def load_model(self, module: nn.Module) -> None:
        """`--checkpoint`'s weights into `module`; if they do not fit, a one-line error and no run dir left behind."""
        try:
            module.load_state_dict(load_checkpoint(self.args.checkpoint)[0])
        except RuntimeError as err:
            self.writer.close()
            shutil.rmtree(self.run_dir)
            arch = " ".join(f"--{field.replace('_', '-')} {getattr(self.args, field)}" for field in ARCH_FIELDS)
            raise SystemExit(f"error: checkpoint does not fit {arch}: {str(err).strip().splitlines()[0]}") from None

    def finish(self, metrics: dict, models: dict[str, nn.Module], samples: int) -> None:
        """`{name}.safetensors` per model, then summary.json (written last and atomically: a finished run has it)."""
        for name, module in models.items():
            save_file(module.state_dict(), str(self.run_dir / f"{name}.safetensors"))
        wall_time = time.time() - self.start_time
        summary = {"script": SCRIPT, "run_name": self.run_dir.name, "run_dir": str(self.run_dir)}
        summary |= {"args": asdict(self.args), "metrics": metrics, "wall_time_s": wall_time, "sps": samples / wall_time}
        (self.run_dir / ".summary.json").write_text(json.dumps(summary, indent=2))  # then renamed: never half written
        os.replace(self.run_dir / ".summary.json", self.run_dir / "summary.json")
        self.writer.close()
        print(json.dumps(metrics, indent=2), f"run dir: {self.run_dir}", sep="\n")


def start_run(args: Args) -> Run:
    return Run(args)  # the device, a new run dir, tensorboard


if __name__ == "__main__":
    main()
