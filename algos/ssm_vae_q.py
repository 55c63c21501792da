"""Latent state-space model (sequence VAE) + DQN on the belief state, with a Markovian-model baseline.

Observations of a POMDP are not Markov, so neither Q-learning on o_t nor a model p(o' | o, a) is valid. The
lecture's fix: learn a sequence VAE whose latent state s_t = (h_t, z_t) has Markovian dynamics, an observation model
p(o_t | s_t) and a filtering encoder q(z_t | o_<=t, a_<t); Q-learning on s_t is valid again. Lecture claim shown
(Problem 21.2, two doors): after one failed try, the latent model predicts that retrying the SAME door passes with
p ~ 0 and the OTHER door with p ~ 1, while a count model p(o' | o, a) fit on the same replay predicts ~0.5 for both,
whatever the history; Q-learning on the belief reaches the memory-optimal return 0.95.

Key equations (RSSM of PlaNet [1]; a replayed chunk, t = 1..T; h_0 = z_0 = 0 at an episode start):
    h_t = GRU(h_{t-1}, [z_{t-1}, a_{t-1}]),  prior p(z_t | h_t),  posterior q(z_t | h_t, o_t)   (diagonal Gaussians)
    decoders p(o_t | s_t) = N(dec_o, obs_std),  p(r_t | s_t) = N(dec_r, 1),  p(done_t | s_t) = Bernoulli(dec_d)
    ELBO = sum_t E_q[log p(o_t|s_t) + log p(r_t|s_t) + log p(done_t|s_t)] - KL(q(z_t|.) || p(z_t|h_t))
    KL loss (free nats F, balance alpha [3]): alpha max(F, KL(sg q || p)) + (1-alpha) max(F, KL(q || sg p))
    Double DQN on x_t = sg[(h_t, mu_q,t)]:
        y_t = r_{t+1} + gamma (1 - term_{t+1}) Q_targ(x_{t+1}, argmax_a Q(x_{t+1}, a)),  loss (Q(x_t, a_t) - y_t)^2

Implementation details:
1. Replay holds per-env streams of (o_t, a_{t-1}, r_t, term_t, is_first_t) (Dreamer's layout [3]); the step after a
   done (gymnasium's NEXT_STEP autoreset) is an `is_first` entry, so no transition crosses an episode boundary.
2. Updates filter B random chunks of length T from a zero state. The ELBO masks the first `--burn-in` entries whose
   history the chunk start cut; Q trains only on complete histories (`q_loss_mask`): a mid-episode belief filtered
   from zeros is one acting never has (TMaze: no cue). `--q-burn-in N` also trains Q from position N of such chunks.
3. Q reads h_t and the posterior mean (less noise than a sample, same information) and does not train the world
   model (features detached, as SLAC [2] and Dreamer [3]): the ELBO alone shapes the latent, not TD targets.
4. The ELBO step and the Q step share one filtering pass over the same sampled chunks.
5. Markovian baseline: counts N(o, a, o') of the replayed transitions (binary-coded observations only), on the
   uniform-random warm-up (door-symmetric data, the lecture's setting) and on the whole replay.
6. TwoDoors probe: particles filtered through (reset, try a door, fail), then one step imagined under the prior for
   the same and the other door; and p(pass within k tries of one door) against the truth 1/2 (Problem 21.2(b)):
   Markov 1 - (1 - p)^k, latent 1 - prod_j (1 - p_j) with p_j predicted after the j - 1 failures filtered in.
7. The prior's prediction of o_{t+1}, before the filter sees it, gives a held-out one-step error (online, eval).
8. Observations pass gymnasium's FlattenObservation (one-hot discrete parts, flat Box, Tuple/Dict joined).
9. Q's learning rate anneals linearly to 0; the world model's does not (the ELBO is stationary; annealed, it lost the
   door memory). `--select-frequency N --keep-best` keeps the networks of the best greedy evaluation during
   training; evaluations draw z from their own seeded generator.
Scaled down: vector observations, h 64 / z 8, Gaussian z, DQN instead of an actor-critic in imagination.
References: [1] Hafner et al., "Learning Latent Dynamics for Planning from Pixels" (PlaNet), ICML 2019; [2] Lee et
al., "Stochastic Latent Actor-Critic" (SLAC), NeurIPS 2020; [3] Hafner et al., "Mastering Atari with Discrete World
Models" (DreamerV2), ICLR 2021; [4] CleanRL dqn.py; [5] the lecture, Problem 21.2. More: docs/ssm_vae_q.md.
Reproduce (the TwoDoors claims):  python algos/ssm_vae_q.py --env-id seqrl/TwoDoors-v0 --seed 1
"""

import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
from envs.pomdp import true_pass_probability  # noqa: E402  (importing envs registers the seqrl/ environments)

