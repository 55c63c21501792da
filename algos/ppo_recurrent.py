"""Recurrent PPO: PPO whose policy and value function read the observation history through an LSTM/GRU.

In a POMDP o_t does not determine the state. Claims shown: (1) a memoryless policy pi(a|o_t) reaches at best the
best reactive policy, which may have to be stochastic (ThreeStateLine: p(right) = 1/2; every deterministic one fails
half the episodes); (2) a policy on the history, summarized by an RNN state h_t, reaches the optimum with memory
(ThreeStateLine, TMaze, MaskedCartPole, Tiger); (3) the policy gradient never used the Markov property: it stays
valid on o_t with Monte Carlo returns, while a critic that bootstraps on o_t is biased. ShortCorridor (Sutton &
Barto Ex. 13.1): Monte Carlo PPO settles near the best memoryless p(right) = 2 - sqrt(2); one-step TD advantages
credit only the final "right" step (elsewhere r + gamma V - V = -1 + (gamma - 1) V < 0 for the same V(o)), so the
policy turns deterministic and episodes hit the time limit. (`--gae-lambda 1` is not Monte Carlo: GAE bootstraps.)

Key equations (per step t of env b; d_t = 1 if the episode ended at step t):
    h_t = RNN(h_{t-1} * (1 - start_t), [o_t, onehot(a_{t-1}), r_{t-1}]),  pi(a|h^pi_t), V(h^V_t)
    delta_t = r_t + gamma V(h_{t+1}) (1 - d_t) - V(h_t)
    A_t = delta_t + gamma lambda (1 - d_t) A_{t+1}      (GAE; `--returns mc`: A_t = G_t - V(h_t), whole episodes)
    L = -E[min(rho A, clip(rho, 1-eps, 1+eps) A)] + c_v E[max((V-R)^2, (V_old + clip(V-V_old, -eps, eps) - R)^2)] / 2
        - c_e E[entropy],   rho = pi(a|h) / pi_old(a|h)
Implementation details:
 1. The RNN reads [o_t, onehot(a_{t-1}), r_{t-1}] (`--prev-reward` is off: rewards here are constant until the end;
    ThreeStateLine's observation is constant, so only past actions can be remembered). `--rnn none` is an MLP on o_t.
 2. The recurrent state is carried across rollouts and zeroed where an episode starts, as CleanRL's ppo_atari_lstm.
    The update runs the fused nn.GRU / nn.LSTM once over the pieces between episode starts, padded to one length
    (SB3-contrib splits sequences the same way); acting steps the same module one step at a time.
 3. A minibatch is a subset of whole env sequences (T, B_mb, ...), replayed from the rollout's initial state.
 4. `AutoresetMode.SAME_STEP`: every stored step is real; a truncation adds gamma V(final_obs) to r_t, termination not.
 5. From CleanRL [2, 3]: orthogonal init, Adam eps 1e-5, per-minibatch advantage normalization, value clipping,
    entropy bonus, global gradient clipping, linear learning-rate annealing.
 6. Policy and value have separate torsos (CleanRL ppo.py, SB3-contrib): with one (`--shared-torso`) the value loss of
    unscaled returns drowns the policy gradient on CartPole; on TMaze (returns of order 1) it trains the memory.
 7. `--norm-obs`: a running mean/std kept in the model, updated after each update (SB3's VecNormalize). MaskedCartPole
    uses RL Zoo's recipe [7] with `--no-norm-adv --norm-reward` (once the pole stays up, normalized advantages are
    value noise that 20 epochs fit) and gamma 0.99, lambda 0.95 (the cart's drift off the track is seen in time).
 8. `--returns mc`: each rollout resets the envs and runs until every env ended its first episode; only those are
    trained on (a mask in every loss), with their own discounted returns: nothing bootstrapped, the sample unbiased.
 9. Evaluation scores each env's first episode, sampling the policy (the optimum may be stochastic); greedy too.
References: [1] Schulman et al., "Proximal Policy Optimization Algorithms", 2017; [2] CleanRL ppo_atari_lstm.py; [3]
CleanRL ppo.py; [4] Huang et al., "The 37 Implementation Details of PPO", 2022; [5] Bakker, "Reinforcement Learning
with Long Short-Term Memory", NeurIPS 2001; [6] Sutton & Barto, Example 13.1; [7] RL Zoo RecurrentPPO, CartPoleNoVel.
Reproduce (TMaze-10; `--rnn none`: the memoryless baseline; every benchmark recipe: docs/ppo_recurrent.md):
    python algos/ppo_recurrent.py --env-id seqrl/TMaze-v0 --rnn gru --shared-torso --ent-coef 0.03 \
        --total-timesteps 200000
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
from torch.distributions import Categorical
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
from envs.pomdp import ShortCorridorEnv, ThreeStateLineEnv, TigerEnv  # noqa: E402  (importing envs registers the seqrl/ environments)

ADAM_EPS = 1e-5  # CleanRL's Adam epsilon for PPO (the 37-details blog, item 3)
ADV_NORM_EPS = 1e-8  # keeps advantage normalization finite when all advantages are equal
OBS_NORM_EPS = 1e-8  # variance floor of the observation normalization (constant features map to 0)
OBS_CLIP = 10.0  # normalized observations are clipped to [-10, 10] (as SB3's VecNormalize)
ACTOR_INIT_STD = 0.01  # small policy-head weights: near-uniform initial policy (CleanRL)
EVAL_SEED_STRIDE = 10_000  # eval env i of training seed s gets seed 10_000 (s + 1) + i: disjoint sets per seed
MAX_EVAL_STEPS = 10_000  # guard for envs without a time limit: evaluation stops after this many steps
LATE_TRAINING_FRACTION = 0.2  # `charts/late_episodic_return`: mean training return over the last 20% of the steps
RETURN_VAR_PRIOR = (1e-4, 0.0, 1.0)  # `--norm-reward`: (count, mean, var) before any data (SB3's RunningMeanStd)
REWARD_NORM_EPS = 1e-8  # variance floor of the reward normalization
REWARD_CLIP = 10.0  # normalized rewards are clipped to [-10, 10] (as SB3's VecNormalize)


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
    """number of evaluation episodes at the end of training (each in its own env, run in parallel)"""
    greedy_eval_episodes: int | None = None
    """episodes of the greedy evaluation (None = --eval-episodes): fewer where greedy episodes are all the same"""
    eval_only: bool = False
    """skip training: load `--checkpoint` and evaluate it"""
    checkpoint: str | None = None
    """run dir or model.safetensors to load with `--eval-only` (env and architecture come from its args.json)"""

    # Environment
    env_id: str = "seqrl/TMaze-v0"
    """any gymnasium id with a Discrete action space and a Box/Discrete observation space (also `module:EnvId`)"""
    env_kwargs: str = "{}"
    """keyword arguments for gym.make as a JSON object, e.g. '{"corridor_length": 20}'"""

    # Model
    rnn: Literal["lstm", "gru", "none"] = "gru"
    """the memory: an LSTM or GRU over the history, or `none` for a memoryless MLP on the current observation"""
    hidden_size: int = 64
    """width of the encoder layer and of the RNN state"""
    prev_action: bool = True
    """feed the previous action (one-hot) into the RNN (ignored with `--rnn none`)"""
    prev_reward: bool = False
    """feed the previous reward into the RNN (ignored with `--rnn none`)"""
    norm_obs: bool = False
    """normalize observations by running mean/std (kept in the model's state dict, updated after each update)"""
    shared_torso: bool = False
    """one torso (encoder + RNN) for policy and value (CleanRL ppo_atari_lstm.py); default: one each (ppo.py)"""
    init_action_bias: tuple[float, ...] = ()
    """the policy head's initial bias, one logit per action (default zeros); `0 2` starts at p(right) = 0.88"""

    # PPO
    total_timesteps: int = 100_000
    """total environment steps of training (0: the initial network is evaluated: `benchmark.sh --untrained`)"""
    learning_rate: float = 1e-3
    """the learning rate of the optimizer"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over training"""
    num_envs: int = 16
    """the number of parallel environments (SyncVectorEnv)"""
    num_steps: int = 64
    """steps per env per rollout (also the BPTT length: the RNN is unrolled over the whole rollout)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the GAE lambda (0: one-step TD advantages from the critic); with `--returns gae` only"""
    returns: Literal["gae", "mc"] = "gae"
    """`gae`: GAE-lambda, bootstrapped from V at rollout ends and (`--bootstrap-truncated`) truncations; `mc`: Monte
    Carlo, A_t = G_t - V(o_t) on each env's first episode of a rollout (`num_steps` must cover the time limit)"""
    bootstrap_truncated: bool = True
    """on truncation (time limit) add gamma * V(final obs) to the last reward; terminations never bootstrap"""
    reward_scale: float = 1.0
    """multiply rewards by this before learning (logged returns are unscaled)"""
    norm_reward: bool = False
    """divide learned rewards by a running std of the discounted return, clip to [-10, 10] (SB3's VecNormalize)"""
    num_minibatches: int = 4
    """the number of minibatches per epoch; each holds num_envs / num_minibatches whole env sequences"""
    update_epochs: int = 4
    """the number of epochs over each rollout"""
    norm_adv: bool = True
    """normalize advantages per minibatch"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient epsilon (also clips the value change)"""
    anneal_clip: bool = False
    """linearly anneal the surrogate's epsilon to 0, as SB3's `clip_range: lin_0.2` (the value clip keeps it)"""
    clip_vloss: bool = True
    """use PPO's clipped value loss"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum global gradient norm"""
    target_kl: float | None = None
    """stop the epochs of an update early when the approximate KL exceeds this"""

    # filled in at runtime
    batch_size: int = 0
    """num_envs * num_steps"""
    num_iterations: int = 0
    """total_timesteps // batch_size (with `--returns mc` rollouts end early, so there are more iterations)"""


# ALGO LOGIC: advantages, losses and minibatches as small pure functions (tested in tests/test_ppo_recurrent.py)
def compute_gae(rewards, values, dones, next_value, gamma: float, gae_lambda: float):
    """GAE-lambda over a (T, B) rollout; `dones[t] = 1` if the episode ended at step t (no bootstrap across it).
    `next_value` (B,) is V of the observation after the last step. Returns (advantages, returns), both (T, B)."""
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        next_values = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * not_done - values[t]  # the TD error delta_t
        last_gae = delta + gamma * gae_lambda * not_done * last_gae  # A_t = delta_t + gamma lambda A_{t+1}
        advantages[t] = last_gae
    return advantages, advantages + values


def merge_moments(moments: tuple, batch: tuple) -> tuple:
    """Two samples' (count, mean, var) merged (the parallel algorithm of SB3/CleanRL RunningMeanStd)."""
    (count, mean, var), (n, b_mean, b_var) = moments, batch
    delta, total = b_mean - mean, count + n
    return total, mean + delta * n / total, (var * count + b_var * n + delta**2 * count * n / total) / total


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of x over the entries where mask is 1 (all entries if mask is None)."""
    return x.mean() if mask is None else (x * mask).sum() / mask.sum()


def clipped_policy_loss(new_logprob, old_logprob, advantages, clip_coef: float, mask=None):
    """PPO's clipped surrogate (to minimize); also returns the approximate KL and the clipped fraction."""
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    pg_loss = masked_mean(torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)), mask)
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1) - logratio, mask)  # http://joschu.net/blog/kl-approx.html
        clipfrac = masked_mean(((ratio - 1.0).abs() > clip_coef).float(), mask)
    return pg_loss, approx_kl, clipfrac


