"""R2D2 with a gated Transformer-XL: the transformer's memory stored in replay like R2D2's LSTM state.

R2D2 [1] (r2d2_rnnstate.py) stores the actor's recurrent state with the replayed steps; the lecture says no one has
found the analogous trick for transformers. Here it is built and measured. A Transformer-XL [2] acts with a *memory*,
each layer's inputs at the last M steps. A memory entry belongs to one step, so the replay stores the actor's layer
inputs with every step (O(T)); the memory at a sequence's first trained step t0 is the stored rows t0 - M .. t0 - 1.
`--memory`: (a) `zero`, an empty memory at t0 - burn_in; (b) `stored --burn-in 0`, the stored memory, written by an
older network; (c) `stored` (default), the stored memory and a burn-in that recomputes its burn_in newest entries; (d)
`window`, DTQN [4]: no memory, acting on the last k steps; (e) `episode`, each sequence re-encoded from its episode
start (AMAGO [6]); (f) `exact`, an empty memory at t0 - L x M and a burn-in of those rows: by the band (1.) the Q of
(e) at a fixed cost, nothing stored, the fair recompute baseline. On TMaze-20 every window of (a)-(d) is shorter than
the distance from the cue to the junction: there only a stored memory or a recompute ((e), (f)) trains on the cue.

Key equations (GTrXL [3] block, pre-norm, layer l, input x_t^l; the memory gets no gradient):
    y = ReLU(MultiHeadAttention(q = LN(x_t^l), k = v = LN([x_{t-M}^l .. x_t^l])) + bias b_{head, offset})
    x' = g(x_t^l, y),  x_t^{l+1} = g(x', ReLU(MLP(LN(x')))),  g(x, y) = (1 - z) x + z tanh(W_g y + U_g (r x)),
    r = s(W_r y + U_r x),  z = s(W_z y + U_z x - b_g);  Q = dueling head on LN(x^L);  the rest as r2d2_rnnstate.py
Implementation details:
1. Attention is a band (a step attends to itself and the M steps before it in its episode), so acting step by step
   with the memory gives exactly the Q-values of one pass over the episode (tested in float64); reach M x layers.
2. (c) stores per row the actor's layer inputs: L x width floats (2 x 64), the size of the LSTM's (h, c);
   `--no-store-layer0` keeps layers >= 1 and recomputes layer 0's, the embeddings of rows inside the window.
3. Sequences, autoreset handling, prioritized sampling, targets and exploration as r2d2_rnnstate.py (the same
   functions). A window is [t0 - lead, t0 + m + n), lead = burn_in + M in (c); else burn_in (a), 0 (d), L x M (f) or
   all (e), but never before the episode start (nothing stored there: all of it is a burn-in from an empty memory).
4. Burn-in (`anchor_memory`): without gradient, in segments of at most M rows; the M - burn_in older entries stay as
   stored, unlike an LSTM state, which a burn-in refreshes entirely.
5. Trained rows: one pass, the memory as detached keys and values: gradient trains how memory is read, not written.
6. `final_delta_q_memory`, last network: Delta-Q of the empty (+ burn-in), stored (+ burn-in) memory vs the true one.
7. Long runs: `--save-every`, Ctrl-C / SIGTERM checkpoints; `--resume RUN_DIR` begins new episodes (class `Run`).
Scaled down from GTrXL: 2 layers of width 64, 4 heads, a learned bias per offset; M = 32; m = 10, overlap 5, burn-in 4,
n = 5: burn-in + trained + target rows (19) are fewer than TMaze-20's 21 steps from the cue to the junction.
References: [1] S. Kapturowski et al., R2D2, ICLR 2019. [2] Z. Dai et al., "Transformer-XL", ACL 2019. [3] E. Parisotto
et al., "Stabilizing Transformers for RL" (GTrXL), ICML 2020. [4] K. Esslinger et al., DTQN, 2022. [5] CleanRL
ppo_trxl.py. [6] J. Grigsby et al., "AMAGO", 2023. [7] T. Pohlen et al., 2018 (h(x)). Docs: docs/r2d2_trxl_memory.md.
Reproduce: python algos/r2d2_trxl_memory.py --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}'
"""