MIN_STD = 0.1  # lower bound of the latent standard deviations (PlaNet's min_stddev), keeps the KL finite
PROBE_PARTICLES = 1000  # Monte Carlo particles for the TwoDoors probe probabilities
MAX_CODE_BITS = 12  # Markov baseline only for binary observations of at most 12 bits (4096 codes)
EVAL_SEED_STRIDE = 10_000  # eval env i of training seed s gets seed 10_000 (s + 1) + i: disjoint sets per seed
SELECT_SEED_BASE = 10**9  # evaluations during training: env seeds 1e9 + 1e7 s + global_step + i, disjoint from
SELECT_SEED_STRIDE = 10**7  # the final evaluation's and across training seeds (global_step + i < 1e7)
MAX_TRIES = 5  # TwoDoors: p(pass within k tries of the same door) is reported for k = 1..5


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """if toggled (and available), use the GPU"""
    threads: int = 1
    """torch CPU threads: 1 lets runs side by side share the cores; more can speed up one run of a real model alone"""
    runs_dir: str = "runs"
    """where run directories are written"""
    env_id: str = "seqrl/TwoDoors-v0"
    """the gymnasium id of the environment (also `module:EnvId`); Discrete actions; observations Box, Discrete,
    MultiBinary, MultiDiscrete, or Tuple/Dict of these (flattened: one-hot per discrete component, concatenated)"""
    env_kwargs: str = "{}"
    """JSON dict of keyword arguments for gym.make, e.g. '{"corridor_length": 5}'"""
    num_envs: int = 8
    """number of parallel environments (SyncVectorEnv)"""
    total_timesteps: int = 20_000
    """total environment steps of training"""
    eval_episodes: int = 200
    """greedy evaluation episodes at the end"""
    eval_only: bool = False
    """only evaluate the model in --checkpoint"""
    checkpoint: str | None = None
    """run dir or model.safetensors to load for --eval-only"""

    # world model (sequence VAE)
    deter_size: int = 64
    """size of the deterministic GRU state h_t"""
    stoch_size: int = 8
    """size of the stochastic latent z_t"""
    hidden_size: int = 64
    """width of the MLPs (embedding, prior, posterior, decoders, Q-network)"""
    obs_std: float = 0.1
    """fixed standard deviation of the Gaussian observation likelihood (smaller = observations weigh more)"""
    free_nats: float = 0.1
    """KL below this many nats per step is not penalized (PlaNet's free nats; PlaNet uses 3 for images, but here
    a whole step carries < 1 nat, and a clamp at 1 nat would leave the prior untrained)"""
    kl_balance: float = 0.8
    """alpha of DreamerV2's KL balancing: weight of training the prior towards the posterior (0.5 = plain KL)"""
    model_lr: float = 3e-3
    """Adam learning rate of the world model"""
    model_max_grad_norm: float = 100.0
    """gradient clipping of the world model"""

    # replay of sequences
    buffer_size: int = 200_000
    """replay capacity in environment steps (over all envs)"""
    batch_size: int = 32
    """number of sequences per update"""
    seq_len: int = 8
    """length of a sampled sequence (chunk)"""
    burn_in: int = 4
    """entries of a chunk before this index whose episode started before the chunk are masked out of the ELBO"""
    q_burn_in: int = 0
    """0: Q is trained only on beliefs whose whole episode is in the chunk (exact); N > 0: also on entries of
    chunks that start mid-episode from position N on (beliefs filtered from zeros over N steps, detail 2)"""

    # DQN on the latent belief state
    q_lr: float = 5e-4
    """Adam learning rate of the Q-network"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 1.0
    """target network update rate (1.0 = hard copy)"""
    target_network_frequency: int = 100
    """updates between target network updates"""
    start_e: float = 1.0
    """starting epsilon of the epsilon-greedy collection"""
    end_e: float = 0.05
    """final epsilon"""
    exploration_fraction: float = 0.3
    """fraction of total_timesteps over which epsilon decays linearly"""
    learning_starts: int = 4_000
    """environment steps of uniformly random actions before learning"""
    train_frequency: int = 1
    """vector steps (num_envs env steps each) between updates"""
    q_max_grad_norm: float = 10.0
    """gradient clipping of the Q-network"""
    anneal_q_lr: bool = True
    """anneal the Q-network's learning rate linearly to 0 over training, so that Q settles (without, TMaze-5 can
    collapse late in training)"""
    anneal_model_lr: bool = False
    """anneal the world model's learning rate too (off: the ELBO is a stationary objective, detail 9)"""
    log_every: int = 100
    """updates between logging the losses"""
    select_frequency: int = 0
    """environment steps between greedy evaluations during training (0 = none), logged as select/episodic_return"""
    select_episodes: int = 20
    """episodes per evaluation during training (env seeds disjoint from the training and the final evaluation)"""
    keep_best: bool = False
    """keep the world model and Q-network of the best evaluation during training (ties: the later one) as the final
    model, like SB3's EvalCallback; the final evaluation runs on fresh episodes, and summary.json also reports the
    last networks (`eval/last_network_*`). Needs --select-frequency"""

    # filled in at runtime
    obs_dim: int = 0
    """observation size (flattened)"""
    num_actions: int = 0
    """number of discrete actions"""


# ---------------------------------------------------------------- pure functions (unit-tested)
def gaussian_kl(mu_q: torch.Tensor, std_q: torch.Tensor, mu_p: torch.Tensor, std_p: torch.Tensor) -> torch.Tensor:
    """KL(N(mu_q, std_q) || N(mu_p, std_p)) of diagonal Gaussians, summed over the last dim: (..., D) -> (...)."""
    var_ratio = (std_q / std_p) ** 2
    return 0.5 * (var_ratio + ((mu_q - mu_p) / std_p) ** 2 - 1.0 - torch.log(var_ratio)).sum(-1)