def value_loss(new_value, old_value, returns, clip_coef: float, clip: bool = True, mask=None):
    """0.5 * squared error; with `clip`, the pessimistic max with the error of a value moved at most clip_coef."""
    unclipped = (new_value - returns) ** 2
    if not clip:
        return 0.5 * masked_mean(unclipped, mask)
    clipped = (old_value + (new_value - old_value).clamp(-clip_coef, clip_coef) - returns) ** 2
    return 0.5 * masked_mean(torch.max(unclipped, clipped), mask)


def normalize_advantages(advantages: torch.Tensor, mask=None) -> torch.Tensor:
    """(A - mean) / (std + eps) over the (masked) entries of a minibatch."""
    valid = advantages if mask is None else advantages[mask.bool()]
    return (advantages - valid.mean()) / (valid.std() + ADV_NORM_EPS)


def env_minibatches(num_envs: int, num_minibatches: int, rng: np.random.Generator) -> np.ndarray:
    """A random partition of the env columns: (num_minibatches, num_envs // num_minibatches) env indices."""
    return rng.permutation(num_envs).reshape(num_minibatches, -1)


def layer_init(layer, std: float = 2**0.5, bias_const: float = 0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Torso(nn.Module):
    """Encoder -> RNN (or a 2nd MLP layer for `none`): the memory that turns the history into features (T, B, H).
    The recurrent state is one tensor (B, S): S = H for a GRU, 2H for an LSTM (h and c concatenated), 0 for none."""

    def __init__(self, in_dim: int, rnn: str, hidden_size: int):
        super().__init__()
        self.rnn = rnn
        self.state_size = {"lstm": 2 * hidden_size, "gru": hidden_size, "none": 0}[rnn]
        self.encoder = nn.Sequential(layer_init(nn.Linear(in_dim, hidden_size)), nn.Tanh())
        if rnn == "none":
            self.core = nn.Sequential(layer_init(nn.Linear(hidden_size, hidden_size)), nn.Tanh())
        else:
            self.core = (nn.LSTM if rnn == "lstm" else nn.GRU)(hidden_size, hidden_size)
            for name, param in self.core.named_parameters():  # CleanRL's LSTM init: orthogonal weights, zero biases
                nn.init.orthogonal_(param, 1.0) if "weight" in name else nn.init.constant_(param, 0.0)

    def forward(self, inputs, state, keep):
        """inputs (T, B, in_dim), state (B, S), keep (T, B) = 1 - starts. Returns features (T, B, H) and the state
        after the last step (B, S) for one step (acting), None for a sequence (the update needs none)."""
        x = self.encoder(inputs)  # (T, B, H)
        if self.rnn == "none":
            return self.core(x), state  # memoryless
        if x.shape[0] == 1:  # acting: one step; CRUCIAL: forget the previous episode at its boundary
            return self.run_core(x, state * keep[0, :, None])
        return self.run_pieces(x, state, keep), None

    def run_core(self, x, state):
        """The fused RNN over x (T, N, H) from state (N, S), no reset inside. Returns (T, N, H), final state (N, S)."""
        if self.rnn == "gru":
            out, h = self.core(x, state[None])
            return out, h[0]
        out, (h, c) = self.core(x, tuple(part.contiguous() for part in state[None].chunk(2, dim=-1)))  # (h, c)
        return out, torch.cat([h[0], c[0]], dim=-1)

    def run_pieces(self, x, state, keep):
        """The update's path: each env's sequence cut at its episode starts, the pieces padded to one length and run
        through one fused RNN call; a piece starts from the carried state (at t = 0) or zeros (at an episode start)."""
        T, B, H = x.shape
        first = keep.t() == 0  # (B, T) env-major: a piece starts at every episode start and at the rollout's start
        first = first.index_fill(1, torch.tensor([0], device=x.device), True).reshape(-1)
        piece = first.long().cumsum(0) - 1  # (B T,) the piece of every step
        begin = first.nonzero().squeeze(1)  # (N,) flat index of each piece's first step
        pos = torch.arange(B * T, device=x.device) - begin[piece]  # step index within its piece
        padded = x.new_zeros(int(pos.max()) + 1, len(begin), H)  # (L, N, H); padding only follows a piece's end
        padded[pos, piece] = x.transpose(0, 1).reshape(B * T, H)
        h0 = state[begin // T] * keep.t().reshape(-1)[begin, None]  # the carried state at t = 0; zeros at a start
        out, _ = self.run_core(padded, h0)  # the final state of a padded piece is past its end: not used
        return out[pos, piece].reshape(B, T, H).transpose(0, 1)  # (T, B, H)


class Agent(nn.Module):
    """Actor-critic: policy and value heads, each on its own torso (CleanRL ppo.py, SB3-contrib RecurrentPPO), or on
    one shared torso with `shared_torso` (CleanRL ppo_atari_lstm.py). The state (B, S) concatenates the torsos'."""

    def __init__(self, obs_dim, num_actions, rnn, hidden, prev_action, prev_reward, norm_obs=True, shared_torso=False):
        super().__init__()
        self.rnn, self.hidden_size, self.num_actions, self.norm_obs = rnn, hidden, num_actions, norm_obs
        self.register_buffer("obs_mean", torch.zeros(obs_dim))  # running observation statistics (saved)
        self.register_buffer("obs_var", torch.ones(obs_dim))
        self.register_buffer("obs_count", torch.tensor(OBS_NORM_EPS))
        self.prev_action, self.prev_reward = prev_action and rnn != "none", prev_reward and rnn != "none"
        in_dim = obs_dim + num_actions * self.prev_action + self.prev_reward
        self.actor_torso = Torso(in_dim, rnn, hidden)
        self.critic_torso = None if shared_torso else Torso(in_dim, rnn, hidden)
        self.actor = layer_init(nn.Linear(hidden, num_actions), std=ACTOR_INIT_STD)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    @torch.no_grad()
    def update_obs_stats(self, obs: torch.Tensor):
        """Merge a batch (N, D) into the running mean/variance."""
        batch = (obs.shape[0], obs.mean(0), obs.var(0, unbiased=False))
        merged = merge_moments((self.obs_count, self.obs_mean, self.obs_var), batch)
        for buffer, value in zip((self.obs_count, self.obs_mean, self.obs_var), merged, strict=True):
            buffer.copy_(value)

    def initial_state(self, batch: int) -> torch.Tensor:
        size = self.actor_torso.state_size * (1 if self.critic_torso is None else 2)
        return torch.zeros(batch, size, device=self.actor.weight.device)  # (B, S)

    def forward(self, obs, prev_action, prev_reward, state, starts):
        """obs (T, B, D), prev_action (T, B) long, prev_reward (T, B), state (B, S), starts (T, B) in {0, 1}.
        Returns logits (T, B, A), values (T, B) and the state after the last step (B, S; None after a sequence)."""
        keep = 1.0 - starts  # (T, B): 0 where obs[t] is the first observation of an episode
        if self.norm_obs:
            obs = ((obs - self.obs_mean) / torch.sqrt(self.obs_var + OBS_NORM_EPS)).clamp(-OBS_CLIP, OBS_CLIP)
        inputs = [obs]
        if self.prev_action:
            inputs.append(F.one_hot(prev_action, self.num_actions).float() * keep[..., None])  # (T, B, A)
        if self.prev_reward:
            inputs.append((prev_reward * keep)[..., None])  # (T, B, 1)
        inputs = torch.cat(inputs, dim=-1)
        if self.critic_torso is None:
            hidden, state = self.actor_torso(inputs, state, keep)
            return self.actor(hidden), self.critic(hidden).squeeze(-1), state
        n = self.actor_torso.state_size
        actor_hidden, actor_state = self.actor_torso(inputs, state[:, :n], keep)
        critic_hidden, critic_state = self.critic_torso(inputs, state[:, n:], keep)
        state = None if actor_state is None else torch.cat([actor_state, critic_state], dim=-1)
        return self.actor(actor_hidden), self.critic(critic_hidden).squeeze(-1), state


def make_vec_env(env_id: str, env_kwargs: dict, num_envs: int) -> gym.vector.SyncVectorEnv:
    """`num_envs` copies that autoreset in the SAME step. FlattenObservation makes Discrete and each MultiDiscrete
    component one-hot, flattens Box, concatenates the parts of a Tuple/Dict (POPGym's tasks observe MultiDiscrete)."""

    def thunk():
        env = gym.wrappers.FlattenObservation(gym.make(env_id, **env_kwargs))
        return gym.wrappers.DtypeObservation(env, np.float32)

    return gym.vector.SyncVectorEnv([thunk] * num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def main():
    args = parse_args()  # tyro + validation + derived sizes (`--eval-only`: env and architecture from the checkpoint)
    env_kwargs = json.loads(args.env_kwargs)  # a JSON object (parse_args checked)

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)

    envs = make_vec_env(args.env_id, env_kwargs, args.num_envs)
    obs_dim, num_actions = envs.single_observation_space.shape[0], int(envs.single_action_space.n)
    arch = (args.rnn, args.hidden_size, args.prev_action, args.prev_reward, args.norm_obs, args.shared_torso)
    agent = Agent(obs_dim, num_actions, *arch)
    if args.init_action_bias:  # a biased initial policy (Args.init_action_bias); draws no random number
        with torch.no_grad():
            agent.actor.bias.copy_(torch.tensor(args.init_action_bias))
    run = start_run(args)  # device, run dir, tensorboard
    if args.eval_only:
        run.load_model(agent)  # the checkpoint's weights (its architecture came with its args.json)
    device = run.device
    agent.to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=ADAM_EPS, fused=True)

    # `--returns` (detail 8): `mc` starts each rollout with fresh episodes, trains on (and logs) each env's first
    # episode only, ends the rollout when all have ended, and bootstraps nothing (lambda = 1, no V); `gae`: all steps
    monte_carlo = args.returns == "mc"
    gae_lambda, bootstrap_truncated = (1.0, False) if monte_carlo else (args.gae_lambda, args.bootstrap_truncated)

    # ALGO LOGIC: rollout storage, all (T, B) = (num_steps, num_envs); prev_* = a_{t-1}, r_{t-1} (scaled)
    T, B = args.num_steps, args.num_envs
    obs = torch.zeros((T, B, obs_dim), device=device)
    actions, prev_actions = (torch.zeros((T, B), dtype=torch.long, device=device) for _ in range(2))
    logprobs, rewards, dones, values, prev_rewards = (torch.zeros((T, B), device=device) for _ in range(5))
    starts = torch.zeros((T, B), device=device)  # 1 where obs[t] is the first observation of an episode
    valid = torch.ones((T, B), device=device)  # 1 where a step is trained on (`mc`: its env's first episode)

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    next_obs = torch.as_tensor(envs.reset(seed=args.seed)[0], dtype=torch.float32, device=device)
    next_start, next_prev_reward = torch.ones(B, device=device), torch.zeros(B, device=device)
    next_prev_action = torch.zeros(B, dtype=torch.long, device=device)
    next_state = agent.initial_state(B)  # (B, S), carried across rollouts
    ep_return, ep_length = np.zeros(B), np.zeros(B, dtype=int)
    disc_return, return_moments = np.zeros(B), RETURN_VAR_PRIOR  # `--norm-reward`: discounted returns, their moments
    recent_returns, late_returns = [], []  # for the progress line; training episodes of the last 20% of steps

    budget, iteration = args.num_iterations * args.batch_size, 0  # env steps of training
    while global_step < budget:
        iteration += 1
        if monte_carlo:  # fresh episodes: no step before this rollout needs a return
            next_obs = torch.as_tensor(envs.reset()[0], dtype=torch.float32, device=device)
            next_start.fill_(1.0)
            next_state = agent.initial_state(B)
            ep_return[:], ep_length[:], disc_return[:] = 0.0, 0, 0.0
        initial_state = next_state.clone()  # the update replays each sequence from here
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - global_step / budget) * args.learning_rate
        clip_now = (1.0 - global_step / budget) * args.clip_coef if args.anneal_clip else args.clip_coef

        # 1. collect T steps in each env (`mc`: until every env finished its first episode)
        ended = np.zeros(B, dtype=bool)  # the env finished an episode in this rollout
        for step in range(T):
            global_step += B
            trained = ~ended if monte_carlo else np.ones(B, dtype=bool)  # (B,) this step is trained on and logged
            obs[step], starts[step], valid[step] = next_obs, next_start, torch.as_tensor(trained, device=device)
            prev_actions[step], prev_rewards[step] = next_prev_action, next_prev_reward
            with torch.no_grad():
                logits, value, next_state = agent(
                    next_obs[None], next_prev_action[None], next_prev_reward[None], next_state, next_start[None]
                )
                dist = Categorical(logits=logits[0], validate_args=False)  # no per-step argument checks
                action = dist.sample()
            actions[step], logprobs[step], values[step] = action, dist.log_prob(action), value[0]

            next_obs_np, reward, terminated, truncated, infos = envs.step(action.cpu().numpy())
            done = terminated | truncated
            # `reward`: the env's (logged); `scaled_reward`: the next r_{t-1} input; rewards[step]: the one learned from
            scaled_reward = reward * args.reward_scale
            next_prev_reward = torch.as_tensor(scaled_reward, dtype=torch.float32, device=device)
            rewards[step] = torch.as_tensor(scaled_reward)  # the float32 storage casts it
            if args.norm_reward:  # as VecNormalize: r / std(G), G = gamma G + r per env, restarted at episode ends
                disc_return = disc_return * args.gamma + scaled_reward
                return_moments = merge_moments(return_moments, (B, disc_return.mean(), disc_return.var()))
                return_std = np.sqrt(return_moments[2] + REWARD_NORM_EPS)
                rewards[step] = torch.as_tensor(np.clip(scaled_reward / return_std, -REWARD_CLIP, REWARD_CLIP))
                disc_return[done] = 0.0
            dones[step] = torch.as_tensor(done, dtype=torch.float32, device=device)
            # CRUCIAL: with SAME_STEP autoreset next_obs_np is already the reset obs where done; on truncation the
            # episode did not really end, so bootstrap from V(final obs), computed from the unreset memory
            cut_np = np.flatnonzero(truncated & ~terminated) if bootstrap_truncated else np.zeros(0, dtype=int)
            if len(cut_np):
                cut = torch.as_tensor(cut_np, device=device)
                final_obs = torch.as_tensor(np.stack(infos["final_obs"][cut_np]), dtype=torch.float32, device=device)
                with torch.no_grad():
                    inputs = (final_obs[None], action[cut][None], next_prev_reward[cut][None], next_state[cut])
                    _, final_value, _ = agent(*inputs, torch.zeros(1, len(cut), device=device))
                rewards[step, cut] += args.gamma * final_value[0]
            next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32, device=device)
            next_start, next_prev_action = dones[step], action

            ep_return += reward
            ep_length += 1
            for i in np.flatnonzero(done & trained):  # `mc`: the later episodes of a rollout are neither
                run.log(global_step, {"charts/episodic_return": ep_return[i], "charts/episodic_length": ep_length[i]})
                recent_returns.append(ep_return[i])
                if global_step > (1.0 - LATE_TRAINING_FRACTION) * budget:
                    late_returns.append(ep_return[i])
            ep_return[done], ep_length[done] = 0.0, 0
            ended |= done
            if monte_carlo and ended.all():
                break
        n_steps = step + 1  # steps collected in this rollout (T, or fewer with `mc`)
        if monte_carlo and not ended.all():
            raise SystemExit(f"error: --returns mc: an episode ran past --num-steps {T} (the env's time limit?)")

        # 2. advantages: GAE-lambda, bootstrapped from the value of the observation after the rollout (`mc`:
        #    lambda = 1 over whole episodes; every trained step's episode ended, so nothing bootstraps)
        with torch.no_grad():
            next_value = torch.zeros(B, device=device)  # `mc`: unused, every trained step's episode ended
            if not monte_carlo:
                next_value = agent(
                    next_obs[None], next_prev_action[None], next_prev_reward[None], next_state, next_start[None]
                )[1][0]
            advantages, returns = compute_gae(
                rewards[:n_steps], values[:n_steps], dones[:n_steps], next_value, args.gamma, gae_lambda
            )
        mask = valid[:n_steps] if monte_carlo else None  # (n_steps, B); None: every step counts

        # 3. PPO update on minibatches of whole env sequences, each replayed from its initial recurrent state
        seq = slice(0, n_steps)  # the time steps collected in this rollout (each env column a sequence)
        clipfracs = []
        for _epoch in range(args.update_epochs):
            for mb_envs in env_minibatches(B, args.num_minibatches, rng):
                mb = torch.as_tensor(mb_envs, device=device)  # the minibatch: these env columns
                logits, new_value, _ = agent(
                    obs[seq, mb], prev_actions[seq, mb], prev_rewards[seq, mb], initial_state[mb], starts[seq, mb]
                )  # (n_steps, b, A), (n_steps, b)
                dist = Categorical(logits=logits, validate_args=False)
                mb_mask = None if mask is None else mask[:, mb]
                mb_advantages = normalize_advantages(advantages[:, mb], mb_mask) if args.norm_adv else advantages[:, mb]
                pg_loss, approx_kl, clipfrac = clipped_policy_loss(
                    dist.log_prob(actions[seq, mb]), logprobs[seq, mb], mb_advantages, clip_now, mb_mask
                )
                v_loss = value_loss(
                    new_value, values[seq, mb], returns[:, mb], args.clip_coef, args.clip_vloss, mb_mask
                )
                entropy = masked_mean(dist.entropy(), mb_mask)
                loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                clipfracs.append(clipfrac.item())
            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        if args.norm_obs:  # after the update, so that each rollout and its update see the same normalization
            agent.update_obs_stats((obs[seq] if mask is None else obs[seq][mask.bool()]).reshape(-1, obs_dim))

        # 4. log
        var_returns = returns.var().item()
        explained_var = np.nan if var_returns == 0 else 1 - (returns - values[seq]).var().item() / var_returns
        sps = int(global_step / (time.time() - run.start_time))
        losses = {"value_loss": v_loss.item(), "policy_loss": pg_loss.item(), "entropy": entropy.item()}
        losses |= {"approx_kl": approx_kl.item(), "clipfrac": np.mean(clipfracs), "explained_variance": explained_var}
        charts = {"learning_rate": optimizer.param_groups[0]["lr"], "clip_coef": clip_now, "SPS": sps}
        logged = {f"losses/{k}": v for k, v in losses.items()} | {f"charts/{k}": v for k, v in charts.items()}
        run.log(global_step, logged)
        if len(recent_returns) and (global_step * 20) // budget > ((global_step - n_steps * B) * 20) // budget:
            print(f"iter {iteration} step={global_step}/{budget} return={np.mean(recent_returns):.3f} SPS={sps}")
            recent_returns = []
    envs.close()

    # 5. evaluate (sampling, then greedy), then summary.json and the saved model
    agent.eval()
    metrics = {}
    for greedy, prefix, n in [(False, "eval/", args.eval_episodes), (True, "eval/greedy_", args.greedy_eval_episodes)]:
        seed = EVAL_SEED_STRIDE * (args.seed + 1)
        result = evaluate(agent, args.env_id, env_kwargs, n, seed, greedy, args.reward_scale)
        metrics.update(eval_metrics(result, args.env_id, prefix))
    if late_returns:  # what the training curve shows at its end, to compare with the evaluation
        metrics["charts/late_episodic_return"] = float(np.mean(late_returns))
    run.log(global_step, metrics)
    run.finish(metrics, {"model": agent}, global_step)


