"""R2D2: recurrent Q-learning from replayed sequences that resume from a *stored* LSTM state.

Q-learning on o_t is invalid in a POMDP; Q-learning on the history is valid, and an LSTM summarizes the history in
h_t. Replaying whole histories costs O(T^2) memory. The lecture's trick, from R2D2 [1]: store each step once (O(T))
with the actor's recurrent state, cut the stream into fixed-length sequences, and start each replayed sequence from
the state stored at its start: an *approximate* state that goes stale as the network trains, which a burn-in prefix
(unrolled without gradient) refreshes. Shown here: TMaze with a 20-step corridor is solved (a 4-frame window is at
chance), MaskedCartPole, and the paper's ablation (`--state-init zero|stored`, `--burn-in`) with its Delta-Q.

Key equations (rows t = t0 .. t0+m-1 after a burn-in of l rows; n-step double Q, target network Q^-):
    h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x   (value rescaling, inverted exactly by h^-1)
    y_t = h( sum_{k<n'} gamma^k r_{t+k} + gamma^n' (1 - terminal) h^-1(Q^-(t+n', argmax_a Q(t+n', a))) ),  n' <= n
    loss = mean_i w_i sum_t mask_t (y_t - Q(t, a_t))^2 / (2 sum_t mask_t),   w_i = (N P(i))^-beta / max_j w_j
    p_i = eta max_t |delta_t| + (1 - eta) mean_t |delta_t|,   P(i) ~ p_i^alpha,   eps_i = eps^(1 + alpha_eps i / (N-1))
    Delta-Q = ||q(h_stored-or-zero) - q(h_true)||_2 / max_a |q(h_true)_a|, h_true recomputed from the episode start
Implementation details:
 1. A ring buffer of rows (obs, action, reward, flags first / final / terminal, previous action and reward) that also
    stores the actor's (h, c) *before* each row: O(T) memory (`SequenceReplay`).
 2. NEXT_STEP autoreset: an episode's true final obs is a `final` row (bootstrapped from on truncation); the next
    step() is the reset step, whose action is ignored and whose reward is dropped.
 3. Sequences start at each episode's first step and every m - overlap steps after it; a window is [t0 - l, t0 + m
    + n), its burn-in clipped at the episode start (the zero state there is exact), rows after the final row masked.
 4. Prioritized sequence replay; new sequences get the largest priority seen; sequences whose first needed row was
    overwritten get probability 0. A numpy cumsum replaces the sum-tree (as fast at these sizes).
 5. The burn-in is one packed nn.LSTM call under no_grad over each row's last piece (resets at episode starts).
 6. Input [o_t, onehot(a_{t-1}), r_{t-1}] as in the paper; dueling head; Adam, gradient clipping, target copies.
 7. Delta-Q is measured on the sampled batch *before* the optimizer step (same parameters for both Q's). Runs with
    different `--state-init` / `--burn-in` train different networks, so `final_delta_q` repeats the ablation at the
    end on ONE network, the last (`model/final_delta_q_*`).
 8. `replay/bytes` against `replay/bytes_full_histories`: the stored rows against rows that each hold their whole
    input history (T(T + 1)/2 inputs per episode); full histories cost more once episodes outgrow the stored state.
 9. The trained length m must cover the span the network has to *learn*: gradient never reaches a cue in the burn-in
    or before the stored state, so TMaze-20's cue and turn (21 steps apart) need m = 30 (m = 20 stays at chance).
10. MaskedCartPole's recipe (benchmark.sh): scaled inputs, gamma 0.995 with 10-step returns, 2e-3 annealed to 0, 64
    sequences every 3 vector steps, a 128-unit LSTM; the TMaze settings let the cart drift off the track.
11. Long runs: checkpoints every `--save-every` steps and on Ctrl-C / SIGTERM; `--resume RUN_DIR` continues with the
    networks, Adam, replay and RNGs of the checkpoint and new episodes (class `Run`, below RUN MANAGEMENT).
Scaled down from the paper: one process, not 256 actors; 64 LSTM units; m / overlap / burn-in 30 / 15 / 10 (80/40/40).
References: [1] S. Kapturowski et al., "Recurrent Experience Replay in Distributed Reinforcement Learning", ICLR
2019. [2] D. Horgan et al., "Distributed Prioritized Experience Replay" (Ape-X), ICLR 2018. [3] T. Schaul et al.,
"Prioritized Experience Replay", ICLR 2016. [4] T. Pohlen et al., "Observe and Look Further", 2018 (h(x)).
[5] CleanRL dqn.py and ppo_atari_lstm.py: the loop layout, done-masked LSTM state. Details: docs/r2d2_rnnstate.md.
Reproduce: python algos/r2d2_rnnstate.py --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}'
    --buffer-size 30000 --total-timesteps 150000
"""

import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
import tyro
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
import envs  # noqa: E402, F401  (registers the seqrl/ environments)