def kl_loss(post: tuple, prior: tuple, free_nats: float, balance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step KL loss with KL balancing and free nats, and the raw KL(q || p); both (T, B)."""
    kl = gaussian_kl(*post, *prior)
    sg_post, sg_prior = tuple(x.detach() for x in post), tuple(x.detach() for x in prior)
    kl_train_prior = gaussian_kl(*sg_post, *prior).clamp(min=free_nats)  # pulls the prior towards q
    kl_train_post = gaussian_kl(*post, *sg_prior).clamp(min=free_nats)  # regularizes the posterior
    return balance * kl_train_prior + (1.0 - balance) * kl_train_post, kl


def elbo_terms(out: dict, batch: dict, mask: torch.Tensor, obs_std: float, free_nats: float, kl_balance: float):
    """Negative ELBO terms, masked means over valid steps. `out` from WorldModel.observe, all tensors (T, B, ...).

    recon_obs = -log N(o_t; dec_o, obs_std) (summed over dims), recon_reward = -log N(r_t; dec_r, 1),
    recon_done = BCE(term_t, dec_d). Reward and done belong to the transition into o_t, so they are not
    scored on `is_first` entries.
    """
    m = mask.float()  # (T, B)
    m_trans = m * (1.0 - batch["is_first"].float())  # entries that have an incoming transition
    n, n_trans = m.sum().clamp(min=1.0), m_trans.sum().clamp(min=1.0)
    obs_nll = 0.5 * (((batch["obs"] - out["obs_mean"]) / obs_std) ** 2 + np.log(2 * np.pi * obs_std**2)).sum(-1)
    reward_nll = 0.5 * ((batch["reward"] - out["reward_mean"]) ** 2 + np.log(2 * np.pi))
    done_nll = F.binary_cross_entropy_with_logits(out["done_logit"], batch["terminated"].float(), reduction="none")
    kl_l, kl = kl_loss(out["post"], out["prior"], free_nats, kl_balance)
    terms = {
        "recon_obs": (obs_nll * m).sum() / n,
        "recon_reward": (reward_nll * m_trans).sum() / n_trans,
        "recon_done": (done_nll * m_trans).sum() / n_trans,
        "kl": (kl * m).sum() / n,
        "kl_loss": (kl_l * m).sum() / n,
    }
    terms["neg_elbo"] = terms["recon_obs"] + terms["recon_reward"] + terms["recon_done"] + terms["kl"]
    terms["loss"] = terms["recon_obs"] + terms["recon_reward"] + terms["recon_done"] + terms["kl_loss"]
    return terms


def history_complete(is_first: torch.Tensor) -> torch.Tensor:
    """(T, B) bool: an is_first at or before t, so the filter from zeros has the belief that online acting has."""
    return torch.cumsum(is_first.long(), dim=0) > 0


def valid_mask(is_first: torch.Tensor, burn_in: int) -> torch.Tensor:
    """(T, B) bool for the ELBO: the entry's history is complete (`history_complete`) or t >= burn_in."""
    t = torch.arange(is_first.shape[0], device=is_first.device)[:, None]
    return history_complete(is_first) | (t >= burn_in)


def q_loss_mask(is_first: torch.Tensor, q_burn_in: int = 0) -> torch.Tensor:
    """(T-1, B) float: the transitions t -> t+1 Q is trained on (detail 2): inside one episode (no is_first at t+1),
    with a complete history at t or, if q_burn_in > 0, at t >= q_burn_in (the approximation of `--q-burn-in`)."""
    usable = valid_mask(is_first, q_burn_in) if q_burn_in > 0 else history_complete(is_first)
    return (usable[:-1] & ~is_first[1:]).float()


def double_q_target(reward, terminated, q_next_online, q_next_target, gamma: float) -> torch.Tensor:
    """Double DQN target r + gamma (1 - term) Q_targ(x', argmax_a Q(x', a)); q_next_* are (..., A)."""
    best = q_next_online.argmax(-1, keepdim=True)
    return reward + gamma * (1.0 - terminated.float()) * q_next_target.gather(-1, best).squeeze(-1)


def eval_env_seed(seed: int) -> int:
    """First env seed of the final evaluation of training seed `seed`; episode i uses eval_env_seed(seed) + i. Blocks
    of EVAL_SEED_STRIDE seeds: disjoint across training seeds and from the training envs' seeds (seed + i)."""
    return EVAL_SEED_STRIDE * (seed + 1)


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    """epsilon(t): linear from start_e to end_e over `duration` steps, then constant (CleanRL's schedule)."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


# ---------------------------------------------------------------- models
def mlp(inp: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inp, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(), nn.Linear(hidden, out))


class WorldModel(nn.Module):
    """RSSM: deterministic GRU path h_t, stochastic z_t, prior p(z_t|h_t), posterior q(z_t|h_t,o_t), decoders."""

    def __init__(self, obs_dim: int, num_actions: int, deter: int, stoch: int, hidden: int):
        super().__init__()
        self.num_actions, self.deter, self.stoch = num_actions, deter, stoch
        self.embed = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ELU())  # e_t = embed(o_t)
        self.gru_in = nn.Sequential(nn.Linear(stoch + num_actions, hidden), nn.ELU())
        self.gru = nn.GRUCell(hidden, deter)
        self.prior_net = mlp(deter, hidden, 2 * stoch)
        self.post_net = mlp(deter + hidden, hidden, 2 * stoch)
        self.obs_head = mlp(deter + stoch, hidden, obs_dim)
        self.reward_head = mlp(deter + stoch, hidden, 1)
        self.done_head = mlp(deter + stoch, hidden, 1)

    @staticmethod
    def _gaussian(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, raw_std = params.chunk(2, -1)
        return mu, F.softplus(raw_std) + MIN_STD

    def transition(self, h, z, action_onehot):
        """Prior step: h_t = GRU(h_{t-1}, [z_{t-1}, a_{t-1}]); returns h_t and (mu_p, std_p) of p(z_t | h_t)."""
        h = self.gru(self.gru_in(torch.cat([z, action_onehot], -1)), h)  # (B, deter)
        return h, self._gaussian(self.prior_net(h))

    def filter_step(self, h, z, prev_action_onehot, obs, is_first):
        """One step of the filter. is_first (B,) resets (h, z, a) to zero. Returns h, z sample, prior, posterior."""
        keep = (~is_first).float()[:, None]
        h, prior = self.transition(h * keep, z * keep, prev_action_onehot * keep)
        post = self._gaussian(self.post_net(torch.cat([h, self.embed(obs)], -1)))
        z = post[0] + post[1] * torch.randn_like(post[1])  # reparameterized sample (B, stoch)
        return h, z, prior, post

    def decode(self, h, z):
        x = torch.cat([h, z], -1)
        return self.obs_head(x), self.reward_head(x).squeeze(-1), self.done_head(x).squeeze(-1)

    def observe(self, obs, prev_actions, is_first) -> dict:
        """Filter a batch of chunks from a zero state. obs (T, B, O), prev_actions (T, B) long, is_first (T, B)."""
        T, B = is_first.shape
        h = obs.new_zeros(B, self.deter)
        z = obs.new_zeros(B, self.stoch)
        a_onehot = F.one_hot(prev_actions.clamp(min=0), self.num_actions).float()  # (T, B, A)
        hs, zs, prior_mu, prior_std, post_mu, post_std = [], [], [], [], [], []
        for t in range(T):
            h, z, prior, post = self.filter_step(h, z, a_onehot[t], obs[t], is_first[t])
            hs.append(h), zs.append(z), prior_mu.append(prior[0]), prior_std.append(prior[1])
            post_mu.append(post[0]), post_std.append(post[1])
        h, z = torch.stack(hs), torch.stack(zs)  # (T, B, deter), (T, B, stoch)
        obs_mean, reward_mean, done_logit = self.decode(h, z)
        prior, post = (torch.stack(prior_mu), torch.stack(prior_std)), (torch.stack(post_mu), torch.stack(post_std))
        return dict(h=h, z=z, prior=prior, post=post, obs_mean=obs_mean, reward_mean=reward_mean, done_logit=done_logit)


# not dqn_framestack's QNetwork (an MLP on a frame stack): this one reads the world model's belief features
class LatentQNetwork(nn.Module):
    """Q(x, .) on the belief features x = (h_t, mu_q,t)."""

    def __init__(self, deter: int, stoch: int, hidden: int, num_actions: int):
        super().__init__()
        self.net = mlp(deter + stoch, hidden, num_actions)

    def forward(self, feats):
        return self.net(feats)


# ---------------------------------------------------------------- replay of per-env streams
# not r2d2_rnnstate's SequenceReplay (stored sequences with recurrent states): chunks cut from per-env streams
class StreamReplay:
    """Circular buffer of entries (o_t, a_{t-1}, r_t, term_t, is_first_t), shape (capacity, num_envs, ...)."""

    def __init__(self, capacity: int, num_envs: int, obs_dim: int):
        self.cap, self.num_envs, self.pos, self.full = capacity, num_envs, 0, False
        self.obs = np.zeros((capacity, num_envs, obs_dim), np.float32)
        self.prev_action = np.zeros((capacity, num_envs), np.int64)
        self.reward = np.zeros((capacity, num_envs), np.float32)
        self.terminated = np.zeros((capacity, num_envs), bool)
        self.is_first = np.zeros((capacity, num_envs), bool)

    def add(self, obs, prev_action, reward, terminated, is_first):
        i = self.pos
        self.obs[i], self.prev_action[i], self.reward[i] = obs, prev_action, reward
        self.terminated[i], self.is_first[i] = terminated, is_first
        self.pos = (self.pos + 1) % self.cap
        self.full = self.full or self.pos == 0

    def size(self) -> int:
        return self.cap if self.full else self.pos

    def sample(self, batch_size: int, seq_len: int, rng: np.random.Generator, device) -> dict:
        """B chunks of T consecutive entries of one env stream each, never crossing the write head: (T, B, ...)."""
        oldest = self.pos if self.full else 0
        starts = oldest + rng.integers(0, self.size() - seq_len + 1, size=batch_size)
        rows = (starts[None, :] + np.arange(seq_len)[:, None]) % self.cap  # (T, B)
        cols = rng.integers(0, self.num_envs, size=batch_size)[None, :]  # (1, B)
        fields = ("obs", "prev_action", "reward", "terminated", "is_first")
        return {k: torch.as_tensor(getattr(self, k)[rows, cols], device=device) for k in fields}

    def transitions(self, limit: int | None = None):
        """All (o, a, o') of the stored streams (chronological, first `limit` entries per env) as flat arrays."""
        n = self.size() if limit is None else min(limit, self.size())
        rows = ((self.pos if self.full else 0) + np.arange(n)) % self.cap
        obs, act, first = self.obs[rows], self.prev_action[rows], self.is_first[rows]  # (n, E, ...)
        ok = ~first[1:]  # (n-1, E) transition from entry t to t+1 inside an episode
        return obs[:-1][ok], act[1:][ok], obs[1:][ok]


# ---------------------------------------------------------------- env helpers
def make_vector_env(env_id: str, env_kwargs: dict, n: int) -> gym.vector.SyncVectorEnv:
    """`n` envs with gymnasium 1.x's default NEXT_STEP autoreset and a flat float32 observation: FlattenObservation
    one-hot encodes Discrete and each MultiDiscrete component, flattens Box, and concatenates the parts of Tuple/Dict
    (Dict in sorted key order)."""

    def thunk():
        return gym.wrappers.DtypeObservation(
            gym.wrappers.FlattenObservation(gym.make(env_id, **env_kwargs)), np.float32
        )

    return gym.vector.SyncVectorEnv([thunk] * n)


def main():
    args = parse_args()
    env_kwargs = json.loads(args.env_kwargs)  # a JSON dict (parse_args checked it)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    eval_seed = eval_env_seed(args.seed)  # the final evaluation's env seeds: eval_seed + i

    venv = make_vector_env(args.env_id, env_kwargs, args.num_envs)
    args.obs_dim, args.num_actions = venv.single_observation_space.shape[0], int(venv.single_action_space.n)
    model = WorldModel(args.obs_dim, args.num_actions, args.deter_size, args.stoch_size, args.hidden_size)
    q_net = LatentQNetwork(args.deter_size, args.stoch_size, args.hidden_size, args.num_actions)
    target_net = LatentQNetwork(args.deter_size, args.stoch_size, args.hidden_size, args.num_actions)
    networks = nn.ModuleDict({"model": model, "q": q_net})  # saved and loaded together (keys model.*, q.*)
    run = start_run(args)  # device, run dir, tensorboard
    if args.eval_only:
        run.load_model(networks)  # the checkpoint's weights (its architecture came with its args.json)
    device = run.device
    model, q_net, target_net = model.to(device), q_net.to(device), target_net.to(device)
    target_net.load_state_dict(q_net.state_dict())
    model_opt = torch.optim.Adam(model.parameters(), lr=args.model_lr, fused=True)
    q_opt = torch.optim.Adam(q_net.parameters(), lr=args.q_lr, fused=True)
    replay = StreamReplay(max(args.buffer_size // args.num_envs, args.seq_len + 1), args.num_envs, args.obs_dim)
    global_step, updates, metrics = 0, 0, {}  # metrics: what summary.json reports

    # ALGO LOGIC: collect with the online filter, learn model + Q interleaved on replayed chunks
    num_iterations = 0 if args.eval_only else args.total_timesteps // args.num_envs
    decay_steps = max(int(args.exploration_fraction * args.total_timesteps), 1)  # epsilon decays linearly over these
    obs, _ = venv.reset(seed=args.seed)
    venv.action_space.seed(args.seed)
    h = torch.zeros(args.num_envs, args.deter_size, device=device)
    z = torch.zeros(args.num_envs, args.stoch_size, device=device)
    actions = np.zeros(args.num_envs, np.int64)
    is_first = np.ones(args.num_envs, bool)  # the reset observation starts every stream
    reward, terminated = np.zeros(args.num_envs, np.float32), np.zeros(args.num_envs, bool)
    done_prev = np.zeros(args.num_envs, bool)  # env returned terminated|truncated at the previous step()
    ep_return, ep_len, online_err = np.zeros(args.num_envs), np.zeros(args.num_envs), []
    best_return, best_step, best_state = -float("inf"), 0, None  # --keep-best
    for iteration in range(num_iterations):
        # 1. store the entry (o_t, a_{t-1}, r_t, term_t, is_first_t); an autoreset step becomes an is_first entry
        replay.add(
            obs, np.where(is_first, -1, actions), np.where(is_first, 0.0, reward), terminated & ~is_first, is_first
        )
        # 2. filter: s_t from (s_{t-1}, a_{t-1}, o_t); the prior's o_t prediction is a held-out one-step error
        with torch.no_grad():
            o = torch.as_tensor(obs, device=device)
            first_t = torch.as_tensor(is_first, device=device)
            a1h = F.one_hot(torch.as_tensor(actions, device=device), args.num_actions).float()
            h, z, prior, post = model.filter_step(h, z, a1h, o, first_t)
            if not is_first.all():
                err = ((model.decode(h, prior[0])[0] - o) ** 2).mean(-1)[~first_t]
                online_err.extend(err.tolist())
            q_values = q_net(torch.cat([h, post[0]], -1))
        # 3. epsilon-greedy action
        epsilon = linear_schedule(args.start_e, args.end_e, decay_steps, global_step)
        epsilon = 1.0 if global_step < args.learning_starts else epsilon  # uniformly random warm-up
        explore = rng.random(args.num_envs) < epsilon
        actions = np.where(explore, rng.integers(0, args.num_actions, args.num_envs), q_values.argmax(-1).cpu().numpy())
        # 4. step. CRUCIAL (NEXT_STEP autoreset): an env that was done at the previous step() is reset by this
        #    one -- it returns the reset obs, ignores our action and gives reward 0; that entry becomes is_first
        obs, reward, terminated, truncated, _ = venv.step(actions)
        global_step += args.num_envs
        is_first = done_prev.copy()
        ep_return += np.where(is_first, 0.0, reward)
        ep_len += ~is_first
        done_prev = (terminated | truncated) & ~is_first
        for i in np.flatnonzero(done_prev):
            run.log(global_step, {"charts/episodic_return": ep_return[i], "charts/episodic_length": ep_len[i]})
            ep_return[i], ep_len[i] = 0.0, 0

        # 5. learn: one ELBO step and one double-DQN step on the same replayed chunks
        if global_step > args.learning_starts and not iteration % args.train_frequency and replay.size() > args.seq_len:
            frac = 1.0 - iteration / num_iterations  # linear annealing to 0 (--anneal-q-lr, --anneal-model-lr)
            if args.anneal_model_lr:
                model_opt.param_groups[0]["lr"] = frac * args.model_lr
            if args.anneal_q_lr:
                q_opt.param_groups[0]["lr"] = frac * args.q_lr
            batch = replay.sample(args.batch_size, args.seq_len, rng, device)
            out = model.observe(batch["obs"], batch["prev_action"], batch["is_first"])
            mask = valid_mask(batch["is_first"], args.burn_in)  # (T, B)
            terms = elbo_terms(out, batch, mask, args.obs_std, args.free_nats, args.kl_balance)
            model_opt.zero_grad()
            terms["loss"].backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.model_max_grad_norm)
            model_opt.step()
            feats = torch.cat([out["h"], out["post"][0]], -1).detach()  # (T, B, deter+stoch): no Q grad to model
            with torch.no_grad():
                y = double_q_target(
                    batch["reward"][1:], batch["terminated"][1:], q_net(feats[1:]), target_net(feats[1:]), args.gamma
                )  # (T-1, B)
            q_taken = q_net(feats[:-1]).gather(-1, batch["prev_action"][1:].clamp(min=0)[..., None]).squeeze(-1)
            q_mask = q_loss_mask(batch["is_first"], args.q_burn_in)  # (T-1, B) beliefs acting also has
            q_loss = (((q_taken - y) ** 2) * q_mask).sum() / q_mask.sum().clamp(min=1.0)
            q_opt.zero_grad()
            q_loss.backward()
            nn.utils.clip_grad_norm_(q_net.parameters(), args.q_max_grad_norm)
            q_opt.step()
            updates += 1
            if updates % args.target_network_frequency == 0:
                for tp, p in zip(target_net.parameters(), q_net.parameters(), strict=True):
                    tp.data.copy_(args.tau * p.data + (1.0 - args.tau) * tp.data)
            if updates % args.log_every == 0:
                sps = global_step / (time.time() - run.start_time)
                scalars = {f"losses/{k}": v.item() for k, v in terms.items()} | {
                    "losses/q_loss": q_loss.item(),
                    "losses/q_values": (q_taken * q_mask).sum().item() / q_mask.sum().item(),
                    "charts/epsilon": epsilon,
                    "charts/learning_rate": model_opt.param_groups[0]["lr"],
                    "charts/SPS": sps,
                }
                if online_err:
                    scalars["charts/one_step_obs_error_online"] = float(np.mean(online_err))
                    online_err = []
                run.log(global_step, scalars)
                print(
                    f"step {global_step} neg_elbo {terms['neg_elbo'].item():.3f} obs {terms['recon_obs'].item():.3f} "
                    f"rew {terms['recon_reward'].item():.3f} done {terms['recon_done'].item():.3f} "
                    f"kl {terms['kl'].item():.3f} q_loss {q_loss.item():.4f} eps {epsilon:.2f} SPS {sps:.0f}"
                )
                for k in ("recon_obs", "recon_reward", "recon_done", "kl", "neg_elbo"):
                    metrics.setdefault(f"losses/{k}_first", terms[k].item())
                    metrics[f"losses/{k}_last"] = terms[k].item()

        # 6. evaluation during training (--select-frequency), and the kept networks (--keep-best)
        if args.select_frequency and global_step % args.select_frequency < args.num_envs:  # a multiple was crossed
            sel_seed = SELECT_SEED_BASE + SELECT_SEED_STRIDE * args.seed + global_step
            sel = evaluate(model, q_net, args.env_id, env_kwargs, args.select_episodes, sel_seed, device)
            sel_return = sel["eval/episodic_return"]
            run.log(global_step, {"select/episodic_return": sel_return})
            print(f"SELECT step {global_step} return {sel_return:.3f}")
            if sel_return >= best_return:
                best_return, best_step = sel_return, global_step
                best_state = [{k: v.clone() for k, v in net.state_dict().items()} for net in (model, q_net)]
    venv.close()
    if args.keep_best and best_state is not None:  # evaluate the last networks, then switch to the kept ones
        last = evaluate(model, q_net, args.env_id, env_kwargs, args.eval_episodes, eval_seed, device)
        metrics.update({f"eval/last_network_{k[len('eval/') :]}": v for k, v in last.items()})
        metrics.update({"select/best_episodic_return": best_return, "select/best_global_step": float(best_step)})
        model.load_state_dict(best_state[0])
        q_net.load_state_dict(best_state[1])

    # 7. the lecture's measurement (Problem 21.2): latent model vs Markovian model after a failed door
    if args.env_id == "seqrl/TwoDoors-v0":
        metrics.update(two_doors_probe(model, device))
        warmup = args.learning_starts // args.num_envs  # entries per env of uniformly random actions (detail 5)
        if not args.eval_only and not replay.full:  # (a full replay has overwritten them)
            metrics.update(markov_probe(replay, args.num_actions, "markov", limit=warmup))
        if not args.eval_only:
            metrics.update(markov_probe(replay, args.num_actions, "markov_all_replay"))
    elif not args.eval_only and binary_codes(replay.obs[: replay.size()].reshape(-1, args.obs_dim)) is None:
        print("note: observations are not binary codes, so the count-based Markov baseline p(o'|o,a) is skipped")

    # 8. greedy evaluation, then summary.json and the saved networks
    metrics.update(evaluate(model, q_net, args.env_id, env_kwargs, args.eval_episodes, eval_seed, device))
    run.log(global_step, metrics)
    print(" ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("eval/")))
    run.finish(metrics, {"model": networks}, global_step)


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, q_net, env_id, env_kwargs, episodes: int, seed: int, device) -> dict:
    """Greedy episodes (one per env of a vector env) + held-out one-step observation prediction error. The z samples
    come from a generator seeded with `seed`; the training RNG stream is left untouched (detail 9)."""
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed)
        venv = make_vector_env(env_id, env_kwargs, episodes)
        obs, _ = venv.reset(seed=seed)
        h = torch.zeros(episodes, model.deter, device=device)
        z = torch.zeros(episodes, model.stoch, device=device)
        a_prev = torch.zeros(episodes, dtype=torch.long, device=device)
        is_first = torch.ones(episodes, dtype=torch.bool, device=device)
        done = np.zeros(episodes, bool)
        was_live = np.ones(episodes, bool)  # env was still in its first episode when it produced the current obs
        returns, lengths, success = np.zeros(episodes), np.zeros(episodes), np.full(episodes, np.nan)
        sq_err, copy_err, n_err = 0.0, 0.0, 0
        prev_obs = torch.as_tensor(obs, device=device)
        while not done.all():
            o = torch.as_tensor(obs, device=device)
            a1h = F.one_hot(a_prev, model.num_actions).float()
            h, z, prior, post = model.filter_step(h, z, a1h, o, is_first)
            if not is_first.all():  # prior prediction of o_t from (s_{t-1}, a_{t-1}) before the filter saw o_t
                live = torch.as_tensor(was_live, device=device) & ~is_first
                pred = model.decode(h, prior[0])[0]
                sq_err += ((pred - o) ** 2).mean(-1)[live].sum().item()
                copy_err += ((prev_obs - o) ** 2).mean(-1)[live].sum().item()
                n_err += int(live.sum())
            action = q_net(torch.cat([h, post[0]], -1)).argmax(-1)
            obs, reward, term, trunc, info = venv.step(action.cpu().numpy())
            live = ~done
            was_live = live.copy()
            returns[live] += reward[live]
            lengths[live] += 1
            ended = live & (term | trunc)
            if "success" in info:
                success[ended & info["_success"]] = info["success"][ended & info["_success"]]
            done |= ended
            prev_obs, a_prev, is_first = o, action, torch.zeros_like(is_first)
        venv.close()
        metrics = {
            "eval/episodic_return": float(returns.mean()),
            "eval/episodic_return_std": float(returns.std()),
            "eval/episodic_length": float(lengths.mean()),
            "eval/one_step_obs_error": sq_err / max(n_err, 1),
            "eval/one_step_obs_error_copy_last": copy_err / max(n_err, 1),  # baseline: predict o_t = o_{t-1}
        }
        if not np.isnan(success).all():
            metrics["eval/success_rate"] = float(np.nanmean(success))
        return metrics


# === ANALYSIS (measurements for the docs; not needed to train)
def binary_codes(obs: np.ndarray) -> np.ndarray | None:
    """Integer code sum_i bit_i 2^i of binary observations (N, D) -> (N,), or None if obs are not binary."""
    if obs.shape[-1] > MAX_CODE_BITS or not np.isin(obs, (0.0, 1.0)).all():
        return None
    return (obs.astype(np.int64) << np.arange(obs.shape[-1])).sum(-1)


def markov_counts(codes: np.ndarray, actions: np.ndarray, next_codes: np.ndarray, num_codes: int, num_actions: int):
    """Maximum-likelihood Markov model: counts N[o, a, o'] of the transitions (all int arrays of shape (N,))."""
    counts = np.zeros((num_codes, num_actions, num_codes))
    np.add.at(counts, (codes, actions, next_codes), 1.0)
    return counts


def markov_prob(counts: np.ndarray, code: int, action: int, next_code: int) -> float:
    """p(o' | o, a) = N(o, a, o') / N(o, a) (nan if (o, a) was never seen)."""
    total = counts[code, action].sum()
    return float(counts[code, action, next_code] / total) if total > 0 else float("nan")


@torch.no_grad()
def two_doors_probe(model: WorldModel, device, particles: int = PROBE_PARTICLES) -> dict:
    """The latent model's TwoDoors metrics (detail 6): p(pass) predicted after (reset) and after (reset, try d, fail)
    for the same and the other door, averaged over d in {left, right}; p(pass within k tries), next to the truth."""
    in_room = torch.tensor([[1.0, 0.0]], device=device).expand(particles, 2)
    zeros_a = torch.zeros(particles, model.num_actions, device=device)
    first = torch.ones(particles, dtype=torch.bool, device=device)
    not_first = torch.zeros(particles, dtype=torch.bool, device=device)
    h0, z0 = torch.zeros(particles, model.deter, device=device), torch.zeros(particles, model.stoch, device=device)
    h, z, _, _ = model.filter_step(h0, z0, zeros_a, in_room, first)  # reset: o_0 = in_room

    def onehot(door):
        return F.one_hot(torch.full((particles,), door, device=device), model.num_actions).float()

    def predict(h, z, door):  # imagine one step under the prior: E[p(done)], E[passed bit]
        h2, (mu, std) = model.transition(h, z, onehot(door))
        obs_mean, _, done_logit = model.decode(h2, mu + std * torch.randn_like(std))
        return torch.sigmoid(done_logit).mean().item(), obs_mean[:, 1].mean().item()

    first_try = np.mean([predict(h, z, d)[0] for d in (0, 1)])
    same, other, same_obs, other_obs, within = [], [], [], [], []
    for door in (0, 1):
        # history: try `door`, fail (observe in_room again)
        h1, z1, _, _ = model.filter_step(h, z, onehot(door), in_room, not_first)
        (ps, os_), (po, oo) = predict(h1, z1, door), predict(h1, z1, 1 - door)
        same.append(ps), other.append(po), same_obs.append(os_), other_obs.append(oo)
        # k tries of `door` from the start: p(pass at try j | j - 1 failures), the failures filtered in as observations
        hj, zj, per_try = h, z, []
        for _ in range(MAX_TRIES):
            per_try.append(predict(hj, zj, door)[0])
            hj, zj, _, _ = model.filter_step(hj, zj, onehot(door), in_room, not_first)
        within.append(pass_within_k(per_try))
    print(
        f"latent model after (reset, try door, fail): p(pass | same door) = {np.mean(same):.3f}, "
        f"p(pass | other door) = {np.mean(other):.3f}  (truth 0 and 1; first try {first_try:.3f})"
    )
    metrics = {
        "model/p_pass_retry_same_door": float(np.mean(same)),
        "model/p_pass_other_door": float(np.mean(other)),
        "model/p_pass_first_try": float(first_try),
        "model/obs_passed_retry_same_door": float(np.mean(same_obs)),
        "model/obs_passed_other_door": float(np.mean(other_obs)),
        "model/p_pass_retry_same_door_left": float(same[0]),
        "model/p_pass_other_door_left": float(other[0]),
    }
    for k, (latent, truth) in enumerate(zip(np.mean(within, axis=0), true_pass_within_k(), strict=True), start=1):
        metrics[f"model/p_pass_within_{k}_tries"] = float(latent)
        metrics[f"model/true_p_pass_within_{k}_tries"] = float(truth)
    return metrics


def pass_within_k(per_try) -> np.ndarray:
    """P(pass within k tries) = 1 - prod_{j<=k} (1 - p_j), k = 1..len, from p_j = P(pass at try j | j - 1 failures)."""
    return 1.0 - np.cumprod(1.0 - np.asarray(per_try, dtype=np.float64))


def true_pass_within_k(max_tries: int = MAX_TRIES) -> np.ndarray:
    """The truth for "try the same door k times from the episode start" (detail 6), from the env's own
    `envs.pomdp.true_pass_probability`: 1/2 for all k."""
    per_door = [
        pass_within_k([true_pass_probability(set() if j == 0 else {d}, d) for j in range(max_tries)]) for d in (0, 1)
    ]
    return np.mean(per_door, axis=0)


def markov_probe(replay: StreamReplay, num_actions: int, tag: str, limit: int | None = None) -> dict:
    """Markov model p(o'|o,a) on the replayed transitions (the first `limit` entries per env); TwoDoors metrics
    model/{tag}_*: p(pass | in_room, door) for both doors and within k tries. {} if obs are not binary codes."""
    obs, act, next_obs = replay.transitions(limit)
    codes, next_codes = binary_codes(obs), binary_codes(next_obs)
    if codes is None or next_codes is None or len(codes) == 0:
        return {}
    counts = markov_counts(codes, act, next_codes, 2 ** obs.shape[-1], num_actions)
    in_room, passed = 1, 2  # binary codes of [1, 0] and [0, 1]
    p = [markov_prob(counts, in_room, d, passed) for d in (0, 1)]
    # history is ignored: "same door" after failing d is p(pass|in_room, d), "other door" is p(pass|in_room, 1-d)
    # and every try of door d passes independently with p(pass|in_room, d): within k tries 1 - (1 - p)^k
    within = np.mean([pass_within_k([pd] * MAX_TRIES) for pd in p], axis=0)
    same, other = float(np.mean(p)), float(np.mean(p[::-1]))
    print(
        f"{tag} p(o'|o,a): p(pass | same door) = {same:.3f}, p(pass | other door) = "
        f"{other:.3f}  (p(pass|in_room,L) = {p[0]:.3f}, R = {p[1]:.3f})"
    )
    metrics = {f"model/{tag}_p_pass_same_door": same, f"model/{tag}_p_pass_other_door": other}
    metrics.update({f"model/{tag}_p_pass_left": p[0], f"model/{tag}_p_pass_right": p[1]})
    return metrics | {f"model/{tag}_p_pass_within_{k}_tries": float(v) for k, v in enumerate(within, start=1)}


# === RUN MANAGEMENT (not the algorithm: validation, run dir, tensorboard, summary, the saved model) ===
SCRIPT = Path(__file__).stem  # the script's name in summary.json
ARCH_FIELDS = ("env_id", "env_kwargs", "deter_size", "stoch_size", "hidden_size")  # from args.json on --eval-only
POSITIVE_FIELDS = ("num_envs", "total_timesteps", "eval_episodes", "batch_size", "seq_len", "train_frequency")  # >= 1


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work; `--eval-only`: ARCH_FIELDS of the checkpoint."""
    args = tyro.cli(Args)
    for ok, message in [
        (args.checkpoint or not args.eval_only, "--eval-only needs --checkpoint PATH (a run dir or model.safetensors)"),
        (args.threads >= 1, f"--threads must be at least 1, got {args.threads}"),
        *[(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be >= 1") for name in POSITIVE_FIELDS],
        (args.eval_episodes <= EVAL_SEED_STRIDE, f"--eval-episodes must be <= {EVAL_SEED_STRIDE} (disjoint seeds)"),
        (args.seq_len >= 2, "--seq-len must be >= 2 (a transition needs two entries)"),
        (args.select_frequency >= 0, f"--select-frequency must be >= 0, got {args.select_frequency}"),
        (1 <= args.select_episodes <= EVAL_SEED_STRIDE, f"need 1 <= --select-episodes <= {EVAL_SEED_STRIDE}"),
        (args.total_timesteps < SELECT_SEED_STRIDE // 2, f"--total-timesteps must be < {SELECT_SEED_STRIDE // 2}"),
        (args.select_frequency > 0 or not args.keep_best, "--keep-best needs --select-frequency > 0"),
        (args.eval_only or args.buffer_size // max(args.num_envs, 1) > args.seq_len, "--buffer-size too small"),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    if args.eval_only:  # the env and the networks the checkpoint was trained with
        saved = load_checkpoint(args.checkpoint)[1]
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