import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
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
MAX_EVAL_STEPS = 10_000  # guard for envs without a time limit: an evaluation episode stops after this many steps
LOG_EVERY_UPDATES = 100  # write losses/SPS to tensorboard every 100 gradient updates
ROW_SCALARS = {"action": np.int64, "reward": np.float32, "prev_action": np.int64, "prev_reward": np.float32}
ROW_SCALARS |= {"first": bool, "final": bool, "terminal": bool, "ep_step": np.int32}  # a replay row's scalars, dtypes
GATE_BIAS = 2.0  # b_g of the GTrXL gate: z starts near sigmoid(-2) = 0.12, so each block starts near the identity


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
    """torch.set_num_threads: 1 is fastest for these small networks and leaves cores to parallel runs"""
    runs_dir: str = "runs"
    """the folder where run directories (tensorboard, summary.json, model) are written"""
    eval_episodes: int = 100
    """number of greedy evaluation episodes at the end of training"""
    eval_only: bool = False
    """skip training: load `--checkpoint` and evaluate it"""
    checkpoint: str | None = None
    """run dir or model.safetensors to load with `--eval-only` (env and architecture come from its args.json)"""
    save_every: int = 25_000
    """env steps between checkpoints for `--resume` (RUN_DIR/train_state.safetensors, deleted at the end; 0 = none but
    Ctrl-C's)"""
    resume: str | None = None
    """a run dir of this script with a checkpoint: continue that run there, with its own arguments"""

    # Environment
    env_id: str = "seqrl/TMaze-v0"
    """any gymnasium id (or `module:EnvId`) with Discrete actions; observations flattened as in r2d2_rnnstate.py"""
    env_kwargs: str = '{"corridor_length": 20}'
    """keyword arguments for gym.make as a JSON object"""
    num_envs: int = 8
    """the number of parallel environments (the actors; each gets its own exploration epsilon)"""

    # Model: a gated Transformer-XL
    d_model: int = 64
    """width of the embedding and of every layer's input (the numbers a memory entry holds per layer)"""
    num_layers: int = 2
    """transformer blocks; the memory's reach is memory_length x num_layers steps"""
    num_heads: int = 4
    """attention heads per block (d_model must be a multiple)"""
    ff_size: int = 128
    """hidden width of each block's MLP"""
    memory: Literal["stored", "zero", "window", "episode", "exact"] = "stored"
    """a replayed sequence starts from: the stored memory or an empty one (+ --burn-in), no memory (DTQN: acting on the
    last --window steps), a recompute from the episode start (AMAGO) or of the L x M rows before t0 (exact: the band)"""
    memory_length: int = 32
    """M: the steps of layer inputs each step attends to (memory modes)"""
    store_layer0: bool = True
    """--memory stored: store layer 0's entries too; off: only layers >= 1, layer 0's recomputed from the window"""
    window: int = 16
    """k: the steps the agent acts on in --memory window (it trains on windows of seq_len + n_step <= k steps)"""

    # R2D2
    total_timesteps: int = 150_000
    """total environment steps of training (summed over envs)"""
    learning_rate: float = 3e-4
    """the Adam learning rate"""
    adam_eps: float = 1e-3
    """Adam epsilon (R2D2 uses 1e-3)"""
    buffer_size: int = 30_000
    """replay capacity in environment steps (rows), summed over envs"""
    batch_size: int = 32
    """sequences per gradient update"""
    seq_len: int = 10
    """m: trained steps per replayed sequence"""
    seq_overlap: int = 5
    """steps shared by the trained parts of consecutive sequences of an episode"""
    burn_in: int = 4
    """steps recomputed without gradient before the trained part, refreshing the burn_in newest memory entries"""
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
    final_delta_q_sequences: int = 512
    """replayed sequences for the last network's Delta-Q ablation (`final_delta_q_memory`)"""


@dataclass(frozen=True)
class MemoryMode:
    """What a --memory mode stores, gathers and trains from: the one place the modes differ (`MEMORY_MODES`)."""

    stores_memory: bool  # the replay keeps each row's layer inputs, the memory a sequence starts from; else it is empty
    acts_on_window: bool  # DTQN: the actor re-encodes its last --window rows (no memory; the network's span k - 1)
    burn_in: str  # rows recomputed before t0: "args" (--burn-in), "none", "band" (L x M) or "episode" (all of them)


MEMORY_MODES = {
    "stored": MemoryMode(stores_memory=True, acts_on_window=False, burn_in="args"),
    "zero": MemoryMode(stores_memory=False, acts_on_window=False, burn_in="args"),
    "window": MemoryMode(stores_memory=False, acts_on_window=True, burn_in="none"),
    "episode": MemoryMode(stores_memory=False, acts_on_window=False, burn_in="episode"),
    "exact": MemoryMode(stores_memory=False, acts_on_window=False, burn_in="band"),
}


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


def attention_band(num_queries: int, key_valid: torch.Tensor, span: int):
    """Which keys each query attends to. The keys are the M' memory entries, then the queries' own rows (S = M' + T):
    query i is key M' + i and attends to key j iff 0 <= offset = M' + i - j <= span and key j is valid (same episode),
    or j is i itself (a row before its episode's start attends to itself only: no empty softmax).
    key_valid (S, B) bool -> allowed (B, T, S) bool, offset (T, S)."""
    S, device = key_valid.shape[0], key_valid.device
    offset = (S - num_queries + torch.arange(num_queries, device=device))[:, None] - torch.arange(S, device=device)
    in_band = (offset >= 0) & (offset <= span)  # (T, S)
    return in_band[None] & (key_valid.T[:, None, :] | (offset == 0)[None]), offset


class GRUGate(nn.Module):
    """GTrXL's gating layer g(x, y) = (1 - z) x + z h (see Key equations); b_g = GATE_BIAS > 0 starts it near x."""

    def __init__(self, d_model: int):
        super().__init__()
        self.w = nn.Linear(d_model, 3 * d_model, bias=False)  # W_r, W_z, W_g applied to y
        self.u = nn.Linear(d_model, 2 * d_model, bias=False)  # U_r, U_z applied to x
        self.u_g = nn.Linear(d_model, d_model, bias=False)  # U_g applied to r * x

    def forward(self, x, y):
        w_r, w_z, w_g = self.w(y).chunk(3, dim=-1)
        u_r, u_z = self.u(x).chunk(2, dim=-1)
        r = torch.sigmoid(w_r + u_r)
        z = torch.sigmoid(w_z + u_z - GATE_BIAS)
        return (1.0 - z) * x + z * torch.tanh(w_g + self.u_g(r * x))