@torch.no_grad()
def evaluate(agent, env_id: str, env_kwargs: dict, episodes: int, seed: int, greedy: bool, reward_scale: float):
    """One episode in each of `episodes` envs, stepping only unfinished ones (docs/ppo_recurrent.md, detail 9)."""
    vec_env = make_vec_env(env_id, env_kwargs, episodes)  # its copies (.envs) stepped one by one
    envs, device = vec_env.envs, agent.actor.weight.device
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])  # (E, D), as vec_env.reset seeds
    start, prev_reward = torch.ones(episodes, device=device), torch.zeros(episodes, device=device)
    state, prev_action = agent.initial_state(episodes), torch.zeros(episodes, dtype=torch.long, device=device)
    ret, length, success = np.zeros(episodes), np.zeros(episodes, dtype=int), np.full(episodes, np.nan)
    finished, counts = np.zeros(episodes, dtype=bool), np.zeros((episodes, agent.num_actions))  # counts: per action
    entropies, first_probs, first_actions = [], [], []  # first_*: probabilities (E, A) and actions at steps 0, 1
    for _ in range(MAX_EVAL_STEPS):
        obs_t = torch.as_tensor(obs, dtype=torch.float32, device=device)
        logits, _, state = agent(obs_t[None], prev_action[None], prev_reward[None], state, start[None])
        dist = Categorical(logits=logits[0], validate_args=False)
        action = logits[0].argmax(-1) if greedy else dist.sample()
        actions = action.cpu().numpy()
        if len(first_probs) < 2:
            first_probs.append(dist.probs.cpu().numpy())
            first_actions.append(actions)
        active = ~finished
        entropies.append(dist.entropy().cpu().numpy()[active])
        reward, done = np.zeros(episodes), np.zeros(episodes, dtype=bool)
        for i in np.flatnonzero(active):  # finished episodes stay where they ended (their rows are never read)
            obs[i], reward[i], terminated, truncated, info = envs[i].step(actions[i])
            done[i] = terminated or truncated
            success[i] = info["success"] if done[i] and "success" in info else success[i]
        ret, length = ret + reward, length + active  # finished episodes add nothing
        counts[active, actions[active]] += 1
        finished |= done
        if finished.all():
            break
        start, prev_action = torch.as_tensor(done, dtype=torch.float32, device=device), action
        prev_reward = torch.as_tensor(reward * reward_scale, dtype=torch.float32, device=device)
    vec_env.close()
    switched = first_actions[1] != first_actions[0] if len(first_actions) > 1 else np.zeros(episodes, dtype=bool)
    result = dict(ret=ret, length=length, success=success, counts=counts, entropy=np.concatenate(entropies).mean())
    return result | dict(probs0=first_probs[0], switched=switched[length > 1])  # switched: episodes of >= 2 steps