NO_ACTION = -1  # "previous action" at an episode's first step: encoded as an all-zero one-hot
DELTA_Q_EPS = 1e-6  # keeps the Delta-Q normalization finite when all true Q-values are 0
EVAL_SEED_STRIDE = 10_000  # final evaluation: episode i of training seed s gets env seed 10_000 (s + 1) + i
SELECT_SEED_BASE = 10**9  # evaluations during training: env seeds 1e9 + 1e7 s + global_step + i, disjoint from
SELECT_SEED_STRIDE = 10**7  # the final evaluation's and across training seeds (global_step + i < 1e7)
LATE_TRAINING_FRACTION = 0.1  # `select/late_episodic_return`: mean of the evaluations in the last 10% of the steps
MAX_EVAL_STEPS = 10_000  # guard for envs without a time limit: an evaluation episode stops after this many steps
LOG_EVERY_UPDATES = 100  # write losses/SPS to tensorboard every 100 gradient updates


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (python, numpy, torch, and the envs)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """use the GPU if `--cuda` and one is available (these tiny models run fastest on CPU)"""
    threads: int = 1
    """torch.set_num_threads: 1 is fastest for 64-unit networks and leaves cores to parallel runs"""
    runs_dir: str = "runs"
    """the folder where run directories (tensorboard, summary.json, model) are written"""
    eval_episodes: int = 100
    """number of greedy evaluation episodes at the end of training"""
    eval_only: bool = False
    """skip training: load `--checkpoint` and evaluate it"""
    checkpoint: str | None = None
    """run dir or model.safetensors to load with `--eval-only` (env and hidden size come from its args.json)"""
    save_every: int = 25_000
    """environment steps between checkpoints (all that `--resume` needs) in RUN_DIR/train_state.safetensors, deleted
    when the run ends (0 = none; Ctrl-C / SIGTERM always write one)"""
    resume: str | None = None
    """a run dir of this script with a checkpoint: continue that run there, with its own arguments"""

    # Environment
    env_id: str = "seqrl/TMaze-v0"
    """any gymnasium id (also `module:EnvId`) with a Discrete action space; observations Box, Discrete, MultiBinary,
    MultiDiscrete, or Tuple/Dict of these (flattened: one-hot per discrete component, concatenated)"""
    env_kwargs: str = "{}"
    """keyword arguments for gym.make as a JSON object, e.g. '{"corridor_length": 20}'"""
    num_envs: int = 8
    """the number of parallel environments (the actors; each gets its own exploration epsilon)"""
    scale_obs: bool = False
    """divide each flat observation dimension by its finite bound max(|low|, |high|), as dqn_framestack.py does
    (MaskedCartPole: x / 4.8, theta / 0.419; their per-step changes, ~1e-3 raw, carry the velocities, and scaled
    inputs learned faster); a no-op on the 0/1 codes of TMaze"""

    # Model
    hidden_size: int = 64
    """width of the encoder layer and of the LSTM state (MaskedCartPole's recipe: 128, detail 10)"""

    # R2D2
    total_timesteps: int = 100_000
    """total environment steps of training (summed over envs)"""
    learning_rate: float = 1e-3
    """the Adam learning rate"""
    anneal_lr: bool = False
    """linearly anneal the learning rate to 0 over training, as dqn_framestack.py does (MaskedCartPole: at 2e-3 the
    return swung widely late in training without it)"""
    adam_eps: float = 1e-3
    """Adam epsilon (R2D2 uses 1e-3)"""
    buffer_size: int = 100_000
    """replay capacity in environment steps (rows), summed over envs"""
    batch_size: int = 32
    """sequences per gradient update"""
    seq_len: int = 30
    """m: trained steps per replayed sequence (paper 80 incl. burn-in); must cover the memory span to be learned"""
    seq_overlap: int = 15
    """steps shared by the trained parts of consecutive sequences of an episode (paper 40)"""
    burn_in: int = 10
    """l: steps unrolled without gradient before the trained part, to refresh the stored state (paper 40)"""
    state_init: Literal["stored", "zero"] = "stored"
    """the LSTM state a replayed sequence starts from: the one the actor had there, or zeros"""
    n_step: int = 5
    """n of the n-step double-Q targets"""
    gamma: float = 0.99
    """the discount factor gamma"""
    value_rescaling_eps: float = 1e-3
    """eps of h(x) = sign(x)(sqrt(|x|+1)-1) + eps x; 0 switches the rescaling off (plain targets)"""
    priority_exponent: float = 0.9
    """alpha of prioritized replay, P(i) ~ p_i^alpha (paper 0.9)"""
    importance_exponent: float = 0.6
    """beta of the importance weights (N P(i))^-beta (paper 0.6)"""
    priority_eta: float = 0.9
    """eta of p = eta max|delta| + (1 - eta) mean|delta| over a sequence (paper 0.9)"""
    target_network_frequency: int = 200
    """gradient updates between copies of the online network into the target network (paper 2500)"""
    train_frequency: int = 4
    """vector-env steps between gradient updates (each vector step adds num_envs steps)"""
    learning_starts: int = 5_000
    """environment steps collected before learning starts"""
    exploration_eps: float = 0.4
    """Ape-X epsilon: env i explores with eps^(1 + alpha i / (N - 1))"""
    exploration_alpha: float = 7.0
    """Ape-X alpha (7 in Ape-X/R2D2): the spread of the per-env epsilons"""
    max_grad_norm: float = 10.0
    """global gradient-norm clipping"""
    delta_q_frequency: int = 50
    """gradient updates between Delta-Q measurements (recomputing states from the episode start)"""
    final_delta_q_sequences: int = 512
    """replayed sequences for the last network's Delta-Q from zero / stored / stored + burn-in (`final_delta_q`)"""
    select_frequency: int = 0
    """environment steps between greedy evaluations during training (0 = none), logged as select/episodic_return;
    summary.json gets their mean over the last 10% of the steps (`select/late_episodic_return`)"""
    select_episodes: int = 10
    """episodes per evaluation during training (env seeds disjoint from the training and the final evaluation)"""
    keep_best: bool = False
    """keep the network of the best evaluation during training (ties: the later one) as the final model, like SB3's
    EvalCallback; summary.json also reports the last network's return. Needs --select-frequency"""


# ALGO LOGIC: small pure functions (imported by the tests)
def eval_env_seed(seed: int) -> int:
    """First env seed of the final evaluation of training seed `seed`; episode i uses eval_env_seed(seed) + i. Blocks
    of EVAL_SEED_STRIDE seeds: disjoint across training seeds and from the training envs' seeds (seed + i)."""
    return EVAL_SEED_STRIDE * (seed + 1)


def value_rescale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x  (Pohlen et al. 2018), invertible for eps >= 0."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1.0) - 1.0) + eps * x