class GatedBlock(nn.Module):
    """One pre-norm GTrXL block: gated attention over [memory, rows] with a learned bias per head and offset, then a
    gated MLP."""

    def __init__(self, d_model: int, num_heads: int, ff_size: int, span: int):
        super().__init__()
        self.num_heads, self.span = num_heads, span
        self.norm_attn, self.norm_mlp = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.query, self.key_value = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.position_bias = nn.Parameter(torch.zeros(num_heads, span + 1))  # b_{head, offset}, offset 0..span
        self.gate_attn, self.gate_mlp = GRUGate(d_model), GRUGate(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, ff_size), nn.ReLU(), nn.Linear(ff_size, d_model))

    def forward(self, x, context, allowed, offset):
        """x (T, B, D) the rows; context (S, B, D) = [memory, x]; allowed (B, T, S); offset (T, S) query - key."""
        (T, B, D), S, H = x.shape, context.shape[0], self.num_heads
        q = self.query(self.norm_attn(x)).view(T, B, H, D // H).permute(1, 2, 0, 3)  # (B, H, T, D/H)
        k, v = self.key_value(self.norm_attn(context)).view(S, B, 2, H, D // H).permute(2, 1, 3, 0, 4)  # (B, H, S, D/H)
        bias = self.position_bias[:, offset.clamp(0, self.span)]  # (H, T, S)
        mask = bias[None].masked_fill(~allowed[:, None], float("-inf"))  # (B, H, T, S)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(2, 0, 1, 3).reshape(T, B, D)
        x = self.gate_attn(x, F.relu(self.out(y)))
        return self.gate_mlp(x, F.relu(self.mlp(self.norm_mlp(x))))


class TransformerXLQNetwork(nn.Module):
    """[o_t, onehot(a_{t-1}), r_{t-1}] -> Linear -> gated blocks, each attending to the `span` steps before a row ->
    LayerNorm -> dueling head Q(h_t, .)."""

    def __init__(self, obs_dim, num_actions, d_model, num_layers, num_heads, ff_size, span):
        super().__init__()
        self.obs_dim, self.num_actions, self.d_model, self.span = obs_dim, num_actions, d_model, span
        self.embed = nn.Linear(obs_dim + num_actions + 1, d_model)
        self.blocks = nn.ModuleList(GatedBlock(d_model, num_heads, ff_size, span) for _ in range(num_layers))
        self.norm_out = nn.LayerNorm(d_model)
        self.value = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, 1))
        self.advantage = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, num_actions))

    def encode(self, obs, prev_action, prev_reward):
        """(T, B, obs_dim), (T, B), (T, B) -> (T, B, D); prev_action = NO_ACTION gives a zero one-hot."""
        onehot = F.one_hot(prev_action.clamp(min=0), self.num_actions).float() * (prev_action >= 0)[..., None]
        return self.embed(torch.cat([obs, onehot, prev_reward[..., None]], dim=-1))

    def forward(self, x, memory, key_valid):
        """x (T, B, D) embedded rows; memory (L, M', B, D) the layer inputs of the M' rows before them (detached);
        key_valid (M' + T, B) which memory entries and rows may be attended to. Returns Q (T, B, A) and the rows'
        layer inputs (L, T, B, D), the memory entries they become."""
        allowed, offset = attention_band(x.shape[0], key_valid, self.span)  # (B, T, S), (T, S)
        inputs = []
        for layer, block in enumerate(self.blocks):
            inputs.append(x)
            x = block(x, torch.cat([memory[layer], x]), allowed, offset)
        out = self.norm_out(x)  # (T, B, D)
        adv = self.advantage(out)
        return self.value(out) + adv - adv.mean(-1, keepdim=True), torch.stack(inputs)


class MemoryReplay:  # r2d2_rnnstate.py's SequenceReplay stores LSTM states; this one layer inputs, `lead` rows back
    """O(T) ring buffer of rows (capacity rows per env column) plus a prioritized table of sequences.

    A sequence is identified by its env column, its anchor t0 (first trained row, absolute step index) and its
    episode's first row; its window is rows [t0 - lead, t0 + seq_len + n_step) (`lead_rows`).
    """

    def __init__(self, capacity, num_envs, obs_dim, stored_layers, d_model, seq_len, overlap, lead, n_step):
        self.cap, self.E = capacity, num_envs
        self.m, self.stride, self.lead, self.n = seq_len, seq_len - overlap, lead, n_step
        row_layout = {"obs": ((obs_dim,), np.float32)} | {name: ((), dtype) for name, dtype in ROW_SCALARS.items()}
        row_layout["layer_inputs"] = ((stored_layers, d_model), np.float32)  # the actor's memory entry
        for name, (shape, dtype) in row_layout.items():  # (capacity, num_envs, *shape) arrays
            setattr(self, name, np.zeros((capacity, num_envs, *shape), dtype=dtype))
        self.row_fields = tuple(row_layout)  # what the replay stores per row
        self.t = 0  # absolute index of the next row (the same for every env column)
        self.ep_start = np.zeros(num_envs, dtype=np.int64)  # absolute first row of each column's current episode
        # sequence table: a ring as well; at most one anchor per 2 rows (an episode has >= 1 step + its final row)
        self.seq_cap = capacity * num_envs // min(self.stride, 2) + num_envs
        self.seq_env = np.zeros(self.seq_cap, dtype=np.int64)
        self.seq_anchor = np.zeros(self.seq_cap, dtype=np.int64)
        self.seq_ep_start = np.zeros(self.seq_cap, dtype=np.int64)
        self.priority = np.zeros(self.seq_cap, dtype=np.float64)  # 0 = empty slot
        self.seq_ptr, self.max_priority = 0, 1.0

    def add(self, **row) -> None:
        """Write one row per env (each field but ep_step an (E, ...) array; of its layer inputs the last ones this
        replay keeps: all, layers >= 1 or none) and register the sequences whose windows are complete."""
        r = self.t % self.cap
        self.ep_start[row["first"]] = self.t
        row["layer_inputs"] = row["layer_inputs"][:, row["layer_inputs"].shape[1] - self.layer_inputs.shape[2] :]
        for name, value in (row | {"ep_step": self.t - self.ep_start}).items():
            getattr(self, name)[r] = value
        # a window is complete when its last row (t0 + m + n - 1) is written ...
        span = self.m + self.n - 1
        since_anchor = self.t - self.ep_start - span  # (E,) steps since the last row of anchor ep_start
        done_envs = np.nonzero((since_anchor >= 0) & (since_anchor % self.stride == 0))[0]
        for e in done_envs:
            self._register(e, self.t - span)
        # ... or when the episode's final row is written: register its remaining anchors (padded, masked windows)
        for e in np.nonzero(row["final"])[0]:
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

    def lead_rows(self, ids=slice(None)) -> np.ndarray:
        """Rows before t0 that the window of each sequence `ids` needs: the lead where a stored memory sits in it, else
        (a burn-in from an empty memory) the lead (None: all) but never more than back to its episode's first row."""
        to_episode_start = self.seq_anchor[ids] - self.seq_ep_start[ids]
        if self.layer_inputs.shape[2] > 0:  # --memory stored
            return np.full_like(to_episode_start, self.lead)
        return to_episode_start if self.lead is None else np.minimum(to_episode_start, self.lead)

    def valid(self) -> np.ndarray:
        """Sequences whose needed rows (from max(t0 - lead, episode start)) are still in the ring."""
        oldest = self.t - self.cap  # rows >= oldest are present
        start = np.maximum(self.seq_anchor - self.lead_rows(), self.seq_ep_start)
        return (self.priority > 0) & (start >= oldest)

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

    def gather(self, ids, lead: int | None = None) -> dict:
        """The windows of sequences `ids` as (W, B, ...) arrays: rows t0 - lead .. t0 + m + n - 1 (lead: by default the
        most any of them needs). key_valid marks the rows of the sequence's episode or later (earlier: not attended)."""
        lead = int(self.lead_rows(ids).max()) if lead is None else lead
        absolute = self.seq_anchor[ids][None, :] + np.arange(-lead, self.m + self.n)[:, None]  # (W, B)
        rows, cols = absolute % self.cap, np.broadcast_to(self.seq_env[ids][None, :], absolute.shape)
        out = {name: getattr(self, name)[rows, cols] for name in self.row_fields}  # (W, B, ...)
        out["key_valid"] = absolute >= self.seq_ep_start[ids][None, :]
        return out