def eval_metrics(result: dict, env_id: str, prefix: str) -> dict:
    """Summary metrics (means over episodes) of an `evaluate` result, with the env-specific ones."""
    m = {"episodic_return": result["ret"].mean(), "episodic_return_std": result["ret"].std()}
    m |= {"episodic_length": result["length"].mean(), "policy_entropy": result["entropy"]}
    if not np.isnan(result["success"]).all():  # the env reports info["success"] (TMaze, Tiger)
        m["success_rate"] = np.nanmean(result["success"])
    if env_id.endswith("ThreeStateLine-v0"):  # memoryless optimum: p(right) = 0.5 at every step, independently
        m["p_right_first_step"] = result["probs0"][:, ThreeStateLineEnv.RIGHT].mean()
        if len(result["switched"]):  # with memory: after a bump into the wall, reverse (p = 1); memoryless: 0.5
            m["p_reverse_second_step"] = result["switched"].mean()
    if env_id.endswith("ShortCorridor-v0"):  # memoryless optimum: p(right) = 2 - sqrt(2) in every (alike) cell
        m["p_right_first_step"] = result["probs0"][:, ShortCorridorEnv.RIGHT].mean()
    if env_id.endswith("Tiger-v0"):  # information gathering: listens before opening a door
        m["listens_per_episode"] = result["counts"][:, TigerEnv.LISTEN].mean()
    return {f"{prefix}{key}": float(value) for key, value in m.items()}