def inverse_value_rescale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """h^-1(x), the exact inverse of `value_rescale` (the positive root of a quadratic in sqrt(|y|+1))."""
    if eps == 0.0:
        return torch.sign(x) * ((x.abs() + 1.0) ** 2 - 1.0)
    root = (torch.sqrt(1.0 + 4.0 * eps * (x.abs() + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return torch.sign(x) * (root**2 - 1.0)


def ape_x_epsilons(num_envs: int, eps: float, alpha: float) -> np.ndarray:
    """Per-env exploration epsilons eps_i = eps^(1 + alpha i / (N - 1)), i = 0..N-1 (N = 1: just eps)."""
    i = np.arange(num_envs)
    return eps ** (1.0 + alpha * i / max(num_envs - 1, 1))


def nstep_rescaled_targets(rewards, final, terminal, boot_values, gamma: float, n: int, num_positions: int, eps: float):
    """n-step double-Q targets y_t (in the rescaled space) for rows t = 0..num_positions-1 of a sequence.

    All inputs are (T, B) with T >= num_positions + n; row j holds: rewards[j], the reward of the action taken at
    row j; final[j] = 1 if row j is an episode's final observation (no action: its reward is ignored);
    terminal[j] = 1 if that final observation is terminal (no bootstrap); boot_values[j] = h^-1(Q^-(j, a*_j)).
    The return stops at the first final row f after t: bootstrap with gamma^(f-t) boot_values[f] if f was
    truncated, nothing if terminal; otherwise bootstrap at t + n. Returns (num_positions, B).
    """
    P = num_positions
    running = 1.0 - final[:P]  # (P, B) 1 while the episode of row t goes on
    ret = torch.zeros_like(running)
    boot = torch.zeros_like(running)
    discount = torch.ones_like(running)
    for k in range(n):
        ret = ret + running * discount * rewards[k : k + P]
        discount = discount * gamma
        next_final = final[k + 1 : k + 1 + P]
        ended = running * next_final  # the episode ends at row t+k+1
        boot = boot + ended * discount * (1.0 - terminal[k + 1 : k + 1 + P]) * boot_values[k + 1 : k + 1 + P]
        running = running * (1.0 - next_final)
    boot = boot + running * discount * boot_values[n : n + P]
    return value_rescale(ret + boot, eps)


def sequence_priority(abs_td: torch.Tensor, mask: torch.Tensor, eta: float) -> torch.Tensor:
    """p = eta max_t |delta_t| + (1 - eta) mean_t |delta_t| over the valid (mask = 1) steps; (T, B) -> (B,)."""
    masked = abs_td * mask
    mean = masked.sum(0) / mask.sum(0).clamp(min=1.0)
    return eta * masked.max(0).values + (1.0 - eta) * mean


def delta_q(q: torch.Tensor, q_true: torch.Tensor) -> torch.Tensor:
    """Q-value discrepancy ||q - q_true||_2 / max_a |q_true_a| (R2D2 Sec. 3), (..., A) -> (...)."""
    return (q - q_true).norm(dim=-1) / q_true.abs().max(-1).values.clamp(min=DELTA_Q_EPS)


class SequenceReplay:
    """O(T) ring buffer of rows (capacity rows per env column) plus a prioritized table of sequences.

    A sequence is identified by its env column, its anchor t0 (first trained row, absolute step index) and its
    episode's first row; its window is rows [t0 - burn_in, t0 + seq_len + n_step).
    """

    def __init__(self, capacity, num_envs, obs_dim, hidden_size, seq_len, overlap, burn_in, n_step):
        self.cap, self.E = capacity, num_envs
        self.m, self.stride, self.burn_in, self.n = seq_len, seq_len - overlap, burn_in, n_step
        self.window = burn_in + seq_len + n_step
        self.obs = np.zeros((capacity, num_envs, obs_dim), dtype=np.float32)
        self.action = np.zeros((capacity, num_envs), dtype=np.int64)
        self.reward = np.zeros((capacity, num_envs), dtype=np.float32)
        self.prev_action = np.full((capacity, num_envs), NO_ACTION, dtype=np.int64)
        self.prev_reward = np.zeros((capacity, num_envs), dtype=np.float32)
        self.first = np.zeros((capacity, num_envs), dtype=bool)
        self.final = np.zeros((capacity, num_envs), dtype=bool)
        self.terminal = np.zeros((capacity, num_envs), dtype=bool)
        self.ep_step = np.zeros((capacity, num_envs), dtype=np.int32)  # step of the row within its episode
        self.h = np.zeros((capacity, num_envs, hidden_size), dtype=np.float32)  # actor state before the row
        self.c = np.zeros((capacity, num_envs, hidden_size), dtype=np.float32)
        self.t = 0  # absolute index of the next row (the same for every env column)
        self.ep_start = np.zeros(num_envs, dtype=np.int64)  # absolute first row of each column's current episode
        # sequence table: a ring as well; at most one anchor per 2 rows (an episode has >= 1 step + its final row)
        self.seq_cap = capacity * num_envs // min(self.stride, 2) + num_envs
        self.seq_env = np.zeros(self.seq_cap, dtype=np.int64)
        self.seq_anchor = np.zeros(self.seq_cap, dtype=np.int64)
        self.seq_ep_start = np.zeros(self.seq_cap, dtype=np.int64)
        self.priority = np.zeros(self.seq_cap, dtype=np.float64)  # 0 = empty slot
        self.seq_ptr, self.max_priority = 0, 1.0

    def add(self, obs, first, final, terminal, prev_action, prev_reward, h, c, action, reward):
        """Write one row per env (all (E, ...) arrays) and register the sequences whose windows are complete."""
        r = self.t % self.cap
        self.ep_start[first] = self.t
        for name, value in (
            ("obs", obs),
            ("first", first),
            ("final", final),
            ("terminal", terminal),
            ("prev_action", prev_action),
            ("prev_reward", prev_reward),
            ("h", h),
            ("c", c),
            ("action", action),
            ("reward", reward),
            ("ep_step", self.t - self.ep_start),
        ):
            getattr(self, name)[r] = value
        # a window is complete when its last row (t0 + m + n - 1) is written ...
        span = self.m + self.n - 1
        since_anchor = self.t - self.ep_start - span  # (E,) steps since the last row of anchor ep_start
        done_envs = np.nonzero((since_anchor >= 0) & (since_anchor % self.stride == 0))[0]
        for e in done_envs:
            self._register(e, self.t - span)
        # ... or when the episode's final row is written: register its remaining anchors (padded, masked windows)
        for e in np.nonzero(final)[0]:
            first_k = max(0, (self.t - span - self.ep_start[e]) // self.stride + 1)  # anchors > t - span
            for anchor in range(self.ep_start[e] + first_k * self.stride, self.t, self.stride):
                if anchor > self.t - span:
                    self._register(e, anchor)
        self.t += 1

    def _register(self, env, anchor):
        i = self.seq_ptr
        self.seq_env[i], self.seq_anchor[i], self.seq_ep_start[i] = env, anchor, self.ep_start[env]
        self.priority[i] = self.max_priority
        self.seq_ptr = (self.seq_ptr + 1) % self.seq_cap

    def valid(self) -> np.ndarray:
        """Sequences whose needed rows (from max(t0 - burn_in, episode start)) are still in the ring."""
        oldest = self.t - self.cap  # rows >= oldest are present
        start = np.maximum(self.seq_anchor - self.burn_in, self.seq_ep_start)
        return (self.priority > 0) & (start >= oldest)

    def num_sequences(self) -> int:
        return int(self.valid().sum())

    def sample(self, batch_size, alpha, beta, rng):
        """Proportional sampling: (sequence ids, importance weights (B,)), P(i) = p_i^alpha / sum_j p_j^alpha."""
        p = np.where(self.valid(), self.priority, 0.0) ** alpha
        probs = p / p.sum()
        ids = rng.choice(self.seq_cap, size=batch_size, p=probs)
        weights = (np.count_nonzero(p) * probs[ids]) ** -beta
        return ids, weights / weights.max()

    def update_priorities(self, ids, priorities):
        self.priority[ids] = np.maximum(priorities, DELTA_Q_EPS)  # keep sampled sequences alive (p > 0)
        self.max_priority = max(self.max_priority, float(priorities.max()))

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the replay: its arrays (rows, sequence table), counters and sizes."""
        return {key: value for key, value in vars(self).items() if isinstance(value, np.ndarray | int | float)}

    def load_state_dict(self, saved: dict) -> None:
        """The inverse of state_dict; a ValueError where an array does not fit this replay."""
        for key, value in self.state_dict().items():
            if (np.shape(saved[key]), np.result_type(saved[key])) != (np.shape(value), np.result_type(value)):
                raise ValueError(f"{key}: {np.shape(saved[key])} {saved[key].dtype}, the replay has {np.shape(value)}")
            setattr(self, key, saved[key] if isinstance(value, np.ndarray) else type(value)(saved[key]))

    def gather(self, ids, prefix: int = 0) -> dict:
        """The windows of sequences `ids` as (W, B, ...) arrays, W = prefix + burn_in + m + n, starting at
        t0 - burn_in - prefix (rows before the episode start are reset away by the `first` flag)."""
        offsets = np.arange(-self.burn_in - prefix, self.m + self.n)  # (W,)
        rows = (self.seq_anchor[ids][None, :] + offsets[:, None]) % self.cap  # (W, B)
        cols = np.broadcast_to(self.seq_env[ids][None, :], rows.shape)  # (W, B)
        names = ("obs", "action", "reward", "prev_action", "prev_reward", "first", "final", "terminal")
        out = {name: getattr(self, name)[rows, cols] for name in names}  # (W, B, ...)
        out["h0"], out["c0"] = self.h[rows[0], cols[0]], self.c[rows[0], cols[0]]  # (B, H) stored state at start
        return out


class RecurrentQNetwork(nn.Module):
    """[o_t, onehot(a_{t-1}), r_{t-1}] -> Linear+ReLU -> LSTM -> dueling head Q(h_t, .)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden_size: int):
        super().__init__()
        self.obs_dim, self.num_actions, self.hidden_size = obs_dim, num_actions, hidden_size
        self.encoder = nn.Sequential(nn.Linear(obs_dim + num_actions + 1, hidden_size), nn.ReLU())
        self.lstm = nn.LSTM(hidden_size, hidden_size)
        self.value = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, 1))
        self.advantage = nn.Sequential(
            nn.Linear(hidden_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, num_actions)
        )

    def encode(self, obs, prev_action, prev_reward):
        """(T, B, obs_dim), (T, B), (T, B) -> (T, B, H); prev_action = NO_ACTION gives a zero one-hot."""
        onehot = F.one_hot(prev_action.clamp(min=0), self.num_actions).float() * (prev_action >= 0)[..., None]
        return self.encoder(torch.cat([obs, onehot, prev_reward[..., None]], dim=-1))

    def head(self, out):
        """(T, B, H) -> Q (T, B, A), dueling: V + A - mean_a A."""
        adv = self.advantage(out)
        return self.value(out) + adv - adv.mean(-1, keepdim=True)

    def core(self, z, state):
        """One nn.LSTM call over (T, B, H) features from state ((B, H), (B, H)); no resets inside."""
        out, (h, c) = self.lstm(z, (state[0][None], state[1][None]))
        return out, (h[0], c[0])

    def state_after(self, z, first, state):
        """The LSTM state after the rows z (T, B, H) from state ((B, H), (B, H)), zeroed before every row with
        first = 1 (an episode start). Only each sequence's last piece (from its last start, or row 0) matters: one
        packed nn.LSTM call runs them all, no step loop in Python."""
        T, B = first.shape
        if T == 0:
            return state
        rows = torch.arange(T, device=z.device)[:, None].expand(T, B)
        begin = torch.where(first, rows, 0).amax(0)  # (B,) the row the last piece starts at
        keep = (~first[begin, torch.arange(B, device=z.device)]).float()[:, None]  # zeros where it is a start
        index = (begin[None] + rows).clamp(max=T - 1)  # (T, B) each piece's rows first (the rest is padding)
        pieces = z.gather(0, index[..., None].expand(-1, -1, z.shape[-1]))
        packed = nn.utils.rnn.pack_padded_sequence(pieces, (T - begin).cpu(), enforce_sorted=False)
        _, (h, c) = self.lstm(packed, ((state[0] * keep)[None], (state[1] * keep)[None]))
        return h[0], c[0]


def unroll(net, win: dict, state, skip: int):
    """Q-values of the rows after the first `skip` rows of a window: the first `skip` rows (burn-in, or an
    episode prefix) are unrolled without gradient with resets at episode starts, then the rest in one LSTM call.
    Returns (q (W - skip, B, A), the state at row `skip`)."""
    z = net.encode(win["obs"], win["prev_action"], win["prev_reward"])  # (W, B, H)
    with torch.no_grad():
        state = net.state_after(z[:skip].detach(), win["first"][:skip], state)
    keep = (~win["first"][skip]).float()[:, None]  # the anchor itself may be an episode start
    state = (state[0].detach() * keep, state[1].detach() * keep)
    out, _ = net.core(z[skip:], state)
    return net.head(out), state


def next_row_flags(final, terminated, truncated):
    """Flags (first, final, terminal) of the row that the obs returned by a NEXT_STEP-autoreset step() fills.

    If the current row was final, that step() was the reset step: the new row is a reset obs (`first`), and
    gymnasium reports terminated = truncated = False for it. Otherwise an ended episode makes the new row final.
    """
    done = (terminated | truncated) & ~final
    return final.copy(), done, terminated & ~final


@torch.no_grad()
def actor_step(net, obs, prev_action, prev_reward, first, state):
    """One acting step for E envs: zero the state where an episode starts, then Q(h_t, .) from
    [o_t, a_{t-1}, r_{t-1}]. Returns (q (E, A), the new state, the state *before* the step as numpy (stored
    with the row: the sequence-start state R2D2 replays from))."""
    device = state[0].device
    keep = torch.as_tensor(~first, dtype=torch.float32, device=device)[:, None]  # (E, 1)
    state = (state[0] * keep, state[1] * keep)
    before = (state[0].cpu().numpy(), state[1].cpu().numpy())
    z = net.encode(
        torch.as_tensor(obs, dtype=torch.float32, device=device)[None],
        torch.as_tensor(prev_action, device=device)[None],
        torch.as_tensor(prev_reward, dtype=torch.float32, device=device)[None],
    )  # (1, E, H)
    out, state = net.core(z, state)
    return net.head(out)[0], state, before


def to_torch(win: dict, device) -> dict:
    return {key: torch.as_tensor(value, device=device) for key, value in win.items()}


def make_next_step_vec_env(env_id: str, env_kwargs: dict, num_envs: int, scale_obs: bool = False):
    """`num_envs` copies of the flattened env with gymnasium's default NEXT_STEP autoreset (ppo_recurrent.py's
    make_vec_env autoresets in the SAME step)."""
    return gym.vector.SyncVectorEnv(
        [lambda: make_flat_env(env_id, env_kwargs, scale_obs)] * num_envs,
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )


def make_flat_env(env_id: str, env_kwargs: dict, scale_obs: bool = False) -> gym.Env:
    """The env with a flat float32 observation: gymnasium's FlattenObservation one-hot encodes Discrete and each
    MultiDiscrete component, flattens Box, and concatenates the parts of Tuple/Dict (Dict in sorted key order).
    `scale_obs`: each dimension divided by its finite bound max(|low|, |high|) (1 where infinite or 0)."""
    env = gym.wrappers.DtypeObservation(gym.wrappers.FlattenObservation(gym.make(env_id, **env_kwargs)), np.float32)
    if scale_obs:
        space = env.observation_space
        bound = np.maximum(np.abs(space.low), np.abs(space.high)).astype(np.float64)  # (D,)
        usable = np.isfinite(bound) & (bound > 0)
        scale = np.where(usable, 1.0 / np.where(usable, bound, 1.0), 1.0).astype(np.float32)
        new_space = gym.spaces.Box(space.low * scale, space.high * scale, dtype=np.float32)
        env = gym.wrappers.TransformObservation(env, lambda o: (o * scale).astype(np.float32), new_space)
    return env


@dataclass
class TrainState:
    """What the training loop carries from one env step to the next; a checkpoint saves every field (`Run`)."""

    q_network: nn.Module
    target_network: nn.Module
    optimizer: torch.optim.Optimizer
    rb: SequenceReplay
    rng: np.random.Generator  # exploration and replay sampling
    vec_env: gym.vector.SyncVectorEnv  # not saved: --resume begins new episodes
    obs: np.ndarray  # (E, obs_dim) the observation of the current row
    h: torch.Tensor  # (E, H) the actor's LSTM state
    c: torch.Tensor  # (E, H)
    first: np.ndarray = field(init=False)  # (E,) the row holds a reset observation
    final: np.ndarray = field(init=False)  # (E,) the row holds an episode's final observation (action ignored)
    terminal: np.ndarray = field(init=False)  # (E,) that final observation is terminal (no bootstrap)
    prev_action: np.ndarray = field(init=False)  # (E,) a_{t-1} (NO_ACTION at an episode's first step)
    prev_reward: np.ndarray = field(init=False)  # (E,) r_{t-1}
    ep_return: np.ndarray = field(init=False)  # (E,) return and length of each env's episode so far
    ep_length: np.ndarray = field(init=False)  # (E,)
    ep_returns: list = field(default_factory=list)  # returns and lengths of the finished episodes
    ep_lengths: list = field(default_factory=list)
    delta_q_log: list = field(default_factory=list)  # (first, last, first at episode starts) per measurement (step 5)
    num_updates_done: int = 0
    learner_seconds: float = 0.0  # wall time of the learning steps (sampling to target copy), for the cost study
    late_selects: list = field(default_factory=list)  # returns of the evaluations in the last 10% of the steps
    best_return: float = -np.inf  # --keep-best: the best evaluation during training, its step and its network
    best_step: int = 0
    best_model: dict | None = None

    def __post_init__(self):  # a new run: every env at the first row of an episode
        E = len(self.obs)
        self.first, self.final, self.terminal = np.ones(E, dtype=bool), np.zeros(E, dtype=bool), np.zeros(E, dtype=bool)
        self.prev_action, self.prev_reward = np.full(E, NO_ACTION, dtype=np.int64), np.zeros(E, dtype=np.float32)
        self.ep_return, self.ep_length = np.zeros(E), np.zeros(E, dtype=int)

    def row(self) -> dict:
        """The current row's fields that the replay stores with the action taken there."""
        return {key: getattr(self, key) for key in ("obs", "first", "final", "terminal", "prev_action", "prev_reward")}


def main():
    args = parse_args()
    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)

    run = start_run(args)  # checks the env; the run dir (new, or the resumed run's), tensorboard, Ctrl-C handlers
    device, env_kwargs = run.device, json.loads(args.env_kwargs)
    vec_env = make_next_step_vec_env(args.env_id, env_kwargs, args.num_envs, args.scale_obs)
    eval_env = partial(make_flat_env, args.env_id, env_kwargs, args.scale_obs)  # a fresh env for each evaluation
    obs_dim, num_actions = vec_env.single_observation_space.shape[0], int(vec_env.single_action_space.n)
    q_network = RecurrentQNetwork(obs_dim, num_actions, args.hidden_size).to(device)
    if args.eval_only:
        run.load_model(q_network)  # the --checkpoint network: evaluated below, nothing is trained
    target_network = RecurrentQNetwork(obs_dim, num_actions, args.hidden_size).to(device)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, eps=args.adam_eps, fused=True)
    E, H, B, burn_in, m, n = args.num_envs, args.hidden_size, args.batch_size, args.burn_in, args.seq_len, args.n_step
    rb = SequenceReplay(args.buffer_size // E, E, obs_dim, H, m, args.seq_overlap, burn_in, n)
    epsilons = ape_x_epsilons(E, args.exploration_eps, args.exploration_alpha)  # (E,)
    eps_v = args.value_rescaling_eps

    obs, zeros = vec_env.reset(seed=args.seed)[0], torch.zeros(E, H, device=device)
    state = TrainState(q_network, target_network, optimizer, rb, rng, vec_env, obs, h=zeros, c=zeros.clone())
    global_step = run.restore(state)  # 0, or --resume's step (networks, Adam, replay, RNGs restored; new episodes)
    num_vector_steps = 0 if args.eval_only else args.total_timesteps // E
    for step in range(global_step // E, num_vector_steps):
        # 1. act: zero the state at episode starts, epsilon-greedy per env on Q(h_t, .)
        state.prev_action[state.first], state.prev_reward[state.first] = NO_ACTION, 0.0
        q, (state.h, state.c), (h_before, c_before) = actor_step(
            q_network, state.obs, state.prev_action, state.prev_reward, state.first, (state.h, state.c)
        )
        greedy = q.argmax(-1).cpu().numpy()  # (E,)
        explore = rng.random(E) < epsilons
        action = np.where(explore, rng.integers(num_actions, size=E), greedy)

        # 2. step the envs (NEXT_STEP autoreset: after a final row, this step is the reset step)
        next_obs, reward, term, trunc, infos = vec_env.step(action)
        reward = np.where(state.final, 0.0, reward).astype(np.float32)  # the reset step's reward is not a reward
        rb.add(**state.row(), h=h_before, c=c_before, action=action, reward=reward)
        global_step += E
        state.ep_return += reward
        state.ep_length += ~state.final
        for e in np.nonzero(state.final)[0]:  # the previous step ended these episodes; log them
            ep_return, ep_length = state.ep_return[e], state.ep_length[e]
            state.ep_returns.append(ep_return)
            state.ep_lengths.append(ep_length)
            run.log(global_step, {"charts/episodic_return": ep_return, "charts/episodic_length": ep_length})
            state.ep_return[e], state.ep_length[e] = 0.0, 0
        state.first, state.final, state.terminal = next_row_flags(state.final, term, trunc)
        state.obs, state.prev_action, state.prev_reward = next_obs, action, reward

        # 3. evaluation during training (--select-frequency), and the kept network (--keep-best)
        if args.select_frequency and global_step // args.select_frequency != (global_step - E) // args.select_frequency:
            sel_seed = SELECT_SEED_BASE + SELECT_SEED_STRIDE * args.seed + global_step
            sel = evaluate(q_network, eval_env, args.select_episodes, sel_seed, device)
            sel_return = float(sel["ret"].mean())
            run.log(global_step, {"select/episodic_return": sel_return})
            print(f"SELECT global_step={global_step} return={sel_return:.1f}")
            if global_step > (1.0 - LATE_TRAINING_FRACTION) * args.total_timesteps:
                state.late_selects.append(sel_return)
            if sel_return >= state.best_return:
                state.best_return, state.best_step = sel_return, global_step
                state.best_model = {key: value.clone() for key, value in q_network.state_dict().items()}

        # 4. learn: sample prioritized sequences, burn in, n-step double-Q targets on h-rescaled values
        if global_step >= args.learning_starts and step % args.train_frequency == 0 and rb.num_sequences() > 0:
            learn_start = time.perf_counter()
            ids, weights = rb.sample(B, args.priority_exponent, args.importance_exponent, rng)
            win = to_torch(rb.gather(ids), device)
            if args.state_init == "stored":
                state0 = (win["h0"], win["c0"])
            else:
                state0 = (torch.zeros(B, H, device=device), torch.zeros(B, H, device=device))
            q_all, _ = unroll(q_network, win, state0, burn_in)  # (m + n, B, A) online Q of anchor .. end
            with torch.no_grad():
                q_target_all, _ = unroll(target_network, win, state0, burn_in)  # (m + n, B, A)
                best = q_all.argmax(-1, keepdim=True)  # double Q: online argmax, target evaluation
                boot_values = inverse_value_rescale(q_target_all.gather(-1, best).squeeze(-1), eps_v)  # (m + n, B)
                final_f, terminal_f = win["final"][burn_in:].float(), win["terminal"][burn_in:].float()
                targets = nstep_rescaled_targets(
                    win["reward"][burn_in:], final_f, terminal_f, boot_values, args.gamma, n, m, eps_v
                )  # (m, B)
                mask = torch.cumprod(1.0 - final_f[:m], dim=0)  # (m, B) 1 up to the episode's last action
            q_taken = q_all[:m].gather(-1, win["action"][burn_in : burn_in + m, :, None]).squeeze(-1)  # (m, B)
            td = targets - q_taken
            w = torch.as_tensor(weights, dtype=torch.float32, device=device)
            per_seq = 0.5 * (td**2 * mask).sum(0) / mask.sum(0).clamp(min=1.0)  # (B,)
            loss = (w * per_seq).mean()

            # 5. Delta-Q: the learner's Q (stored/zero state + burn-in) vs Q from the state recomputed from the
            #    episode's first row. CRUCIAL: before optimizer.step(), so that both use the same parameters
            if (state.num_updates_done + 1) % args.delta_q_frequency == 0:
                dq = measure_delta_q(q_network, rb, ids, q_all.detach(), mask, burn_in)
                if dq is not None:
                    state.delta_q_log.append((dq["first"], dq["last"], dq["first_at_episode_start"]))
                    run.log(global_step, {"model/delta_q_first": dq["first"], "model/delta_q_last": dq["last"]})

            # 6. gradient step, new priorities, target network copy
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1.0 - global_step / args.total_timesteps)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
            optimizer.step()
            new_priorities = sequence_priority(td.detach().abs(), mask, args.priority_eta)
            rb.update_priorities(ids, new_priorities.cpu().numpy().astype(np.float64))
            state.num_updates_done += 1
            if state.num_updates_done % args.target_network_frequency == 0:
                target_network.load_state_dict(q_network.state_dict())
            state.learner_seconds += time.perf_counter() - learn_start  # (with step 5's Delta-Q when it runs)

            if state.num_updates_done % LOG_EVERY_UPDATES == 0:
                sps = int(global_step / (time.time() - run.start_time))
                losses = {"losses/td_loss": loss.item(), "losses/q_values": q_taken.mean().item(), "charts/SPS": sps}
                run.log(global_step, losses | {"charts/learning_rate": optimizer.param_groups[0]["lr"]})
                recent = np.mean(state.ep_returns[-50:]) if state.ep_returns else float("nan")
                print(f"global_step={global_step} return(last 50)={recent:.2f} td_loss={loss.item():.4f} SPS={sps}")
        run.end_step(global_step, state)  # a checkpoint every --save-every env steps; Ctrl-C / SIGTERM: one, then exit
    run.end_training()  # Ctrl-C / SIGTERM stop at once again (a resume would redo what follows)
    vec_env.close()

    # after training: the one-network Delta-Q ablation, then the greedy evaluation (of the kept network: --keep-best)
    final_dq = {} if args.eval_only else final_delta_q(q_network, rb, rng, args.final_delta_q_sequences, device)
    metrics = {"model/final_delta_q_" + key: value for key, value in final_dq.items() if key != "count"}
    if args.keep_best and state.best_model is not None:  # evaluate the last network too, then switch to the kept one
        last = evaluate(q_network, eval_env, args.eval_episodes, eval_env_seed(args.seed), device)
        metrics |= {
            "eval/last_network_episodic_return": last["ret"].mean(),
            "select/best_global_step": state.best_step,
            "select/best_episodic_return": state.best_return,
        }
        q_network.load_state_dict(state.best_model)
    result = evaluate(q_network, eval_env, args.eval_episodes, eval_env_seed(args.seed), device)
    metrics |= {
        "eval/episodic_return": result["ret"].mean(),
        "eval/episodic_return_std": result["ret"].std(),
        "eval/episodic_length": result["length"].mean(),
    }
    if not np.isnan(result["success"]).all():  # the env reports info["success"] (TMaze, Tiger)
        metrics["eval/success_rate"] = np.nanmean(result["success"])
    if state.late_selects:  # the end of the training curve, next to the final evaluation
        metrics["select/late_episodic_return"] = np.mean(state.late_selects)
    if state.delta_q_log:  # averaged over the last quarter of training's measurements
        tail = np.array(state.delta_q_log[-max(1, len(state.delta_q_log) // 4) :])
        metrics |= {"model/delta_q_first": tail[:, 0].mean(), "model/delta_q_last": tail[:, 1].mean()}
        if not np.isnan(tail[:, 2]).all():
            metrics["model/delta_q_first_episode_start"] = np.nanmean(tail[:, 2])
    if not args.eval_only:  # the O(T) replay and what full histories per step would need (O(T^2)); learner time
        metrics.update({f"replay/{key}": value for key, value in replay_bytes(rb).items()})
        metrics["perf/learner_ms_per_update"] = 1000.0 * state.learner_seconds / max(state.num_updates_done, 1)
    run.log(global_step, metrics)
    run.finish(metrics, {"model": q_network}, global_step)  # the model, summary.json; the checkpoint deleted


@torch.no_grad()
def evaluate(net, make_env, episodes: int, seed: int, device) -> dict:
    """Greedy episodes, one after the other in one env from `make_env()`: returns, lengths, success (NaN where
    undefined)."""
    env = make_env()
    returns, lengths, successes = [], [], []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        state = (torch.zeros(1, net.hidden_size, device=device), torch.zeros(1, net.hidden_size, device=device))
        prev_action, prev_reward, total, success = NO_ACTION, 0.0, 0.0, np.nan
        for length in range(1, MAX_EVAL_STEPS + 1):  # noqa: B007  (read after the loop)
            z = net.encode(
                torch.as_tensor(obs, dtype=torch.float32, device=device)[None, None],
                torch.tensor([[prev_action]], device=device),
                torch.tensor([[prev_reward]], dtype=torch.float32, device=device),
            )  # (1, 1, H)
            out, state = net.core(z, state)
            action = int(net.head(out)[0, 0].argmax())
            obs, reward, terminated, truncated, info = env.step(action)
            total, prev_action, prev_reward = total + float(reward), action, float(reward)
            if terminated or truncated:
                success = float(info["success"]) if "success" in info else np.nan
                break
        returns.append(total)
        lengths.append(length)
        successes.append(success)
    env.close()
    return dict(ret=np.array(returns), length=np.array(lengths), success=np.array(successes))


# === ANALYSIS (measurements for the docs; not needed to train) ===
@torch.no_grad()
def measure_delta_q(net, rb, ids, q_learner: torch.Tensor, mask: torch.Tensor, burn_in: int) -> dict | None:
    """Delta-Q of the sampled sequences `ids` whose episode start is still in the ring (None if there is none).
    q_learner (m + n, B, A): the learner's Q-values computed with the SAME parameters `net` has now (call this before
    optimizer.step()); the true state is recomputed by unrolling `net` from the episode's first row. Returns the mean
    Delta-Q at the first and the last trained (mask = 1) row, at the first row of sequences that start an episode
    (must be 0: the zero state is exact there; nan if there is none), and the number of sequences."""
    sel = np.nonzero(rb.seq_ep_start[ids] >= rb.t - rb.cap)[0]
    if len(sel) == 0:
        return None
    keep_ids = ids[sel]
    prefix = int((rb.seq_anchor[keep_ids] - rb.seq_ep_start[keep_ids]).max())  # rows before t0
    device = q_learner.device
    full = to_torch(rb.gather(keep_ids, prefix=max(prefix - burn_in, 0)), device)
    zeros = (torch.zeros(len(keep_ids), net.hidden_size, device=device),) * 2
    q_true, _ = unroll(net, full, zeros, max(prefix - burn_in, 0) + burn_in)  # (m + n, b, A)
    q_learner = q_learner[:, sel]  # (m + n, b, A)
    last = (mask[:, sel].sum(0).long() - 1).clamp(min=0)  # last trained valid row
    cols = torch.arange(len(sel), device=device)
    dq_first = delta_q(q_learner[0], q_true[0])  # (b,)
    at_start = torch.as_tensor(rb.seq_anchor[keep_ids] == rb.seq_ep_start[keep_ids], device=device)
    return {
        "first": dq_first.mean().item(),
        "last": delta_q(q_learner[last, cols], q_true[last, cols]).mean().item(),
        "first_at_episode_start": dq_first[at_start].mean().item() if at_start.any() else float("nan"),
        "count": len(sel),
    }


@torch.no_grad()
def final_delta_q(net, rb, rng: np.random.Generator, num_sequences: int, device) -> dict:
    """The ablation on ONE network: Delta-Q of the same replayed sequences started three ways. On up to
    `num_sequences` sequences that start mid-episode and whose episode start is stored, Q at the first and last
    trained row from zeros at t0 (`zero`), from the state stored at t0 (`stored`), or from the state stored at
    t0 - burn_in and the burn-in (`stored_burn_in`), against Q from the state recomputed from the episode start.
    On one network the three differ only in the initial state, not in training noise. Returns means and "count"."""
    mid_episode = rb.seq_anchor > rb.seq_ep_start
    ok = np.nonzero(rb.valid() & mid_episode & (rb.seq_ep_start >= rb.t - rb.cap))[0]
    if len(ok) == 0:
        return {}
    ids = rng.choice(ok, size=min(num_sequences, len(ok)), replace=False)
    burn_in, H = rb.burn_in, net.hidden_size
    prefix = int((rb.seq_anchor[ids] - rb.seq_ep_start[ids]).max())  # rows from the episode start to t0
    full = to_torch(rb.gather(ids, prefix=max(prefix - burn_in, 0)), device)
    zeros = (torch.zeros(len(ids), H, device=device), torch.zeros(len(ids), H, device=device))
    q_true, _ = unroll(net, full, zeros, max(prefix - burn_in, 0) + burn_in)  # (m + n, b, A) from the episode start
    win = to_torch(rb.gather(ids), device)  # rows t0 - burn_in .. t0 + m + n
    trained = {key: value[burn_in:] for key, value in win.items() if key not in ("h0", "c0")}  # rows t0 ..
    anchor_rows, cols = rb.seq_anchor[ids] % rb.cap, rb.seq_env[ids]
    stored_t0 = (
        torch.as_tensor(rb.h[anchor_rows, cols], device=device),
        torch.as_tensor(rb.c[anchor_rows, cols], device=device),
    )
    variants = {"zero": unroll(net, trained, zeros, 0)[0], "stored": unroll(net, trained, stored_t0, 0)[0]}
    if burn_in > 0:
        variants["stored_burn_in"] = unroll(net, win, (win["h0"], win["c0"]), burn_in)[0]
    mask = torch.cumprod(1.0 - trained["final"][: rb.m].float(), dim=0)  # (m, b) trained rows
    last = (mask.sum(0).long() - 1).clamp(min=0)
    col = torch.arange(len(ids), device=device)
    out = {"count": float(len(ids))}
    for name, q in variants.items():
        out[f"first_{name}"] = delta_q(q[0], q_true[0]).mean().item()
        out[f"last_{name}"] = delta_q(q[last, col], q_true[last, col]).mean().item()
    return out


def replay_bytes(rb) -> dict:
    """Bytes of the replay's filled rows as stored (O(T): each step once, with the state (h, c)), and if each row
    stored its full history instead of a state (O(T^2) per episode): the row at episode step k holds the inputs
    (o_j, a_{j-1}, r_{j-1}, j = 0..k) and its other fields. The sequence table is not counted (the same for both)."""
    rows = min(rb.t, rb.cap) * rb.E
    if rows == 0:
        return {"bytes": 0.0, "bytes_full_histories": 0.0, "full_histories_ratio": float("nan")}
    per_row = lambda names: sum(getattr(rb, name).itemsize * getattr(rb, name)[0, 0].size for name in names)  # noqa: E731
    inputs = per_row(("obs", "prev_action", "prev_reward"))
    state = per_row(("h", "c"))
    other = per_row(("action", "reward", "first", "final", "terminal", "ep_step"))
    filled = rb.ep_step[: min(rb.t, rb.cap)]  # (rows / E, E) episode step of each filled row
    stored = rows * (inputs + other + state)
    full = float((filled.astype(np.float64) + 1.0).sum() * inputs + rows * other)
    return {"bytes": float(stored), "bytes_full_histories": full, "full_histories_ratio": full / stored}


# === RUN MANAGEMENT (not the algorithm: validation, run dir, checkpoints and --resume, Ctrl-C, summary) ===
SCRIPT = Path(__file__).stem  # names this script in summary.json and in checkpoints (--resume checks it)
ARCH_FIELDS = ("env_id", "env_kwargs", "hidden_size", "scale_obs")  # read from a checkpoint's args.json for --eval-only
RESUME_FREE_FIELDS = ("resume", "save_every", "threads", "runs_dir")  # may change on --resume; the rest is the run's
POSITIVE_FIELDS = "threads num_envs batch_size n_step hidden_size train_frequency target_network_frequency".split()
POSITIVE_FIELDS += ["eval_episodes", "delta_q_frequency", "select_episodes", "final_delta_q_sequences"]
ZERO_OK_FIELDS = ("burn_in", "save_every", "select_frequency")  # 0: no burn-in, no periodic checkpoint, no evaluation


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work; `--resume`: the run's own Args, `--eval-only`:
    the env and the architecture of its checkpoint."""
    args = tyro.cli(Args)
    if args.resume is not None and not args.eval_only:
        args = resume_args(args)[0]
    if args.eval_only and args.checkpoint is not None:  # the env and the architecture the checkpoint was trained with
        weights, saved = load_checkpoint(args.checkpoint)
        vars(args).update({name: saved[name] for name in ARCH_FIELDS if name in saved})
        if "lstm.weight_hh_l0" in weights:  # the hidden size is read from the weights: any checkpoint loads
            args.hidden_size = int(weights["lstm.weight_hh_l0"].shape[1])
    window, capacity = args.burn_in + args.seq_len + args.n_step, args.buffer_size // max(args.num_envs, 1)
    for ok, message in [
        (args.resume is None or not args.eval_only, "--resume continues a training run, not --eval-only"),
        (args.checkpoint or not args.eval_only, "--eval-only needs --checkpoint PATH (a run dir or model.safetensors)"),
        *[(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1") for name in POSITIVE_FIELDS],
        *[(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be at least 0") for name in ZERO_OK_FIELDS],
        (args.env_kwargs.lstrip().startswith("{"), f"--env-kwargs must be a JSON object, got {args.env_kwargs}"),
        (0 <= args.seq_overlap < args.seq_len, "need 0 <= --seq-overlap < --seq-len"),
        (args.select_frequency or not args.keep_best, "--keep-best needs --select-frequency > 0"),
        (args.eval_episodes <= EVAL_SEED_STRIDE, f"need --eval-episodes <= {EVAL_SEED_STRIDE} (disjoint seeds)"),
        (args.total_timesteps < SELECT_SEED_STRIDE // 2, f"need --total-timesteps < {SELECT_SEED_STRIDE // 2}"),
        (capacity >= 4 * window, f"--buffer-size: {capacity} rows per env, fewer than 4 windows of {window} rows"),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
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
    """The device, the run dir (new, or the resumed run's) with tensorboard and args.json, the Ctrl-C / SIGTERM flag
    while training; log, load_model, restore, end_step, end_training, finish. The checkpoint (every --save-every env
    steps, on a stop signal; deleted at the end): every TrainState field but the envs, the RNGs, args, elapsed time."""

    def __init__(self, args: Args):
        check_env(args.env_id, args.env_kwargs)  # after seeding (making an env may draw), before any run dir exists
        self.args, self.start_time, self.resuming = args, time.time(), args.resume is not None
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        self.checkpoint = read_train_state(Path(args.resume)) if self.resuming else None
        name = f"{args.env_id.replace('/', '-').replace(':', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.run_dir = Path(args.resume) if self.resuming else None
        for suffix in range(0 if self.resuming else 10**6):  # a new run dir (mkdir is atomic): -1, -2, ... if taken
            self.run_dir = Path(args.runs_dir) / (f"{name}-{suffix}" if suffix else name)
            try:
                self.run_dir.mkdir(parents=True)
                break
            except FileExistsError:  # taken: the next suffix
                continue
            except OSError as err:
                raise SystemExit(f"error: --runs-dir {args.runs_dir}: {err.strerror}") from None
        purge = self.checkpoint["global_step"] + 1 if self.resuming else None  # drop what a killed run logged after
        self.writer = SummaryWriter(str(self.run_dir), purge_step=purge)  # its checkpoint: tensorboard goes on there
        if not self.resuming:
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
            (self.run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
        self.stop = None if args.eval_only else install_stop_handlers()  # Ctrl-C / SIGTERM: a checkpoint, then exit

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
            raise SystemExit(f"error: checkpoint does not fit: {str(err).strip().splitlines()[0]}") from None

    def restore(self, state: TrainState) -> int:
        """--resume: the checkpoint into `state` and the RNGs, then new episodes (`close_episodes`; the envs reset with
        a seed drawn from the run's seed and the step, a zero LSTM state). Returns the env steps done (else 0)."""
        if not self.resuming:
            return 0
        for name, value in self.checkpoint["state"].items():
            current = getattr(state, name)
            if hasattr(current, "load_state_dict"):  # networks, optimizer, replay
                current.load_state_dict(value)
            elif name == "rng":
                current.bit_generator.state = value
            else:
                setattr(state, name, value.tolist() if isinstance(current, list) else value)
        set_rng_state(self.checkpoint["rng_state"])
        step, self.start_time = self.checkpoint["global_step"], time.time() - self.checkpoint["elapsed_s"]
        close_episodes(state)
        seed = int(np.random.SeedSequence([self.args.seed, step]).generate_state(1)[0])  # draws no global RNG
        state.obs = state.vec_env.reset(seed=seed)[0]
        state.h, state.c = torch.zeros(2, *state.h.shape, device=self.device)
        state.__post_init__()  # every env at the first row of an episode
        print(f"resumed {self.run_dir} at global_step={step}, new episodes from env seed {seed}")
        return step

    def end_step(self, step: int, state: TrainState) -> None:
        """A checkpoint after each multiple of --save-every env steps (but the last step) and on a stop signal, which
        then exits with STOP_EXIT_CODE."""
        args, E = self.args, self.args.num_envs
        due = args.save_every and step // args.save_every != (step - E) // args.save_every
        if self.stop["signal"] or (due and step < args.total_timesteps // E * E):
            fields = {"rng": state.rng.bit_generator.state}  # and below: the envs are left out (new episodes)
            for name, value in vars(state).items():
                if hasattr(value, "state_dict"):  # networks, optimizer, replay
                    fields[name] = value.state_dict()
                elif name not in ("vec_env", "rng"):
                    fields[name] = np.asarray(value) if isinstance(value, list) else value
            extra = {"rng_state": rng_state(), "elapsed_s": time.time() - self.start_time, "args": asdict(args)}
            save_train_state(self.run_dir, {"global_step": step, "state": fields} | extra)
            self.writer.flush()
        if self.stop["signal"]:
            self.writer.close()
            print(f"stopped at step {step}; continue: python {sys.argv[0]} --resume {self.run_dir}", file=sys.stderr)
            raise SystemExit(STOP_EXIT_CODE)

    def end_training(self) -> None:
        """Training is over: Ctrl-C and SIGTERM stop the run at once again (a resume would redo what follows)."""
        if self.stop is not None:
            restore_signal_handlers(self.stop)
            self.stop = None

    def finish(self, metrics: dict, models: dict, samples: int) -> None:
        """`{name}.safetensors` per model, then summary.json (written last, by a rename: a finished run has it); the
        checkpoint deleted (a finished run is not resumed)."""
        self.end_training()
        for name, module in models.items():
            save_file(module.state_dict(), str(self.run_dir / f"{name}.safetensors"))
        wall_time, metrics = time.time() - self.start_time, {key: float(value) for key, value in metrics.items()}
        summary = {"script": SCRIPT, "run_name": self.run_dir.name, "run_dir": str(self.run_dir)}
        summary |= {"args": asdict(self.args), "metrics": metrics, "wall_time_s": wall_time, "sps": samples / wall_time}
        (self.run_dir / ".summary.json").write_text(json.dumps(summary, indent=2))  # then renamed: never half written
        os.replace(self.run_dir / ".summary.json", self.run_dir / "summary.json")
        (self.run_dir / TRAIN_STATE).unlink(missing_ok=True)
        self.writer.close()
        print(json.dumps(metrics, indent=2), f"run dir: {self.run_dir}", sep="\n")


def start_run(args: Args) -> Run:
    return Run(args)  # the device, the run dir (new, or the resumed run's), tensorboard, Ctrl-C / SIGTERM handlers


def close_episodes(state: TrainState) -> None:
    """--resume begins new episodes: the row each env was at becomes its episode's final row, a truncation (bootstrapped
    from) where the episode had not ended, so the replay registers its last sequences and none runs into the next."""
    keep = ~state.first  # a reset row: no previous action, reward or LSTM state
    row = state.row() | {"final": np.ones_like(keep), "prev_action": np.where(keep, state.prev_action, NO_ACTION)}
    h, c = (value.cpu().numpy() * keep[:, None] for value in (state.h, state.c))
    no_action = {"action": np.zeros(len(keep), np.int64), "reward": np.zeros(len(keep), np.float32)}  # a final row's
    state.rb.add(**row | {"prev_reward": np.where(keep, state.prev_reward, 0.0)}, h=h, c=c, **no_action)


TRAIN_STATE = "train_state.safetensors"  # RUN_DIR/<this>: the checkpoint of training that --resume continues from


def save_train_state(run_dir: Path, state: dict) -> None:
    """nanoGPT's checkpoint without pickle: torch's pytree splits `state` into leaves; its tensors and arrays go into
    one safetensors file, the other leaves and the tree into its JSON header. Written under a temporary name and
    renamed: a kill leaves the previous checkpoint or this one, never half of one."""
    leaves, tree = pytree.tree_flatten(state)
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor | np.ndarray)]
    tensors = {str(i): torch.as_tensor(leaves[i]).detach().cpu().contiguous().clone() for i in arrays}  # tied: copied
    rest = json.dumps([None if str(i) in tensors else leaf for i, leaf in enumerate(leaves)])
    numpy = json.dumps([i for i in arrays if isinstance(leaves[i], np.ndarray)])
    meta = {"script": SCRIPT, "tree": pytree.treespec_dumps(tree), "rest": rest, "numpy": numpy}
    save_file(tensors, str(run_dir / f".tmp_{TRAIN_STATE}"), metadata=meta)
    os.replace(run_dir / f".tmp_{TRAIN_STATE}", run_dir / TRAIN_STATE)


def read_train_state(run_dir: Path) -> dict:
    """The `state` save_train_state wrote in `run_dir` (tensors on the CPU, arrays as numpy); a one-line error if it
    is missing, unreadable, or a checkpoint of another script."""
    try:
        with safe_open(str(run_dir / TRAIN_STATE), "pt") as file:
            meta, tensors = file.metadata(), {key: file.get_tensor(key) for key in file.keys()}
        if meta["script"] != SCRIPT:
            raise SystemExit(f"error: {run_dir} is a run of {meta['script']}.py, not of {SCRIPT}.py")
        leaves, tree, numpy = json.loads(meta["rest"]), pytree.treespec_loads(meta["tree"]), json.loads(meta["numpy"])
    except (SafetensorError, OSError, KeyError, TypeError, ValueError, RuntimeError) as err:
        raise SystemExit(f"error: cannot read checkpoint {run_dir / TRAIN_STATE}: {err}") from None
    leaves = [tensors[str(i)].numpy() if i in numpy else tensors.get(str(i), leaf) for i, leaf in enumerate(leaves)]
    return pytree.tree_unflatten(leaves, tree)


def rng_state() -> dict:
    """The global RNGs training draws from (python, numpy, torch, CUDA), for the checkpoint."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict) -> None:
    """Put back what rng_state returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_args(cli: Args) -> tuple[Args, dict]:
    """`--resume RUN_DIR`: the run's own Args (RESUME_FREE_FIELDS as given on the command line) and its checkpoint;
    one-line errors for a finished run, another script's run, or an argument given that differs from the run's."""
    run_dir = Path(cli.resume)
    if (run_dir / "summary.json").is_file():
        raise SystemExit(f"error: run {run_dir} has finished (summary.json exists); there is nothing to resume")
    checkpoint, defaults = read_train_state(run_dir), asdict(Args())
    saved, given = checkpoint["args"], {key: value for key, value in asdict(cli).items() if value != defaults[key]}
    for key, value in given.items():
        if key not in RESUME_FREE_FIELDS and value != saved.get(key):
            message = f"--{key.replace('_', '-')} {value} differs from the run's {saved.get(key)}"
            raise SystemExit(f"error: {message}; --resume continues a run with its own arguments")
    try:
        return Args(**(saved | {key: value for key, value in given.items() if key in RESUME_FREE_FIELDS})), checkpoint
    except TypeError as err:
        raise SystemExit(f"error: the arguments saved in {run_dir} do not fit this script: {err}") from None


STOP_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a job stopped by Ctrl-C (a SIGTERM stop exits alike)


def install_stop_handlers() -> dict:
    """Ctrl-C and SIGTERM (what torchrun's agent, job schedulers and `kill` send) set stop["signal"]: training writes a
    checkpoint at the end of its step and exits with STOP_EXIT_CODE. A second Ctrl-C stops at once; a repeated SIGTERM
    changes nothing. stop["previous"]: the handlers before, which restore_signal_handlers puts back."""
    stop = {"signal": None}

    def handler(signum, frame):
        if signum == signal.SIGINT and stop["signal"]:
            raise KeyboardInterrupt
        if not stop["signal"]:  # os.write, not print: a handler that prints while the loop prints raises
            stop["signal"] = signal.Signals(signum).name
            os.write(2, f"\n{stop['signal']}: a checkpoint after this step, then exit (Ctrl-C again: now)\n".encode())

    stop["previous"] = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    return stop


def restore_signal_handlers(stop: dict) -> None:
    """Training is over: Ctrl-C and SIGTERM stop the run at once again (a resume would redo what follows)."""
    for sig, previous in stop["previous"].items():
        signal.signal(sig, previous)


if __name__ == "__main__":
    main()