def to_torch(win: dict, device) -> dict:
    return {key: torch.as_tensor(value, device=device) for key, value in win.items()}


def no_memory(net, batch: int, device) -> torch.Tensor:
    """An empty memory (L, 0, B, D): what the memory is at an episode's first step."""
    return torch.zeros(len(net.blocks), 0, batch, net.d_model, device=device)


@torch.no_grad()  # the memory gets no gradient: stored, recomputed layer 0 and burn-in alike
def anchor_memory(net, win: dict, lead: int, memory: str, burn_in: int, memory_length: int):
    """The memory at t0 (row `lead` of the window) that `net` starts the trained rows from: the stored layer inputs
    of rows t0 - burn_in - M .. t0 - burn_in - 1 (`memory` = "stored") or nothing ("zero"), then a burn-in that
    recomputes rows t0 - burn_in .. t0 - 1 from it and replaces the burn_in newest entries. Returns ((L, M', B, D),
    the entries' key_valid (M', B)); B is the batch of sequences."""
    P, M, batch_size = lead, memory_length, win["obs"].shape[1]
    if memory == "stored":
        rows = slice(P - burn_in - M, P - burn_in)
        entries, valid = win["layer_inputs"][rows].permute(2, 0, 1, 3), win["key_valid"][rows]  # (L, M, B, D), (M, B)
        if len(entries) < len(net.blocks):  # --no-store-layer0: layer 0's entries are the rows' embeddings, recomputed
            x = net.encode(win["obs"][rows], win["prev_action"][rows], win["prev_reward"][rows])  # (M, B, D)
            entries = torch.cat([x[None], entries])
    else:
        entries, valid = no_memory(net, batch_size, win["obs"].device), win["key_valid"][:0]
    for start in range(P - burn_in, P, M):  # segments of at most M rows, each from the memory before it (TrXL)
        rows = slice(start, min(start + M, P))
        x = net.encode(win["obs"][rows], win["prev_action"][rows], win["prev_reward"][rows])  # (rows, B, D)
        _, fresh = net(x, entries, torch.cat([valid, win["key_valid"][rows]]))  # (L, rows, B, D)
        entries = torch.cat([entries, fresh], dim=1)[:, -M:]
        valid = torch.cat([valid, win["key_valid"][rows]])[-M:]
    return entries, valid


def memory_q(net, win: dict, lead: int, memory: str, burn_in: int, memory_length: int) -> torch.Tensor:
    """Q (W - lead, B, A) of the rows from t0 on, in one forward pass from the memory at t0 (`anchor_memory`)."""
    entries, valid = anchor_memory(net, win, lead, memory, burn_in, memory_length)
    x = net.encode(win["obs"][lead:], win["prev_action"][lead:], win["prev_reward"][lead:])  # (W - lead, B, D)
    return net(x, entries, torch.cat([valid, win["key_valid"][lead:]]))[0]


def replay_q(net, win: dict, lead: int, args: Args) -> torch.Tensor:
    """Q of a window's rows from t0 on, as this run's --memory mode computes them (learner and target network): from
    the stored memory and --burn-in, or from an empty memory with all `lead` rows before t0 as the burn-in (DTQN: 0)."""
    if MEMORY_MODES[args.memory].stores_memory:
        return memory_q(net, win, lead, "stored", args.burn_in, args.memory_length)
    return memory_q(net, win, lead, "zero", lead, args.memory_length)


def next_row_flags(final, terminated, truncated):
    """Flags (first, final, terminal) of the row that the obs returned by a NEXT_STEP-autoreset step() fills.

    If the current row was final, that step() was the reset step: the new row is a reset obs (`first`), and
    gymnasium reports terminated = truncated = False for it. Otherwise an ended episode makes the new row final.
    """
    done = (terminated | truncated) & ~final
    return final.copy(), done, terminated & ~final