# === RUN MANAGEMENT (not the algorithm: validation, run dir, tensorboard, summary, the saved model) ===
SCRIPT = Path(__file__).stem  # the script's name in summary.json
# the Args that `--eval-only` takes from the checkpoint's args.json: the env, the network and its inputs
ARCH_FIELDS = "env_id env_kwargs rnn hidden_size prev_action prev_reward norm_obs shared_torso reward_scale".split()
POSITIVE_FIELDS = "threads eval_episodes greedy_eval_episodes num_envs num_steps num_minibatches update_epochs".split()


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work, the derived sizes; `--eval-only`: ARCH_FIELDS."""
    args = tyro.cli(Args)
    if args.greedy_eval_episodes is None:
        args.greedy_eval_episodes = args.eval_episodes
    for ok, message in [
        (args.checkpoint or not args.eval_only, "--eval-only needs --checkpoint PATH (a run dir or model.safetensors)"),
        *[(getattr(args, field) >= 1, f"--{field.replace('_', '-')} must be at least 1") for field in POSITIVE_FIELDS],
        (args.num_envs % max(args.num_minibatches, 1) == 0, "--num-envs not divisible by --num-minibatches"),
        (args.total_timesteps not in range(1, args.num_envs * args.num_steps), "--total-timesteps < one rollout"),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    args.batch_size = args.num_envs * args.num_steps
    args.num_iterations = 0 if args.eval_only else args.total_timesteps // args.batch_size
    if args.eval_only:  # the env and the architecture the checkpoint was trained with
        saved = load_checkpoint(args.checkpoint)[1]
        vars(args).update({field: saved[field] for field in ARCH_FIELDS if field in saved})
    num_actions = check_env(args.env_id, args.env_kwargs)
    if args.init_action_bias and len(args.init_action_bias) != num_actions:
        raise SystemExit(f"error: --init-action-bias takes {num_actions} numbers (one per action)")
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