def initial_context(net, memory: str, window: int, num_envs: int, device) -> dict:
    """What the actor carries between steps, empty: the memory of the last M rows' layer inputs (memory modes), or
    the last window - 1 rows' inputs to re-encode (window mode); `valid` marks entries of the current episode."""
    if not MEMORY_MODES[memory].acts_on_window:
        entries = torch.zeros(len(net.blocks), net.span, num_envs, net.d_model, device=device)  # (L, M, E, D)
        return {"memory": entries, "valid": torch.zeros(net.span, num_envs, dtype=torch.bool, device=device)}
    k = window - 1
    return {
        "obs": torch.zeros(k, num_envs, net.obs_dim, device=device),
        "prev_action": torch.full((k, num_envs), NO_ACTION, device=device),
        "prev_reward": torch.zeros(k, num_envs, device=device),
        "valid": torch.zeros(k, num_envs, dtype=torch.bool, device=device),
    }


@torch.no_grad()  # r2d2_rnnstate.py's actor_step carries an LSTM state, this one a memory (or window) of rows
def memory_actor_step(net, context: dict, obs, prev_action, prev_reward, first):
    """One acting step for E envs: forget the previous episode where one starts, then Q(h_t, .) of the new row from
    the carried context. Returns (q (E, A), the new context, the row's layer inputs (E, L', D) as numpy: its
    memory entry, stored in replay; L' = 0 in the window mode)."""
    device, dtype, E = context["valid"].device, net.embed.weight.dtype, len(obs)
    valid = context["valid"] & ~torch.as_tensor(first, device=device)[None]  # (K, E)
    row = {
        "obs": torch.as_tensor(obs, dtype=dtype, device=device)[None],
        "prev_action": torch.as_tensor(prev_action, device=device)[None],
        "prev_reward": torch.as_tensor(prev_reward, dtype=dtype, device=device)[None],
    }
    key_valid = torch.cat([valid, torch.ones(1, E, dtype=torch.bool, device=device)])
    if "memory" in context:  # Transformer-XL: the new row attends to the memory of the last M rows
        q, inputs = net(net.encode(**row), context["memory"], key_valid)  # (1, E, A), (L, 1, E, D)
        new = {"memory": torch.cat([context["memory"][:, 1:], inputs], dim=1), "valid": key_valid[1:]}
        return q[0], new, inputs[:, 0].permute(1, 0, 2).cpu().numpy()
    rows = {key: torch.cat([context[key], value]) for key, value in row.items()}  # window: re-encode the last k rows
    q, _ = net(net.encode(**rows), no_memory(net, E, device), key_valid)
    new = {key: value[1:] for key, value in rows.items()} | {"valid": key_valid[1:]}
    return q[-1], new, np.zeros((E, 0, net.d_model), dtype=np.float32)


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


def replay_lead(args: Args) -> int | None:
    """Rows a replayed window needs before t0 (`MemoryReplay.lead_rows`): the burn-in's, after the stored memory at
    t0 - burn_in where the mode stores one; None: everything back to the episode's first row."""
    mode, L, M = MEMORY_MODES[args.memory], args.num_layers, args.memory_length
    burn_in = {"args": args.burn_in, "none": 0, "band": L * M, "episode": None}[mode.burn_in]
    return burn_in + M if mode.stores_memory else burn_in


def build_network(args: Args, obs_dim: int, num_actions: int) -> TransformerXLQNetwork:
    """The Q-network of this run's mode: span M (memory modes) or k - 1 (window mode)."""
    span = args.window - 1 if MEMORY_MODES[args.memory].acts_on_window else args.memory_length
    sizes = (args.d_model, args.num_layers, args.num_heads, args.ff_size)
    return TransformerXLQNetwork(obs_dim, num_actions, *sizes, span)


@dataclass
class TrainState:
    """What the training loop carries from one env step to the next; a checkpoint saves every field (`Run`)."""

    q_network: nn.Module
    target_network: nn.Module
    optimizer: torch.optim.Optimizer
    rb: MemoryReplay
    rng: np.random.Generator  # exploration and replay sampling
    vec_env: gym.vector.SyncVectorEnv  # not saved: --resume begins new episodes
    obs: np.ndarray  # (E, obs_dim) the observation of the current row
    context: dict  # the actor's memory (or window of rows), `initial_context`
    first: np.ndarray = field(init=False)  # (E,) the row holds a reset observation
    final: np.ndarray = field(init=False)  # (E,) the row holds an episode's final observation (action ignored)
    terminal: np.ndarray = field(init=False)  # (E,) that final observation is terminal (no bootstrap)
    prev_action: np.ndarray = field(init=False)  # (E,) a_{t-1} (NO_ACTION at an episode's first step)
    prev_reward: np.ndarray = field(init=False)  # (E,) r_{t-1}
    ep_return: np.ndarray = field(init=False)  # (E,) return and length of each env's episode so far
    ep_length: np.ndarray = field(init=False)  # (E,)
    ep_returns: list = field(default_factory=list)  # returns and lengths of the finished episodes
    ep_lengths: list = field(default_factory=list)
    num_updates_done: int = 0
    learner_seconds: float = 0.0  # wall time of the learning steps (sampling to priorities), for the cost study

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
    vec_env = make_next_step_vec_env(args.env_id, env_kwargs, args.num_envs)
    obs_dim, num_actions = vec_env.single_observation_space.shape[0], int(vec_env.single_action_space.n)
    q_network = build_network(args, obs_dim, num_actions).to(device)
    if args.eval_only:
        run.load_model(q_network)  # the --checkpoint network: evaluated below, nothing is trained
    target_network = build_network(args, obs_dim, num_actions).to(device)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, eps=args.adam_eps, fused=True)
    E, m, n, D = args.num_envs, args.seq_len, args.n_step, args.d_model
    stored_layers = args.num_layers - (not args.store_layer0) if MEMORY_MODES[args.memory].stores_memory else 0
    rb = MemoryReplay(args.buffer_size // E, E, obs_dim, stored_layers, D, m, args.seq_overlap, replay_lead(args), n)
    epsilons = ape_x_epsilons(E, args.exploration_eps, args.exploration_alpha)  # (E,)
    eps_v = args.value_rescaling_eps

    obs, context = vec_env.reset(seed=args.seed)[0], initial_context(q_network, args.memory, args.window, E, device)
    state = TrainState(q_network, target_network, optimizer, rb, rng, vec_env, obs, context)
    global_step = run.restore(state)  # 0, or --resume's step (networks, Adam, replay, RNGs restored; new episodes)
    num_vector_steps = 0 if args.eval_only else args.total_timesteps // E
    for step in range(global_step // E, num_vector_steps):
        # 1. act: forget the memory at episode starts, epsilon-greedy per env on Q(h_t, .) from the carried memory
        state.prev_action[state.first], state.prev_reward[state.first] = NO_ACTION, 0.0
        q, state.context, layer_inputs = memory_actor_step(
            q_network, state.context, state.obs, state.prev_action, state.prev_reward, state.first
        )
        greedy = q.argmax(-1).cpu().numpy()  # (E,)
        explore = rng.random(E) < epsilons
        action = np.where(explore, rng.integers(num_actions, size=E), greedy)

        # 2. step the envs (NEXT_STEP autoreset: after a final row, this step is the reset step)
        next_obs, reward, term, trunc, infos = vec_env.step(action)
        reward = np.where(state.final, 0.0, reward).astype(np.float32)  # the reset step's reward is not a reward
        rb.add(**state.row(), layer_inputs=layer_inputs, action=action, reward=reward)
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

        # 3. learn: sample prioritized sequences, their memory at t0 (stored + burn-in, empty, or none: windows),
        #    n-step double-Q targets on h-rescaled values
        if global_step >= args.learning_starts and step % args.train_frequency == 0 and rb.valid().any():
            learn_start = time.perf_counter()
            ids, weights = rb.sample(args.batch_size, args.priority_exponent, args.importance_exponent, rng)
            lead = int(rb.lead_rows(ids).max())  # rows before t0 in the windows
            win = to_torch(rb.gather(ids, lead), device)
            q_all = replay_q(q_network, win, lead, args)  # (m + n, B, A) online Q of t0 .. end
            with torch.no_grad():
                q_target_all = replay_q(target_network, win, lead, args)  # (m + n, B, A)
                best = q_all.argmax(-1, keepdim=True)  # double Q: online argmax, target evaluation
                boot_values = inverse_value_rescale(q_target_all.gather(-1, best).squeeze(-1), eps_v)  # (m + n, B)
                final_f, terminal_f = win["final"][lead:].float(), win["terminal"][lead:].float()
                targets = nstep_rescaled_targets(
                    win["reward"][lead:], final_f, terminal_f, boot_values, args.gamma, n, m, eps_v
                )  # (m, B)
                mask = torch.cumprod(1.0 - final_f[:m], dim=0)  # (m, B) 1 up to the episode's last action
            q_taken = q_all[:m].gather(-1, win["action"][lead : lead + m, :, None]).squeeze(-1)  # (m, B)
            td = targets - q_taken
            w = torch.as_tensor(weights, dtype=torch.float32, device=device)
            per_seq = 0.5 * (td**2 * mask).sum(0) / mask.sum(0).clamp(min=1.0)  # (B,)
            loss = (w * per_seq).mean()

            # 4. gradient step, new priorities, target network copy
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
            optimizer.step()
            new_priorities = sequence_priority(td.detach().abs(), mask, args.priority_eta)
            rb.update_priorities(ids, new_priorities.cpu().numpy().astype(np.float64))
            state.num_updates_done += 1
            if state.num_updates_done % args.target_network_frequency == 0:
                target_network.load_state_dict(q_network.state_dict())
            state.learner_seconds += time.perf_counter() - learn_start

            if state.num_updates_done % LOG_EVERY_UPDATES == 0:
                sps = int(global_step / (time.time() - run.start_time))
                losses = {"losses/td_loss": loss.item(), "losses/q_values": q_taken.mean().item(), "charts/SPS": sps}
                run.log(global_step, losses | {"charts/learning_rate": args.learning_rate})
                recent = np.mean(state.ep_returns[-50:]) if state.ep_returns else float("nan")
                print(f"global_step={global_step} return(last 50)={recent:.2f} td_loss={loss.item():.4f} SPS={sps}")
        run.end_step(global_step, state)  # a checkpoint every --save-every env steps; Ctrl-C / SIGTERM: one, then exit
    run.end_training()  # Ctrl-C / SIGTERM stop at once again (a resume would redo what follows)
    vec_env.close()

    # after training: the one-network Delta-Q ablation (memory modes), then the greedy evaluation
    sizes = (args.final_delta_q_sequences, device, args.burn_in, args.memory_length)
    final_dq = {} if args.eval_only else final_delta_q_memory(q_network, rb, rng, *sizes)  # {}: no stored memory
    metrics = {"model/final_delta_q_" + key: value for key, value in final_dq.items() if key != "count"}
    metrics |= evaluate(q_network, args, env_kwargs, eval_env_seed(args.seed), device)
    if not args.eval_only:  # the O(T) replay: each step once, with its memory entry; the learner's time per update
        metrics.update({f"replay/{key}": value for key, value in replay_bytes_memory(rb, args.memory_length).items()})
        metrics["perf/learner_ms_per_update"] = 1000.0 * state.learner_seconds / max(state.num_updates_done, 1)
        metrics["charts/mean_episodic_length"] = np.mean(state.ep_lengths) if state.ep_lengths else np.nan  # T
    run.log(global_step, metrics)
    run.finish(metrics, {"model": q_network}, global_step)  # the model, summary.json; the checkpoint deleted


@torch.no_grad()
def evaluate(net, args: Args, env_kwargs: dict, seed: int, device) -> dict:
    """Greedy episodes, one after the other in a single env: the eval/ metrics (success where the env reports it)."""
    env = make_flat_env(args.env_id, env_kwargs)
    episodes = []  # (return, length, success) of each episode
    for ep in range(args.eval_episodes):
        obs, _ = env.reset(seed=seed + ep)
        context = initial_context(net, args.memory, args.window, 1, device)
        prev_action, prev_reward, first, total, success = NO_ACTION, 0.0, True, 0.0, np.nan
        for length in range(1, MAX_EVAL_STEPS + 1):  # noqa: B007  (read after the loop)
            q, context, _ = memory_actor_step(net, context, obs[None], [prev_action], [prev_reward], [first])
            action = int(q[0].argmax())
            obs, reward, terminated, truncated, info = env.step(action)
            total, prev_action, prev_reward, first = total + float(reward), action, float(reward), False
            if terminated or truncated:
                success = float(info["success"]) if "success" in info else np.nan
                break
        episodes.append((total, length, success))
    env.close()
    returns, lengths, successes = np.array(episodes).T
    metrics = {"eval/episodic_return": np.mean(returns), "eval/episodic_return_std": np.std(returns)}
    metrics["eval/episodic_length"] = np.mean(lengths)
    if not np.isnan(successes).all():  # the env reports info["success"] (TMaze, Tiger)
        metrics["eval/success_rate"] = np.nanmean(successes)
    return metrics


# === ANALYSIS (measurements for the docs; not needed to train) ===
# final_delta_q_memory, replay_bytes_memory: r2d2_rnnstate.py's final_delta_q and replay_bytes measure an LSTM state
@torch.no_grad()
def final_delta_q_memory(net, rb, rng: np.random.Generator, num_sequences: int, device, burn_in, memory_length) -> dict:
    """The ablation on ONE network: Delta-Q of the same replayed sequences started three ways. On up to
    `num_sequences` sequences that start mid-episode and whose episode start is stored, Q at the first and last
    trained row from an empty memory at t0 (`zero`) or at t0 - burn_in and the burn-in (`zero_burn_in`: mode (a)),
    the memory stored at t0 (`stored`), or the memory stored at t0 - burn_in and the burn-in (`stored_burn_in`: mode
    (c)), against Q from the memory recomputed from the episode start.
    {} where the replay stores no memory (--memory stored only)."""
    mid_episode = rb.seq_anchor > rb.seq_ep_start
    ok = np.nonzero(rb.valid() & mid_episode & (rb.seq_ep_start >= rb.t - rb.cap))[0]
    if len(ok) == 0 or rb.layer_inputs.shape[2] == 0:
        return {}
    ids = rng.choice(ok, size=min(num_sequences, len(ok)), replace=False)
    prefix = int((rb.seq_anchor[ids] - rb.seq_ep_start[ids]).max())  # rows from the episode start to t0
    full = to_torch(rb.gather(ids, lead=prefix), device)
    # the true memory: the whole prefix as a burn-in from the episode start (m + n, b, A)
    q_true = memory_q(net, full, prefix, "zero", prefix, memory_length)
    win, lead = to_torch(rb.gather(ids), device), int(rb.lead_rows(ids).max())
    variants = {  # (memory, burn-in): zero_burn_in starts where mode (a) trains from, an empty memory at t0 - burn_in
        "zero": ("zero", 0),
        "zero_burn_in": ("zero", burn_in),
        "stored": ("stored", 0),
        "stored_burn_in": ("stored", burn_in),
    }
    mask = torch.cumprod(1.0 - win["final"][lead : lead + rb.m].float(), dim=0)  # (m, b) trained rows
    last, col = (mask.sum(0).long() - 1).clamp(min=0), torch.arange(len(ids), device=device)
    out = {"count": float(len(ids))}
    for name, (memory, burn) in variants.items():
        if name.endswith("_burn_in") and burn_in == 0:
            continue
        q = memory_q(net, win, lead, memory, burn, memory_length)
        out[f"first_{name}"] = delta_q(q[0], q_true[0]).mean().item()
        out[f"last_{name}"] = delta_q(q[last, col], q_true[last, col]).mean().item()
    return out


def replay_bytes_memory(rb, memory_length: int) -> dict:
    """Bytes of the replay's filled rows as stored (each step once, with its layer inputs), a row's bytes, and what
    the memory at one sequence start takes (M x L x D floats; the LSTM's state is 2 x width)."""
    per_row = sum(getattr(rb, name)[0, 0].nbytes for name in rb.row_fields)
    return {
        "bytes": float(min(rb.t, rb.cap) * rb.E * per_row),
        "bytes_per_row": float(per_row),
        "memory_bytes_per_sequence": float(memory_length * rb.layer_inputs[0, 0].nbytes),
    }


# === RUN MANAGEMENT (not the algorithm: validation, run dir, checkpoints and --resume, Ctrl-C, summary) ===
SCRIPT = Path(__file__).stem  # names this script in summary.json and in checkpoints (--resume checks it)
# read from a checkpoint's args.json for --eval-only
ARCH_FIELDS = tuple("env_id env_kwargs d_model num_layers num_heads ff_size memory memory_length window".split())
RESUME_FREE_FIELDS = ("resume", "save_every", "threads", "runs_dir")  # may change on --resume; the rest is the run's
POSITIVE_FIELDS = "threads num_envs batch_size n_step d_model num_layers num_heads ff_size memory_length window".split()
POSITIVE_FIELDS += ["eval_episodes", "train_frequency", "target_network_frequency", "final_delta_q_sequences"]
ZERO_OK_FIELDS = ("burn_in", "save_every")  # 0: no burn-in, no periodic checkpoint


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work; `--resume`: the run's own Args, `--eval-only`:
    the env and the architecture of its checkpoint."""
    args = tyro.cli(Args)
    if args.resume is not None and not args.eval_only:
        args = resume_args(args)[0]
    if args.eval_only and args.checkpoint is not None:  # the env and the architecture the checkpoint was trained with
        saved = load_checkpoint(args.checkpoint)[1]
        vars(args).update({name: saved[name] for name in ARCH_FIELDS if name in saved})
    mode, lead = MEMORY_MODES[args.memory], replay_lead(args) or 0
    window, capacity = lead + args.seq_len + args.n_step, args.buffer_size // max(args.num_envs, 1)
    max_steps = time_limit(args.env_id, args.env_kwargs)  # None where gymnasium does not know it: `check_episode_fits`
    for ok, message in [
        (args.resume is None or not args.eval_only, "--resume continues a training run, not --eval-only"),
        (args.checkpoint or not args.eval_only, "--eval-only needs --checkpoint PATH (a run dir or model.safetensors)"),
        *[(getattr(args, name) >= 1, f"--{name.replace('_', '-')} must be at least 1") for name in POSITIVE_FIELDS],
        *[(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be at least 0") for name in ZERO_OK_FIELDS],
        (args.env_kwargs.lstrip().startswith("{"), f"--env-kwargs must be a JSON object, got {args.env_kwargs}"),
        (0 <= args.seq_overlap < args.seq_len, "need 0 <= --seq-overlap < --seq-len"),
        (args.d_model % max(args.num_heads, 1) == 0, "--d-model must be a multiple of --num-heads"),
        (
            not mode.acts_on_window or args.seq_len + args.n_step <= args.window,
            f"--memory window trains on --seq-len + --n-step rows, more than --window {args.window}",
        ),
        (
            mode.burn_in != "args" or args.burn_in <= args.memory_length,
            f"--burn-in {args.burn_in} is longer than the memory (--memory-length {args.memory_length})",
        ),
        (
            mode.burn_in == "args" or args.burn_in == Args.burn_in,
            f"--burn-in does not apply to --memory {args.memory}: leave it out",
        ),
        (args.store_layer0 or mode.stores_memory, f"--no-store-layer0 applies to --memory stored, not {args.memory}"),
        (args.eval_episodes <= EVAL_SEED_STRIDE, f"need --eval-episodes <= {EVAL_SEED_STRIDE} (disjoint seeds)"),
        (capacity >= 4 * window, f"--buffer-size: {capacity} rows per env, fewer than 4 windows of {window} rows"),
        (
            replay_lead(args) is not None or (max_steps or 0) < capacity,
            episode_too_long(capacity, f"{args.env_id} episodes have up to {(max_steps or 0) + 1} rows"),
        ),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    return args


def time_limit(env_id: str, env_kwargs: str) -> int | None:
    """The env's step limit as gymnasium knows it: gym.make's max_episode_steps, else the registered spec's; None
    where neither is known (or the id or the JSON is bad: check_env reports that)."""
    try:
        limit = json.loads(env_kwargs).get("max_episode_steps", gym.spec(env_id).max_episode_steps)
    except (gym.error.Error, ValueError, AttributeError):
        return None
    return limit if isinstance(limit, int) else None


def episode_too_long(capacity: int, what: str) -> str:
    """The one-line error of --memory episode when an episode has more rows than the replay holds per env."""
    return f"--memory episode replays whole episodes, but {what}, more than the {capacity} rows per env (--buffer-size)"


def check_episode_fits(rb: MemoryReplay) -> None:
    """--memory episode (windows back to the episode's first row): a one-line error as soon as an episode has more
    rows than the replay holds per env (its first row is overwritten: `valid` never again holds for its sequences)."""
    rows = (rb.t - rb.ep_start).max()
    if rb.lead is None and rows > rb.cap:
        raise SystemExit(f"error: {episode_too_long(rb.cap, f'an episode has reached {rows} rows')}")


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
        a seed drawn from the run's seed and the step, an empty memory). Returns the env steps done (else 0)."""
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
        state.context = initial_context(
            state.q_network, self.args.memory, self.args.window, len(state.obs), self.device
        )
        state.__post_init__()  # every env at the first row of an episode
        print(f"resumed {self.run_dir} at global_step={step}, new episodes from env seed {seed}")
        return step

    def end_step(self, step: int, state: TrainState) -> None:
        """A checkpoint after each multiple of --save-every env steps (but the last step) and on a stop signal, which
        then exits with STOP_EXIT_CODE."""
        args, E = self.args, self.args.num_envs
        check_episode_fits(state.rb)
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
    from) where the episode had not ended, so the replay registers its last sequences and none runs into the next. Its
    memory entry is zeros: no window reads it (each sequence of its episode starts before it; later ones mask it)."""
    keep = ~state.first  # a reset row: no previous action or reward
    row = state.row() | {"final": np.ones_like(keep), "prev_action": np.where(keep, state.prev_action, NO_ACTION)}
    entry = np.zeros((len(keep), len(state.q_network.blocks), state.q_network.d_model), np.float32)
    no_action = {"action": np.zeros(len(keep), np.int64), "reward": np.zeros(len(keep), np.float32)}  # a final row's
    state.rb.add(**row | {"prev_reward": np.where(keep, state.prev_reward, 0.0)}, layer_inputs=entry, **no_action)


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
