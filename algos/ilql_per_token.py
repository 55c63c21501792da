"""ILQL: Implicit Language Q-Learning (per-token offline RL for dialogue) on `seqrl/GuessTheImage-v0`.

Lecture part 3: dialogue is a POMDP whose state is the history; value-based offline RL can learn from logged
conversations. Here a time step is a TOKEN: a causal transformer outputs, per vocabulary entry, the Q-value of writing
that token next. The answerer's tokens are the environment's transition, so the backup jumps over them. Offline,
max_a Q would trust lucky, rarely seen tokens, so ILQL never maximizes during training: V is an expectile of Q over
the data's tokens (IQL), and a per-token CQL term (a cross-entropy of Q-as-logits) pushes down unused tokens. At test
time the BC language model is steered by the advantage. Claim: on data where no behavior is both efficient and
reliable, ILQL stitches hasty's questions with thorough's patience and beats BC and filtered BC.

Key equations (s = a token prefix whose next token is the agent's, a = that token, s' = the next such prefix):
  Q loss:   Σ_{i=1,2} (Q_i(s, a) - y)^2,  y = r + γ (1 - done) V(s')   (s' skips reply tokens; V(s') detached)
  V loss:   L_κ(min_i Q̂_i(s, a) - V(s)),  L_κ(u) = |κ - 1(u < 0)| u^2           (Q̂: Polyak target heads)
  CQL:      Σ_i logsumexp_a' Q_i(s, a') - Q_i(s, a) = Σ_i CE(Q_i(s, ·), a)           (CE: cross-entropy)
  total:    L_Q + L_V + α L_CQL + CE(π_BC(s, ·), a) + λ_b CE(W h(s), secret);   θ̂ <- τ θ + (1 - τ) θ̂
  decoding: π(a | s) ∝ top-k( exp(log π_BC(a | s) + β (min_i Q̂_i(s, a) - V(s))) ),  β = 0 is BC
  flags:    κ = --expectile (IQL writes τ), α = --cql-alpha, τ = --tau (a target update rate in every script)

Implementation details:
  1. Layout <bos> a1 <sep> r1 <sep> ... aT <sep> rT <eos>; `next_state_indices` maps each action position to the
     next action position, skipping the reply. Truncated dialogues are terminal (the turn limit is visible).
  2. One shared backbone with the LM head (π_BC) and MLP heads for Q1, Q2, their Polyak targets and V (trlx).
  3. γ = 1 per token: the task is finite-horizon and undiscounted; 0.99 per token would make questions costly.
  4. Decoding runs all dialogues in lockstep with a KV cache; special tokens other than <sep> are never written.
  5. β is chosen on validation episodes (another secret order); every β is also reported on the test episodes.
  6. The LM head is trained on every token, the replies too: a free world-model auxiliary (trlx does the same).
  7. Baselines from the same script: `--bc-only` (BC), `--bc-only --filter-top-frac 0.2` (filtered BC).
  8. Minibatches of dialogues of similar length (`--group-by-length`) cut the padding by about 40%.
  9. Belief auxiliary (`--belief-coef`, not in ILQL): a head predicts the logged secret from every prefix, which
     trains the backbone to read the answers (next-token losses alone did so only on some seeds).
 10. Polyak τ = 0.05, ten times Snell's: each token of the ~40-token backup chain waits ~1/τ steps for its target,
     and with 0.005 the start value had barely moved by the end of training.
 11. Real checkpoints (`--model-name-or-path`) keep their tokenizer; "<sep>" and "<pad>" are added when missing.
 12. Problem 21.4: `timestep/*` logs the RL horizon and the action space per step of the data.
 13. Top-k runs on log π_BC + β A (trlx's order), so at large β the kept tokens are the highest-advantage ones;
     the CQL term, not a BC filter, keeps them on the data's support.
 14. torchrun: each rank trains on its shard of the global minibatch; token sums are divided by the global counts
     and DDP sums the gradients (`run.data_parallel`). `--resume` continues exactly (RUN MANAGEMENT).
 15. α = 0.02, a fifth of trlx's: where the data mostly guesses (hasty, two objects left) a larger CQL term pushes
     the rarer informative question down, and the policy guesses too early; a smaller one lets asking be
     overestimated (redundant questions). `eval/outcome/*` (G.failure_kinds) shows which of the two a run has.

References: [1] Snell et al. 2022, Offline RL for Natural Language Generation with Implicit Language Q Learning
  (code Sea-Snell/Implicit-Language-Q-Learning). [2] CarperAI/trlx, modeling_ilql.py. [3] Kostrikov et al. 2021, IQL.
  [4] Kumar et al. 2020, CQL. [5] Abdulhai et al. 2023, LMRL-Gym. [6] Lample, Chaplot 2017 (auxiliary game features).
Details, measurements, usage (torchrun, --resume, real models): docs/ilql_per_token.md.
Reproduce: python algos/ilql_per_token.py --seed 1
"""

import functools
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

# imported before init_process_group, not lazily after it (transformers does): its functions' default
# `group=group.WORLD` would keep the group alive past destroy_process_group, and gloo's threads, still running at
# interpreter exit, abort the process (SIGABRT in some two-rank runs without this import)
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
import tyro
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file, save_model
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
import envs  # noqa: E402, F401  (registers the seqrl/ environments)
import envs.guess_image as G  # noqa: E402
from envs.tokenizer import build_tokenizer  # noqa: E402

TASK_ID = "seqrl-GuessTheImage-v0"  # run-name prefix
N_POSITIONS = 160  # context: 7 turns of the longest malformed utterance (12 words) + replies, + 13 new = 147 tokens
SEP_TOKEN, PAD_TOKEN = "<sep>", "<pad>"  # added to a checkpoint's tokenizer that lacks a turn separator / pad token
GEN_BATCH = 512  # dialogues per decoding forward pass
LENGTH_BLOCK = 50  # `--group-by-length`: minibatches per length-sorted block


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (initialization, minibatches, decoding samples)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """use the GPU if available"""
    threads: int = 1
    """torch CPU threads: 1 lets runs side by side share the cores; more can speed up one run of a real model alone"""
    runs_dir: str = "runs"
    """where run directories are written"""
    eval_episodes: int = 500
    """online test episodes per β (secrets stratified over the 18 objects, order from `--eval-seed`)"""
    eval_seed: int = 0
    """seed of the test episodes' secret order"""
    val_episodes: int = 180
    """online validation episodes per β, used only to choose β (10 per object)"""
    val_seed: int = 1
    """seed of the validation episodes (a different secret order than the test episodes)"""
    eval_only: bool = False
    """only evaluate the model given by `--checkpoint` (β sweep, baselines) and write a new run dir"""
    checkpoint: str | None = None
    """a run dir of this script (or its model/ dir) to evaluate with `--eval-only`"""
    save_every: int = 500
    """gradient steps between saves of the checkpoint RUN_DIR/train_state.safetensors (also saved at the last step,
    deleted when the run finishes); 0 = none. Ctrl-C (SIGINT) or SIGTERM always saves it and exits"""
    resume: str | None = None
    """a run dir of this script to continue from its train_state.safetensors, with the run's own arguments (only
    `--save-every`, `--runs-dir`, `--cuda` and `--threads` may differ)"""

    # data
    dataset_path: str | None = None
    """JSONL of dialogues (`G.write_dataset`); None = generate `G.make_dataset(dataset_size, dataset_seed)`"""
    dataset_size: int = 20000
    """dialogues to generate when no `--dataset-path` is given (the default behavior mixture)"""
    dataset_seed: int = 1
    """seed of the generated dataset"""
    filter_top_frac: float = 1.0
    """train on the top fraction of dialogues by return (filtered BC with `--bc-only`, e.g. 0.2); 1.0 = all"""
    bc_only: bool = False
    """train only the LM head by behavior cloning (the BC / filtered-BC baselines); the sweep is then β = 0"""

    # model
    model_name_or_path: str | None = None
    """a causal LM to start from: a save_pretrained dir or a hub id (gpt2, EleutherAI/pythia-70m, ...), kept with
    its own tokenizer ("<sep>" / "<pad>" added when missing, detail 11); None = a tiny decoder (`--arch`) from a
    config over the built-in word-level tokenizer"""
    n_layer: int = 2
    """tiny decoder: transformer blocks"""
    n_embd: int = 64
    """tiny decoder: width"""
    n_head: int = 4
    """tiny decoder: attention heads"""
    arch: str = "llama"
    """backbone built from a config when no `--model-name-or-path`: gpt2 (learned absolute positions) or llama
    (rotary positions)"""

    # ILQL
    gamma: float = 1.0
    """per-token discount γ (Snell's per-token default; the task return is undiscounted)"""
    expectile: float = 0.7
    """expectile κ of the V regression (IQL's τ; trlx default; 0.5 = SARSA-like mean, -> 1 = max over data tokens)"""
    cql_alpha: float = 0.02
    """α, weight of the per-token CQL (cross-entropy of Q-as-logits) term (trlx cql_scale 0.1; detail 15)"""
    bc_weight: float = 1.0
    """weight of the BC cross-entropy on the LM head (trlx awac_scale with awac β = 0)"""
    lm_all_tokens: bool = True
    """train the LM head on every next token, the answerer's replies too (as trlx's awac loss does); the reply
    tokens are a world-model auxiliary that teaches the backbone to read the answers. False = agent tokens only"""
    tau: float = 0.05
    """Polyak rate τ of the target Q heads, applied every step (Snell 0.005, trlx 0.001 every 5 steps; larger here
    because each token of the ~40-token backup chain waits ~1/τ steps for its target; details 10)"""
    belief_coef: float = 1.0
    """weight of the belief auxiliary: a linear head on the last hidden state predicts the logged secret object
    from every prefix (cross-entropy; its minimizer is the posterior over the 18 objects, the belief state). The
    secret is read from the offline logs during training only; 0 disables (needed for logs without secret_id)"""

    # optimization
    num_steps: int = 4000
    """gradient steps"""
    batch_size: int = 32
    """dialogues per minibatch"""
    learning_rate: float = 2e-3
    """AdamW learning rate (linear warmup, constant, then linear decay to 10% over the last `--decay-frac`)"""
    warmup_steps: int = 100
    """linear learning-rate warmup steps"""
    decay_frac: float = 0.2
    """fraction of the steps at the end over which the learning rate decays linearly to 10% (constant before)"""
    group_by_length: bool = True
    """draw each minibatch from dialogues of similar length (shuffled blocks of LENGTH_BLOCK minibatches sorted by
    length, like transformers' `group_by_length`): ~1.7x less padding than uniform sampling"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    log_every: int = 100
    """steps between tensorboard loss logs"""

    # decoding / evaluation
    betas: tuple[float, ...] = (0.0, 1.0, 4.0, 16.0, 64.0, 256.0)
    """advantage weights β swept at evaluation (β = 0 is BC); the best on validation is the headline"""
    top_k: int = 20
    """top-k filter of the decoding scores log π_BC + β A (trlx's order and default, detail 13); 0 = no filter"""
    greedy: bool = False
    """decode by argmax of log π_BC + β A instead of sampling"""

    # filled in at runtime
    n_train_dialogues: int = 0
    """dialogues actually trained on (after filtering)"""


# ---------------------------------------------------------------------------------------------------------------
# ALGO LOGIC: small pure functions (tests import these)
# ---------------------------------------------------------------------------------------------------------------
def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """L_κ(u) = |κ - 1(u < 0)| u^2 elementwise, u = Q - V, κ = `expectile` (IQL eq. 1, its τ; κ > 0.5 weighs Q
    above V more)."""
    weight = torch.where(diff < 0, 1.0 - expectile, expectile)
    return weight * diff.pow(2)


# not dialogue_cql_utterance's candidate_cql_penalty: here over the whole vocabulary, one action token per state
def token_cql_penalty(q_values: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Per-token CQL term logsumexp_a' Q(s, a') - Q(s, a_data), elementwise over (...,). q_values (..., V).
    Identical to F.cross_entropy(q_values, actions, reduction="none"): Q-values used as logits (tested)."""
    q_data = q_values.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    return torch.logsumexp(q_values, dim=-1) - q_data


def next_state_indices(agent_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a dialogue of L tokens: action_mask (L-1,) (position i acts iff token i+1 is the agent's) and
    next_idx (L-1,): for an action position i, the next action position j > i (the backup's s'), which skips the
    answerer's tokens; -1 if none follows (the dialogue is over) or i is not an action."""
    action_mask = np.asarray(agent_mask[1:], dtype=bool)  # (L-1,)
    next_idx = np.full(len(action_mask), -1, dtype=np.int64)
    following = -1  # reverse scan: the nearest action position to the right
    for i in range(len(action_mask) - 1, -1, -1):
        if action_mask[i]:
            next_idx[i] = following
            following = i
    return action_mask, next_idx


def q_targets(
    rewards: torch.Tensor, dones: torch.Tensor, v: torch.Tensor, next_idx: torch.Tensor, gamma: float
) -> torch.Tensor:
    """y = r + γ (1 - done) V(s'), V read at next_idx (no bootstrap where next_idx < 0 or done). All (B, L-1);
    v is (B, L) (a value per position); returned detached."""
    v_next = v.detach().gather(1, next_idx.clamp(min=0))  # (B, L-1)
    bootstrap = (~dones) & (next_idx >= 0)
    return rewards + gamma * torch.where(bootstrap, v_next, torch.zeros_like(v_next))


@torch.no_grad()
def polyak_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """target <- (1 - tau) target + tau online (tau = 1: hard copy)."""
    for t, o in zip(target.parameters(), online.parameters(), strict=True):
        t.mul_(1.0 - tau).add_(o, alpha=tau)


def decoding_scores(
    logits: torch.Tensor, target_q1: torch.Tensor, target_q2: torch.Tensor, v: torch.Tensor, beta: float
) -> torch.Tensor:
    """log π_BC(a|s) + β (min_i Q̂_i(s, a) - V(s)); logits/Q (..., V), v (...,)."""
    advantage = torch.minimum(target_q1, target_q2) - v.unsqueeze(-1)
    return F.log_softmax(logits, dim=-1) + beta * advantage


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest scores per row (others -inf); k <= 0 or k >= V keeps all (trlx `topk_mask`)."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def belief_loss(belief_logits: torch.Tensor, secret: torch.Tensor, real: torch.Tensor, n_real=None) -> torch.Tensor:
    """Cross-entropy of the logged secret from every real prefix, mean over real positions: belief_logits
    (B, L, N_OBJECTS), secret (B,), real (B, L). Minimized by p(secret | prefix), the belief over the 18 objects.
    n_real: the global minibatch's count of real positions under torchrun (the sum over this shard / it)."""
    target = secret[:, None].expand(-1, belief_logits.shape[1])  # (B, L)
    nll = F.cross_entropy(belief_logits.transpose(1, 2), target, reduction="none")  # (B, L)
    return (nll * real.float()).sum() / (real.float().sum() if n_real is None else n_real).clamp(min=1.0)


def ilql_losses(out: dict, batch: dict, args) -> dict:
    """All ILQL losses of one minibatch. out: logits (B, L, V), v (B, L), and q1/q2/tq1/tq2 (N, V) at the N action
    positions (`forward_all(..., q_at=batch["q_at"])`, row-major order); batch: input_ids (B, L), action_mask/
    rewards/dones/next_idx (B, L-1). Means are over action tokens only. Under torchrun the batch is one rank's shard
    and carries the GLOBAL minibatch's counts (n_actions, n_lm, n_real; `make_minibatch`): every loss is then this
    shard's share of the global mean, and the sum over ranks is the one-process value."""
    actions = batch["input_ids"][:, 1:]  # (B, L-1): the token written from state i
    acted = batch["action_mask"].bool()  # (B, L-1)
    n = batch.get("n_actions", acted.sum().float()).clamp(min=1.0)
    a = actions[acted]  # (N,): the data's action tokens

    def at_actions(values):  # (N, V) -> (N,): value of the data token
        return values.gather(-1, a.unsqueeze(-1)).squeeze(-1)

    y = q_targets(batch["rewards"], batch["dones"], out["v"], batch["next_idx"], args.gamma)[acted]  # (N,)
    loss_q = sum((at_actions(out[k]) - y).pow(2).sum() / n for k in ("q1", "q2"))
    target_q = torch.minimum(at_actions(out["tq1"]), at_actions(out["tq2"])).detach()  # (N,)
    loss_v = expectile_loss(target_q - out["v"][:, :-1][acted], args.expectile).sum() / n
    loss_cql = sum(token_cql_penalty(out[k], a).sum() / n for k in ("q1", "q2"))
    token_ce = F.cross_entropy(out["logits"][:, :-1].transpose(1, 2), actions, reduction="none")  # (B, L-1)
    loss_bc = token_ce[acted].sum() / n  # BC: the agent's tokens only
    loss_belief = torch.zeros((), device=acted.device)
    if "secret" in batch and args.belief_coef > 0:  # auxiliary: the belief from every prefix
        loss_belief = belief_loss(out["belief"], batch["secret"], batch["attention_mask"], batch.get("n_real"))
    lm_mask = batch.get("lm_mask")  # (B, L-1): every real next token (agent + answerer), if given
    if lm_mask is not None:
        loss_lm = (token_ce * lm_mask).sum() / batch.get("n_lm", lm_mask.sum()).clamp(min=1.0)
    else:
        loss_lm = loss_bc
    loss_pi = loss_lm if args.lm_all_tokens else loss_bc
    if args.bc_only:
        total = args.bc_weight * loss_pi
    else:
        total = loss_q + loss_v + args.cql_alpha * loss_cql + args.bc_weight * loss_pi
    total = total + args.belief_coef * loss_belief
    return {
        "loss": total,
        "q": loss_q,
        "v": loss_v,
        "cql": loss_cql,
        "bc": loss_bc,
        "lm": loss_lm,
        "belief": loss_belief,
        "q_data_mean": target_q.sum() / n,
        "v_mean": out["v"][:, :-1][acted].detach().sum() / n,
    }


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def load_dialogues(args) -> list[dict]:
    """The offline dialogues: `--dataset-path`'s JSONL (written by `G.write_dataset`; `parse_args` checked it) or
    `G.make_dataset(--dataset-size, --dataset-seed)`. A logged dialogue without a return gets its rewards' sum."""
    if args.dataset_path is None:
        return G.make_dataset(args.dataset_size, seed=args.dataset_seed)
    dialogues = G.read_dataset(args.dataset_path)
    for d in dialogues:
        d["return"] = float(d.get("return", sum(t["reward"] for t in d["turns"])))
    return dialogues


def length_grouped_batches(lengths: torch.Tensor, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """One epoch of minibatch indices: shuffle, cut into blocks of LENGTH_BLOCK minibatches, sort each block by
    length, cut it into minibatches, shuffle the minibatch order. Every dialogue appears once per epoch."""
    perm = torch.randperm(len(lengths), generator=generator)
    batches = []
    for start in range(0, len(perm), batch_size * LENGTH_BLOCK):
        block = perm[start : start + batch_size * LENGTH_BLOCK]
        batches += list(block[torch.argsort(lengths[block], stable=True)].split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator)]


class MinibatchSampler:
    """The dialogue indices of each (global) minibatch: the length-grouped epochs of `length_grouped_batches`
    (`--group-by-length`), or uniform draws. Under torchrun every rank draws the same indices from this seeded
    generator (their global torch RNGs differ: dropout); one process draws uniform indices from the global RNG."""

    def __init__(self, lengths: torch.Tensor, batch_size: int, group_by_length: bool, seed: int, world_size: int = 1):
        self.lengths, self.batch_size, self.group_by_length = lengths, min(batch_size, len(lengths)), group_by_length
        self.world_size, self.generator, self.queue = world_size, torch.Generator().manual_seed(seed), []

    def state_dict(self) -> dict:
        """The generator and the rest of the epoch's minibatches (what a checkpoint keeps)."""
        return {
            "generator": self.generator.get_state(),
            "queue": torch.cat(self.queue) if self.queue else torch.zeros(0, dtype=torch.long),
            "queue_sizes": torch.tensor([len(q) for q in self.queue], dtype=torch.long),
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        sizes = state["queue_sizes"].tolist()
        self.queue = list(state["queue"].split(sizes)) if sizes else []

    def draw(self) -> torch.Tensor:
        if self.group_by_length:  # losses stay means over each minibatch's own action tokens
            self.queue = self.queue or length_grouped_batches(self.lengths, self.batch_size, self.generator)
            return self.queue.pop()
        if self.world_size > 1:  # the same global minibatch on every rank
            return torch.randint(0, len(self.lengths), (self.batch_size,), generator=self.generator)
        return torch.randint(0, len(self.lengths), (self.batch_size,))


def make_minibatch(data: dict, idx: torch.Tensor, shard: torch.Tensor, device) -> dict:
    """The minibatch of dialogues `shard` (the one place a batch is formed), trimmed to its longest dialogue:
    input_ids / attention_mask / q_at (B, L); action_mask / rewards / dones / next_idx / lm_mask (B, L-1); secret (B,);
    and the token counts of the whole minibatch `idx` (n_actions, n_lm, n_real), the denominators of the loss means
    (`ilql_losses`). In one process `shard` is `idx`; under torchrun it is this rank's part of it, whose losses are
    then its share of the global means (their sum over ranks is the one-process value)."""
    lengths = data["lengths"][idx]  # (B_global,)
    counts = {"n_actions": data["action_mask"][idx].sum(), "n_lm": (lengths - 1).sum(), "n_real": lengths.sum()}
    width = int(data["lengths"][shard].max())
    batch = {
        k: data[k][shard, : width - (k != "input_ids")].to(device)
        for k in ("input_ids", "action_mask", "rewards", "dones", "next_idx")
    }
    attention_mask = (torch.arange(width)[None, :] < data["lengths"][shard][:, None]).long().to(device)
    batch["lm_mask"] = attention_mask[:, 1:].float()  # (B, L-1): the next token is real (not padding)
    batch["q_at"] = F.pad(batch["action_mask"], (0, 1))  # (B, L): where the Q heads run (the action positions)
    batch["attention_mask"], batch["secret"] = attention_mask, data["secret"][shard].to(device)  # (B, L), (B,)
    batch.update({k: v.float().to(device) for k, v in counts.items()})  # () each
    return batch


def timestep_stats(data: dict, tokenizer, lm) -> dict:
    """Lecture Problem 21.4, per token: the RL horizon is the number of agent tokens of a dialogue (the Bellman
    backup runs over each of them, jumping the answerer's tokens), the action space of one step is the vocabulary
    (one output of the Q head per token, the agent may write all but the banned special tokens)."""
    steps = data["action_mask"].sum(1).float()  # (N,) agent tokens per training dialogue
    writable = int((~banned_token_mask(tokenizer, n_logits(lm))).sum())
    return {
        "timestep/rl_steps_per_dialogue": float(steps.mean()),
        "timestep/rl_steps_per_dialogue_max": float(steps.max()),
        "timestep/tokens_per_dialogue": float(data["lengths"].float().mean()),
        "timestep/vocab_size": float(len(tokenizer)),
        "timestep/actions_per_step": float(writable),
        "timestep/action_space_log10": math.log10(writable),
    }


def valid_utterance_rate(dialogues: list[dict]) -> float:
    """Fraction of the agent's turns that the answerer understood (one of the 26 valid utterances)."""
    turns = [t for d in dialogues for t in d["turns"]]
    return sum(t["reply"] != G.NOT_UNDERSTOOD for t in turns) / max(len(turns), 1)


def filter_top(dialogues: list[dict], frac: float) -> list[dict]:
    """The top `frac` of dialogues by return (stable order among equal returns; at least one)."""
    if frac >= 1.0:
        return list(dialogues)
    order = sorted(range(len(dialogues)), key=lambda i: -dialogues[i]["return"])
    return [dialogues[i] for i in order[: max(1, int(round(frac * len(dialogues))))]]


def build_tensors(dialogues: list[dict], tokenizer) -> dict:
    """Pad every tokenized dialogue to the longest: input_ids (N, L), action_mask/rewards/dones/next_idx (N, L-1),
    lengths (N,)."""
    tokenized = G.tokenize_dialogues(dialogues, tokenizer)
    n, max_len = len(tokenized), max(len(t["input_ids"]) for t in tokenized)
    input_ids = np.full((n, max_len), tokenizer.pad_token_id, dtype=np.int64)
    action_mask = np.zeros((n, max_len - 1), dtype=bool)
    rewards = np.zeros((n, max_len - 1), dtype=np.float32)
    dones = np.zeros((n, max_len - 1), dtype=bool)
    next_idx = np.full((n, max_len - 1), -1, dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for k, t in enumerate(tokenized):
        length = len(t["input_ids"])
        am, nxt = next_state_indices(t["agent_mask"])
        input_ids[k, :length], lengths[k] = t["input_ids"], length
        action_mask[k, : length - 1], next_idx[k, : length - 1] = am, nxt
        rewards[k, : length - 1], dones[k, : length - 1] = t["rewards"][1:], t["dones"][1:]
    secret = np.array([int(d.get("secret_id", -1)) for d in dialogues], dtype=np.int64)  # (N,) -1 = not logged
    arrays = dict(input_ids=input_ids, action_mask=action_mask, rewards=rewards, dones=dones, next_idx=next_idx)
    arrays["secret"] = secret
    return {**{k: torch.from_numpy(v) for k, v in arrays.items()}, "lengths": torch.from_numpy(lengths)}


# ---------------------------------------------------------------------------------------------------------------
# Model: a causal LM backbone + ILQL heads
# ---------------------------------------------------------------------------------------------------------------
def mlp_head(d: int, out: int) -> nn.Sequential:
    """d -> 2d -> out, the head of Snell's PerTokenIQL and trlx's make_head."""
    return nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, out))


class ILQLHeads(nn.Module):
    """Q1, Q2 (|V| outputs each), their Polyak targets, V (a scalar), and the auxiliary belief head (logits over
    the 18 objects) on the backbone's last hidden state."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.q1, self.q2 = mlp_head(hidden_size, vocab_size), mlp_head(hidden_size, vocab_size)
        self.target_q1, self.target_q2 = mlp_head(hidden_size, vocab_size), mlp_head(hidden_size, vocab_size)
        self.target_q1.load_state_dict(self.q1.state_dict())
        self.target_q2.load_state_dict(self.q2.state_dict())
        self.target_q1.requires_grad_(False)
        self.target_q2.requires_grad_(False)
        self.v = mlp_head(hidden_size, 1)
        self.belief = nn.Linear(hidden_size, G.N_OBJECTS)  # training-only auxiliary (belief_loss)

    def forward(self, hidden: torch.Tensor, q_at: torch.Tensor | None = None) -> dict:  # hidden (B, L, d)
        """V and belief at every position; Q1, Q2 and the targets (B, L, V), or (N, V) at the N positions where
        the bool mask q_at (B, L) is set (training: the action positions, about a third of the tokens)."""
        hidden_q = hidden if q_at is None else hidden[q_at]
        with torch.no_grad():
            tq1, tq2 = self.target_q1(hidden_q), self.target_q2(hidden_q)
        return {
            "q1": self.q1(hidden_q),
            "q2": self.q2(hidden_q),
            "tq1": tq1,
            "tq2": tq2,
            "v": self.v(hidden)[..., 0],
            "belief": self.belief(hidden),
        }

    def sync_targets(self, tau: float) -> None:
        """θ̂ <- τ θ + (1 - τ) θ̂ (trlx `_sync_target_q_heads`)."""
        polyak_update(self.target_q1, self.q1, tau)
        polyak_update(self.target_q2, self.q2, tau)


def forward_all(
    lm, heads: ILQLHeads, input_ids, attention_mask, position_ids=None, cache=None, last_only=False, q_at=None
):
    """One backbone pass: LM logits and Q/V heads ((B, T, ...), or (B, 1, ...) at the last position only with
    `last_only`, as decoding needs; the Q heads (N, V) at q_at's positions when given, as training needs) and the KV
    cache (used only when decoding, i.e. when position_ids are given). The backbone (`lm.base_model`) returns the
    final-norm hidden state; the LM head and the ILQL heads read it."""
    decoding = position_ids is not None
    out = lm.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=decoding, cache=cache
    )
    hidden = out.last_hidden_state  # (B, T, d), after the final layer norm
    if last_only:
        hidden = hidden[:, -1:]  # (B, 1, d)
    return {"logits": lm.get_output_embeddings()(hidden), **heads(hidden, q_at), "cache": out.get("cache")}


def add_dialogue_tokens(tokenizer, lm) -> list[str]:
    """Give a checkpoint's tokenizer what the dialogue layout (`G.tokenize_dialogue`) needs, as its own special
    tokens: a turn separator and a pad token distinct from BOS/EOS (GPT-2, Llama and GPT-NeoX ship with neither:
    "<sep>" / "<pad>" are added and the embeddings resized, new rows at the mean of the pretrained ones, the
    transformers default), and a BOS (the EOS when there is none). Returns the tokens it added (none for the
    built-in tokenizer)."""
    if tokenizer.eos_token is None:
        raise SystemExit("error: the tokenizer has no EOS token; the dialogue layout ends every dialogue with one")
    if tokenizer.bos_token is None:
        tokenizer.bos_token = tokenizer.eos_token
    framing = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    added = {}
    if tokenizer.sep_token is None or tokenizer.sep_token_id in framing:
        added["sep_token"] = SEP_TOKEN
    if tokenizer.pad_token is None or tokenizer.pad_token_id in framing | {tokenizer.sep_token_id}:
        added["pad_token"] = PAD_TOKEN
    if added:
        tokenizer.add_special_tokens(added)
    if len(tokenizer) > lm.get_input_embeddings().weight.shape[0]:
        lm.resize_token_embeddings(len(tokenizer))
    lm.config.pad_token_id = tokenizer.pad_token_id
    return list(added.values())


def banned_token_mask(tokenizer, n_logits: int) -> torch.Tensor:
    """(n_logits,) bool, True for the tokens an agent utterance may never contain: every special token but the turn
    separator (pad, bos, eos, unk, ...: they are not text; the agent ends its turn with the separator) and the
    output rows beyond the tokenizer (checkpoints such as Pythia pad their embedding table; those ids decode to
    nothing)."""
    banned = torch.zeros(n_logits, dtype=torch.bool)
    banned[len(tokenizer) :] = True
    banned[[i for i in tokenizer.all_special_ids if i != tokenizer.sep_token_id and i < n_logits]] = True
    return banned


def utterance_budget(tokenizer) -> int:
    """Tokens one sampled utterance may take, its closing separator included: G.MAX_UTTERANCE_WORDS words (what the
    env shows of a malformed utterance) or the longest valid utterance in this tokenizer's tokens, whichever is
    longer, + the separator. 13 for the built-in word-level tokenizer (longest valid utterance: 7 words)."""
    longest = max(len(tokenizer(u, add_special_tokens=False)["input_ids"]) for u in G.all_utterances())
    return max(G.MAX_UTTERANCE_WORDS, longest) + 1


def n_logits(lm) -> int:
    """Rows of the LM head (the tokenizer's size, or more for checkpoints that pad their embedding table)."""
    return lm.get_output_embeddings().weight.shape[0]


def build_model(args, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

    if args.model_name_or_path is None:
        tokenizer = build_tokenizer()
        special = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        if args.arch == "gpt2":
            config = GPT2Config(
                vocab_size=len(tokenizer),
                n_positions=N_POSITIONS,
                n_embd=args.n_embd,
                n_layer=args.n_layer,
                n_head=args.n_head,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                **special,
            )  # no dropout: tiny data, short runs
        else:
            config = LlamaConfig(
                vocab_size=len(tokenizer),
                max_position_embeddings=N_POSITIONS,
                hidden_size=args.n_embd,
                intermediate_size=4 * args.n_embd,
                num_hidden_layers=args.n_layer,
                num_attention_heads=args.n_head,
                num_key_value_heads=args.n_head,
                tie_word_embeddings=True,
                **special,
            )
        lm = AutoModelForCausalLM.from_config(config)
    else:
        path = args.model_name_or_path
        try:  # the pretrained weights and their own tokenizer: fine-tuning starts from them
            tokenizer = AutoTokenizer.from_pretrained(path)
            lm = AutoModelForCausalLM.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(
                f"error: could not load --model-name-or-path '{path}' (a save_pretrained dir, or a hub id that is "
                f"in the local Hugging Face cache when offline): {str(e).strip().splitlines()[0]}"
            ) from None
        added = add_dialogue_tokens(tokenizer, lm)
        print(f"loaded {type(lm).__name__} from '{path}'; added special tokens {added}", flush=True)
    heads = ILQLHeads(lm.config.hidden_size, n_logits(lm))
    return lm.to(device), heads.to(device), tokenizer


# ---------------------------------------------------------------------------------------------------------------
# Decoding: all active dialogues in lockstep, KV cache, one forward per token
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_utterances(
    lm, heads, prompts, pad_id, sep_id, beta, top_k, greedy, generator, device, banned=None, max_new_tokens=12
):
    """Token ids (without the closing <sep>) of one agent utterance per prompt. prompts: lists of ids ending where
    the agent speaks next (`G.tokenize_prompt`). Prompts are left-padded; position ids come from the mask.
    banned: (V,) bool, tokens never written (`banned_token_mask`); max_new_tokens: budget incl. the <sep>."""
    b, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: the last position is everyone's current state
        input_ids[i, width - len(p) :], attention_mask[i, width - len(p) :] = torch.tensor(p), 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    cache, written = None, torch.zeros((b, 0), dtype=torch.long, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        out = forward_all(lm, heads, input_ids, attention_mask, position_ids, cache, last_only=True)
        scores = decoding_scores(out["logits"][:, -1], out["tq1"][:, -1], out["tq2"][:, -1], out["v"][:, -1], beta)
        if banned is not None:  # CRUCIAL: pad/bos/eos/unk are not text; the agent only ever writes words and <sep>
            scores = scores.masked_fill(banned, float("-inf"))
        scores = top_k_filter(scores, top_k)  # (B, V)
        if greedy:
            token = scores.argmax(-1)
        else:
            token = torch.multinomial(F.softmax(scores, -1).cpu(), 1, generator=generator)[:, 0].to(device)
        token = torch.where(finished, torch.full_like(token, pad_id), token)  # (B,)
        written = torch.cat([written, token[:, None]], dim=1)
        finished |= token == sep_id
        if bool(finished.all()):
            break
        cache, input_ids = out["cache"], token[:, None]
        attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
        position_ids = position_ids[:, -1:] + 1
    utterances = []
    for row in written.tolist():
        utterances.append(row[: row.index(sep_id)] if sep_id in row else [t for t in row if t != pad_id])
    return utterances


class ILQLAgent:
    """`act_batch(histories)` for `G.evaluate_policy`: one generation per turn for all active dialogues."""

    def __init__(self, lm, heads, tokenizer, beta, top_k, greedy, seed, device):
        self.lm, self.heads, self.tok, self.beta, self.top_k, self.greedy = lm, heads, tokenizer, beta, top_k, greedy
        self.generator, self.device, self.cache = torch.Generator().manual_seed(seed), device, {}
        self.banned = banned_token_mask(tokenizer, n_logits(lm)).to(device)
        self.max_new_tokens = utterance_budget(tokenizer)
        self.name = f"ilql_beta{beta:g}"

    def act_batch(self, histories):
        prompts = [G.tokenize_prompt(h, self.tok, self.cache) for h in histories]
        utterances = []
        for s in range(0, len(prompts), GEN_BATCH):
            ids = generate_utterances(
                self.lm,
                self.heads,
                prompts[s : s + GEN_BATCH],
                self.tok.pad_token_id,
                self.tok.sep_token_id,
                self.beta,
                self.top_k,
                self.greedy,
                self.generator,
                self.device,
                self.banned,
                self.max_new_tokens,
            )
            # the task reads words: decode without special tokens (the env normalises the text)
            utterances += [self.tok.decode(u, skip_special_tokens=True) if u else "" for u in ids]
        return utterances


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """What the training loop carries from step to step: all that a checkpoint holds for `--resume`."""

    lm: nn.Module  # backbone + LM head (π_BC)
    heads: nn.Module  # ILQLHeads: Q1, Q2, their Polyak targets, V, belief
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: MinibatchSampler
    loss_sums: dict = field(default_factory=dict)  # each loss summed over the steps since the last log
    first_losses: dict = field(default_factory=dict)  # the first logged means (model/first_*_loss)
    last_losses: dict = field(default_factory=dict)  # the last logged means (model/final_*_loss)
    n_tokens: int = 0  # action tokens trained on (stdout's action-tokens/s)


def interval_means(loss_sums: dict, step: int, log_every: int) -> dict:
    """Each loss's mean over the steps since the last log (logs fall every `log_every` steps and at the last)."""
    count = log_every if step % log_every == 0 else step % log_every
    return {k: v / count for k, v in loss_sums.items()}


def main():
    args = parse_args()  # one-line errors; --resume: the run's own arguments
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)

    # data (also the behavior-mixture baseline row); every rank builds the same data
    dialogues = load_dialogues(args)
    data_stats = G.dataset_stats(dialogues)
    train_dialogues = filter_top(dialogues, args.filter_top_frac)
    args.n_train_dialogues = len(train_dialogues)

    # model: backbone + LM head + ILQL heads (--eval-only: the trained model of --checkpoint)
    if args.eval_only:
        run = start_run(args)  # torchrun, the run dir, tensorboard
        lm, tokenizer = run.load_pretrained(args.checkpoint, "causal")
        heads = run.load_model(ILQLHeads(lm.config.hidden_size, n_logits(lm)).to(run.device))
    else:  # built before the run starts: a model that fails to load leaves no run dir
        lm, heads, tokenizer = build_model(args, torch.device("cpu"))
        run = start_run(args)  # torchrun, the run dir, tensorboard, Ctrl-C / SIGTERM
        lm, heads = lm.to(run.device), heads.to(run.device)
    # forward_all(lm, heads, ...); torchrun: through DDP (rank 0's weights on every rank, gradients summed over ranks)
    forward = run.data_parallel(forward_all, lm, heads)
    data = build_tensors(train_dialogues, tokenizer)
    problem = timestep_stats(data, tokenizer, lm)  # the problem this script faces (lecture Problem 21.4)

    # offline training: every minibatch is a random set of logged dialogues (torchrun: each rank takes its shard)
    params = [p for p in [*lm.parameters(), *heads.parameters()] if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    decay_start = (1.0 - args.decay_frac) * args.num_steps  # warmup, constant, then linear decay to 10%
    decay_steps, warmup = max(1.0, args.num_steps - decay_start), max(1, args.warmup_steps)
    schedule = lambda s: min((s + 1) / warmup, 1.0 - 0.9 * max(0.0, s - decay_start) / decay_steps)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    sampler = MinibatchSampler(data["lengths"], args.batch_size, args.group_by_length, args.seed, run.world_size)
    state = TrainState(lm, heads, optimizer, scheduler, sampler)
    steps_done = run.restore(state)  # 0; --resume: the checkpoint's step (its weights, optimizer, sampler, RNGs)
    last_step = 0 if args.eval_only else args.num_steps  # --eval-only: no training
    lm.train()
    for step in range(steps_done + 1, last_step + 1):
        # 1. a minibatch of logged dialogues (torchrun: this rank's shard, with the global minibatch's token counts)
        idx = sampler.draw()
        batch = make_minibatch(data, idx, run.shard(idx), run.device)
        # 2. one forward pass: LM logits and V at every position, Q1/Q2 and their targets at the actions; all losses
        out = forward(batch["input_ids"], batch["attention_mask"], q_at=batch["q_at"])
        losses = ilql_losses(out, batch, args)
        # 3. gradient step, then the Polyak update of the target Q heads
        optimizer.zero_grad(set_to_none=True)
        losses["loss"].backward()  # torchrun: DDP sums the ranks' gradients here, so every rank clips the same one
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        heads.sync_targets(args.tau)  # CRUCIAL: target heads trail the online Q heads (Polyak)
        # 4. log the means over --log-every steps (torchrun: losses summed over ranks, the global minibatch's values)
        step_losses = torch.tensor([float(v.detach()) for v in losses.values()], dtype=torch.float64)
        for k, v in zip(losses, run.global_sum(step_losses.to(run.device)).tolist(), strict=True):
            state.loss_sums[k] = state.loss_sums.get(k, 0.0) + v
        state.n_tokens += int(batch["n_actions"])
        if step % args.log_every == 0 or step == args.num_steps:
            means = interval_means(state.loss_sums, step, args.log_every)
            state.loss_sums, state.last_losses, state.first_losses = {}, means, state.first_losses or means
            elapsed = time.time() - run.start_time
            metrics = {f"losses/{k}": v for k, v in means.items()} | {"losses/grad_norm": float(grad_norm)}
            run.log(step, metrics | {"charts/learning_rate": scheduler.get_last_lr()[0], "charts/SPS": step / elapsed})
            if run.rank == 0:
                losses_text = " ".join(f"{k}={v:.4f}" for k, v in means.items())
                speed = f"SPS={step / elapsed:.1f} action-tokens/s={state.n_tokens / elapsed:.0f}"
                print(f"step {step}: {losses_text} {speed}", flush=True)
        run.end_step(step, state)  # a checkpoint every --save-every steps and at the last; Ctrl-C / SIGTERM: exit
    run.end_training()  # Ctrl-C and SIGTERM stop the run at once again

    # evaluation: β sweep on validation episodes (choose β) and on test episodes (report)
    lm.eval()  # torchrun: every rank holds the same weights (DDP's broadcast at the start, the same gradients since)
    metrics = reference_metrics(lm, heads, tokenizer, data_stats, args, run.device)
    results = sweep_betas(lm, heads, tokenizer, run.shard(list(args.betas)), args, run.device)
    results = {beta: res for part in run.gather(results) for beta, res in part.items()}  # torchrun: every rank's βs
    metrics.update(beta_metrics(results, args.betas))
    metrics.update(
        {f"model/final_{k}_loss": v for k, v in state.last_losses.items() if k in ("bc", "lm", "q", "v", "cql")}
    )
    metrics.update({f"model/first_{k}_loss": v for k, v in state.first_losses.items() if k in ("bc", "lm")})
    metrics.update(problem)
    charts = {"charts/episodic_return": metrics["eval/episodic_return"]}
    run.log(last_step, metrics | charts | {"charts/episodic_length": metrics["eval/episodic_length"]})
    run.finish(metrics, {"model": (lm, tokenizer), "model/ilql_heads": heads}, samples=last_step)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------
def reference_metrics(lm, heads, tokenizer, data_stats: dict, args, device) -> dict:
    """The rows a result is read against: the dataset's behavior mixture, the optimal questioner on the test
    episodes, and the learned value of the start state <bos> (the backup must carry rewards ~40 tokens back)."""
    metrics = {f"dataset/{k}": float(data_stats[k]) for k in ("mean_return", "success_rate", "mean_length")}
    metrics["dataset/normalized_score"] = G.normalized_score(data_stats["mean_return"])
    optimal = G.evaluate_policy(G.OptimalPolicy(), n_episodes=args.eval_episodes, seed=args.eval_seed)
    metrics["ref/optimal_episodic_return"] = optimal["mean_return"]
    metrics["ref/optimal_success_rate"] = optimal["success_rate"]
    metrics["ref/optimal_episodic_length"] = optimal["mean_length"]
    with torch.no_grad():
        start_ids = torch.tensor([[tokenizer.bos_token_id]], device=device)
        metrics["model/v_start"] = float(forward_all(lm, heads, start_ids, torch.ones_like(start_ids))["v"][0, -1])
    return metrics


def sweep_betas(lm, heads, tokenizer, betas, args, device) -> dict:
    """β -> (validation results, test results) for each β of `betas`. The episodes and decoding seeds do not depend
    on which β values one process runs, so splitting the sweep over torchrun ranks gives the one-process results."""
    results = {}
    for beta in betas:
        agent = ILQLAgent(lm, heads, tokenizer, beta, args.top_k, args.greedy, args.seed, device)
        val_res = G.evaluate_policy(agent, n_episodes=args.val_episodes, seed=args.val_seed)
        agent = ILQLAgent(lm, heads, tokenizer, beta, args.top_k, args.greedy, args.seed + 1, device)
        test_res = G.evaluate_policy(agent, n_episodes=args.eval_episodes, seed=args.eval_seed, return_dialogues=True)
        dialogues = test_res.pop("dialogues")
        test_res["valid_utterance_rate"] = valid_utterance_rate(dialogues)
        test_res["outcomes"] = G.failure_kinds(dialogues)  # where the points go
        results[beta] = (val_res, test_res)
        print(
            f"β={beta:g}: val return {val_res['mean_return']:.3f} | test return {test_res['mean_return']:.3f} "
            f"success {test_res['success_rate']:.3f} length {test_res['mean_length']:.2f}",
            flush=True,
        )
    return results


def beta_metrics(results: dict, betas) -> dict:
    """Every β's validation and test rows; the headline `eval/` is the test result of the β that is best on
    validation (ties -> the smaller β), `eval/bc_` the one of β = 0 (the BC head)."""
    val, test = {b: results[b][0] for b in betas}, {b: results[b][1] for b in betas}
    metrics = {}
    for beta in betas:
        for name, res in (("val_", val[beta]), ("", test[beta])):
            prefix = f"eval/{name}beta_{beta:g}/"
            metrics[prefix + "episodic_return"] = res["mean_return"]
            metrics[prefix + "success_rate"] = res["success_rate"]
            metrics[prefix + "episodic_length"] = res["mean_length"]
        metrics[f"eval/beta_{beta:g}/valid_utterance_rate"] = test[beta]["valid_utterance_rate"]
    best_beta = max(betas, key=lambda b: (val[b]["mean_return"], -b))  # ties -> the smaller β
    for key, res in (("eval/", test[best_beta]), ("eval/bc_", test.get(0.0))):
        if res is None:
            continue
        metrics.update(
            {
                key + "episodic_return": res["mean_return"],
                key + "episodic_return_std": res["return_std"],
                key + "success_rate": res["success_rate"],
                key + "episodic_length": res["mean_length"],
                key + "normalized_score": G.normalized_score(res["mean_return"]),
                key + "valid_utterance_rate": res["valid_utterance_rate"],
            }
            | {f"{key}outcome/{k}": v for k, v in res["outcomes"].items()}
        )
    metrics["eval/best_beta"] = float(best_beta)
    return metrics


# === RUN MANAGEMENT (not the algorithm: validation, run dir, torchrun (DDP), checkpoint, --resume, Ctrl-C, summary) ===
SCRIPT = Path(__file__).stem  # names this script in summary.json and in checkpoints (--resume checks it)
HEADS_FILE = "ilql_heads.safetensors"  # Q1, Q2, target Q1, target Q2, V heads, next to the save_pretrained model
SEED_STRIDE = 10_000  # torchrun: rank r reseeds its global torch RNG (dropout of real checkpoints) with seed + r * this
RESUME_FREE_FIELDS = ("resume", "save_every", "runs_dir", "cuda", "threads")  # the only arguments a resume may change
ARCH_FIELDS = ("model_name_or_path", "arch", "n_layer", "n_embd", "n_head")  # --eval-only: its checkpoint's model
DIST_TIMEOUT = timedelta(minutes=10)  # a rank waiting this long in a collective gives up (a failed rank never hangs)


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work (the --dataset-path file too); --resume takes the
    run's own arguments, --eval-only its checkpoint's ARCH_FIELDS; --bc-only sweeps β = 0 only."""
    args = tyro.cli(Args)
    for ok, message in [
        (args.threads >= 1, f"--threads must be at least 1, got {args.threads}"),
        (0.0 < args.filter_top_frac <= 1.0, f"--filter-top-frac must be in (0, 1], got {args.filter_top_frac}"),
        (0.0 <= args.decay_frac <= 1.0, f"--decay-frac must be in [0, 1], got {args.decay_frac}"),
        (args.seed >= 0, f"--seed must be >= 0, got {args.seed}"),
        (0.0 < args.expectile < 1.0, f"--expectile must be in (0, 1), got {args.expectile}"),
        (min(args.belief_coef, args.cql_alpha, args.bc_weight) >= 0, "--belief-coef/--cql-alpha/--bc-weight >= 0"),
        (0.0 <= args.gamma <= 1.0 and 0.0 < args.tau <= 1.0, "need 0 <= --gamma <= 1 and 0 < --tau <= 1"),
        (len(args.betas) > 0 and min(args.betas) >= 0, "--betas must be a non-empty list of values >= 0"),
        (min(args.eval_episodes, args.val_episodes, args.batch_size) >= 1, "--eval/val-episodes, --batch-size >= 1"),
        (min(args.num_steps, args.top_k, args.save_every) >= 0, "--num-steps/--top-k/--save-every must be >= 0"),
        (
            min(args.dataset_size, args.log_every, args.n_layer, args.n_embd, args.n_head) >= 1,
            "sizes must be >= 1: --dataset-size/--log-every/--n-layer/--n-embd/--n-head",
        ),
        (
            min(args.learning_rate, args.warmup_steps, args.weight_decay) >= 0 and args.max_grad_norm > 0,
            "need >= 0: --learning-rate/--warmup-steps/--weight-decay, and --max-grad-norm > 0",
        ),
        (args.arch in ("gpt2", "llama"), f"--arch must be gpt2 or llama, got {args.arch!r}"),
        (args.model_name_or_path or args.n_embd % max(args.n_head, 1) == 0, "--n-embd not divisible by --n-head"),
        (args.checkpoint or not args.eval_only, "--eval-only needs --checkpoint RUN_DIR"),
        (args.resume is None or not args.eval_only, "--resume continues a training run, not an --eval-only one"),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    if args.resume is not None:
        args = resume_args(args)[0]
    args.betas = (0.0,) if args.bc_only else args.betas  # the Q/V heads are untrained: only β = 0 (BC) is meaningful
    if args.eval_only and (checkpoint_model_dir(args.checkpoint).parent / "args.json").is_file():  # the run's model
        saved = json.loads((checkpoint_model_dir(args.checkpoint).parent / "args.json").read_text())
        args = replace(args, **{k: saved[k] for k in ARCH_FIELDS if k in saved})
    check_dataset(args)
    return args


def check_dataset(args) -> None:
    """A one-line error for a --dataset-path that is missing, not a GuessTheImage JSONL dataset, empty, or (with
    --belief-coef > 0, when training) without the logged secret of every dialogue."""
    if args.dataset_path is None:
        return
    path = Path(args.dataset_path)
    if not path.is_file():
        raise SystemExit(f"error: --dataset-path '{path}' does not exist (write one with G.write_dataset)")
    try:
        dialogues = G.read_dataset(path)
        for d in dialogues:
            for t in d["turns"]:
                str(t["agent"]), str(t["reply"]), float(t["reward"])  # noqa: B018  (fields must exist)
            if not d["turns"]:
                raise ValueError("a dialogue has no turns")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"error: --dataset-path '{path}' is not a GuessTheImage JSONL dataset ({e!r})") from None
    if not dialogues:
        raise SystemExit(f"error: --dataset-path '{path}' holds no dialogues")
    secrets = all(d.get("secret_id") in range(G.N_OBJECTS) for d in dialogues)
    if args.belief_coef > 0 and not args.eval_only and not secrets:
        raise SystemExit(
            f"error: --dataset-path '{path}': --belief-coef > 0 needs the logged secret_id (0..{G.N_OBJECTS - 1}) of "
            "every dialogue; pass --belief-coef 0 for logs without it"
        )


def shard_error(global_batch: int, n_data: int, world_size: int, group_by_length: bool) -> str | None:
    """Why the global minibatch cannot be split over `world_size` ranks (None if it can): it must divide evenly, and
    the ragged last minibatch of a `--group-by-length` epoch (n_data % global_batch dialogues) must fill every rank."""
    ragged = n_data % global_batch if group_by_length else 0
    if global_batch % world_size:
        return f"--batch-size {global_batch} is not divisible by the {world_size} processes"
    if 0 < ragged < world_size:
        return (
            f"the last minibatch of each epoch holds {ragged} dialogue(s) ({n_data} % {global_batch}), fewer than the "
            f"{world_size} processes; change --batch-size or the number of dialogues"
        )
    return None


def start_run(args: Args) -> "Run":
    return Run(args)  # torchrun, the run dir (new, or the resumed one), tensorboard, Ctrl-C / SIGTERM


class Run:
    """torchrun (rank, world_size, device, DDP and collectives; one process runs the plain code), the run dir and
    tensorboard (only rank 0 writes), train_state.safetensors and --resume, Ctrl-C / SIGTERM, summary.json."""

    def __init__(self, args: Args):
        self.args, self.start_time, self.cpu_start, self.train_times = args, time.time(), time.process_time(), None
        self.ddp = None  # torchrun: the DistributedDataParallel module of data_parallel
        self.rank, self.world_size, self.device = init_torchrun(args.cuda)
        n_data, training = args.n_train_dialogues, not args.eval_only and args.num_steps > 0
        error = shard_error(min(args.batch_size, n_data), n_data, self.world_size, args.group_by_length)
        if error and training:
            raise SystemExit(f"error: {error}")
        if self.world_size > 1:  # per-rank noise (dropout); DDP starts every rank from rank 0's weights
            torch.manual_seed(args.seed + SEED_STRIDE * self.rank)
        self.checkpoint = read_train_state(Path(args.resume)) if args.resume else None
        if self.checkpoint and len(self.checkpoint["rngs"]) != self.world_size:  # one RNG state per rank
            processes = f"{len(self.checkpoint['rngs'])} processes, not {self.world_size}"
            raise SystemExit(f"error: --resume {args.resume} ran on {processes}")
        self.run_dir, name = Path(args.resume or "."), f"{TASK_ID}__{args.exp_name}__{args.seed}__{int(time.time())}"
        for suffix in range(0 if args.resume or self.rank else 10**6):  # rank 0: a new run dir (mkdir is atomic)
            self.run_dir = Path(args.runs_dir) / (f"{name}-{suffix}" if suffix else name)
            try:
                self.run_dir.mkdir(parents=True)
                break
            except FileExistsError:  # runs started in the same second get -1, -2, ...
                continue
            except OSError as err:
                raise SystemExit(f"error: --runs-dir {args.runs_dir}: {err.strerror}") from None
        self.run_dir = self.gather(self.run_dir)[0]  # torchrun: rank 0's
        if self.rank == 0:  # a resume drops what the killed run logged after its checkpoint
            self.writer = SummaryWriter(str(self.run_dir), purge_step=self.checkpoint and self.checkpoint["step"] + 1)
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
            if not args.resume:
                self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.stop = install_stop_handlers() if training else {"signal": None, "previous": {}}

    def log(self, step: int, metrics: dict) -> None:
        """tensorboard (rank 0) at `step`: each tag -> value as a scalar (a str value as text)."""
        for tag, value in metrics.items() if self.rank == 0 else ():
            (self.writer.add_text if isinstance(value, str) else self.writer.add_scalar)(tag, value, step)

    def load_pretrained(self, path: str, kind: str):
        """(model, tokenizer) of --checkpoint's save_pretrained dir (its run dir's model/); kind: "causal" only."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            lm = AutoModelForCausalLM.from_pretrained(checkpoint_model_dir(path)).to(self.device)
            return lm, AutoTokenizer.from_pretrained(checkpoint_model_dir(path))
        except (OSError, ValueError, RuntimeError) as e:
            raise SystemExit(f"error: could not load checkpoint '{path}': {str(e).splitlines()[0]}") from None

    def load_model(self, module: nn.Module) -> nn.Module:
        """--eval-only: the ILQL heads of --checkpoint (HEADS_FILE next to its model) loaded into `module`."""
        path = checkpoint_model_dir(self.args.checkpoint) / HEADS_FILE
        try:
            module.load_state_dict(load_file(path, device=str(self.device)))
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise SystemExit(f"error: could not load checkpoint '{path}': {str(e).splitlines()[0]}") from None
        return module

    def data_parallel(self, forward, *modules: nn.Module):
        """`forward(*modules, ...)` as one call; under torchrun a DistributedDataParallel module: rank 0's weights on
        every rank, and backward() SUMS the ranks' gradients (DDP's default averages them; each shard's loss is its
        share of the global minibatch's mean); it finds parameters a step leaves unused (--bc-only, --belief-coef 0)."""
        if self.world_size == 1:
            return functools.partial(forward, *modules)
        holder = nn.ModuleList(modules)  # DDP's module: its forward is `forward` over `modules`
        holder.forward = functools.partial(forward, *modules)
        self.ddp = DistributedDataParallel(holder, find_unused_parameters=True)

        def sum_hook(_, bucket):  # DDP's default comm hook, but a sum
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])

        self.ddp.register_comm_hook(None, sum_hook)
        return lambda *inputs, **kwargs: self.ddp(*inputs, **kwargs)  # (end_training lets DDP go: it holds the group)

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x itself in one process)."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank ([obj] in one process)."""
        parts = [obj] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(parts, obj)
        return parts

    def shard(self, items):
        """This rank's contiguous share of `items` (all of them in one process; torch.tensor_split's rule)."""
        size, extra = divmod(len(items), self.world_size)
        return items[self.rank * size + min(self.rank, extra) : (self.rank + 1) * size + min(self.rank + 1, extra)]

    def restore(self, state: TrainState) -> int:
        """--resume: the checkpoint's TrainState (weights, optimizer, scheduler, sampler, loss sums) and this rank's
        RNGs loaded into `state`; returns the checkpoint's step (0 without --resume)."""
        saved = self.checkpoint
        if saved is None:
            return 0
        for f in fields(state):
            value = getattr(state, f.name)
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(saved[f.name])
            else:
                setattr(state, f.name, saved[f.name])
        set_rng_state(saved["rngs"][self.rank])
        self.start_time, self.cpu_start = self.start_time - saved["train_s"], self.cpu_start - saved["train_cpu_s"]
        return saved["step"]

    def end_step(self, step: int, state: TrainState) -> None:
        """The checkpoint every --save-every steps, at the last step and after a stop signal on any rank (every rank
        stops at the same step); after a stop, exit with STOP_EXIT_CODE naming the --resume command."""
        stop = bool(self.global_sum(torch.tensor([float(self.stop["signal"] is not None)], device=self.device)) > 0)
        if stop or (self.args.save_every and (step % self.args.save_every == 0 or step == self.args.num_steps)):
            rngs = self.gather(rng_state())  # each rank draws its own noise (dropout): every rank's RNGs
            if self.rank == 0:
                saved = {f.name: getattr(state, f.name) for f in fields(state)}
                saved = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in saved.items()}  # of objects
                times = {"train_s": time.time() - self.start_time, "train_cpu_s": time.process_time() - self.cpu_start}
                save_train_state(self.run_dir, saved | times | {"step": step, "args": asdict(self.args), "rngs": rngs})
                self.writer.flush()  # the scalars logged so far reach the disk with the checkpoint
            if self.world_size > 1:  # no rank goes on (or exits) before the checkpoint is complete
                dist.barrier()
        if stop:
            if self.rank == 0:
                why, launcher = self.stop["signal"] or "stopped on another rank", "python "
                launcher = f"torchrun --nproc_per_node {self.world_size} " if self.world_size > 1 else launcher
                resume = f"{launcher}{sys.argv[0]} --resume {self.run_dir}"
                print(
                    f"{why}: checkpoint saved at step {step} of {self.args.num_steps}; continue with: {resume}",
                    file=sys.stderr,
                )
                self.writer.close()
            self.end_training()  # (DDP let go before the process group ends)
            if self.world_size > 1:
                dist.destroy_process_group()
            raise SystemExit(STOP_EXIT_CODE)

    def end_training(self) -> None:
        """After the last step: Ctrl-C stops at once again; DDP lets go of the process group (every rank stays on)."""
        restore_signal_handlers(self.stop)
        self.train_times, self.ddp = (time.time() - self.start_time, time.process_time() - self.cpu_start), None

    def finish(self, metrics: dict, models: dict, samples: int) -> None:
        """Rank 0: `models` (name -> module: name.safetensors; a (model, tokenizer) pair: save_pretrained into name/),
        args.json, then summary.json (renamed into place: a finished run has it; `sps` = samples / training time), and
        deletes the checkpoint (a finished run is not resumed); then every rank tears down together."""
        wall, cpu = time.time() - self.start_time, time.process_time() - self.cpu_start
        train_time, train_cpu = self.train_times or (wall, cpu)
        if self.rank == 0:
            for name, obj in models.items():
                for part in obj if isinstance(obj, tuple) else ():
                    part.save_pretrained(self.run_dir / name)
                if isinstance(obj, nn.Module):
                    save_model(obj, str(self.run_dir / f"{name}.safetensors"))
            (self.run_dir / "args.json").write_text(json.dumps(asdict(self.args), indent=2))
            summary = {"script": SCRIPT, "run_name": self.run_dir.name, "run_dir": str(self.run_dir)}
            summary |= {"args": asdict(self.args), "metrics": metrics, "wall_time_s": wall, "train_time_s": train_time}
            sps = samples / train_time if samples else 0.0
            summary |= {"cpu_time_s": cpu, "train_cpu_time_s": train_cpu, "sps": sps}
            (self.run_dir / ".summary.json").write_text(json.dumps(summary, indent=2))  # renamed: never half written
            os.replace(self.run_dir / ".summary.json", self.run_dir / "summary.json")
            (self.run_dir / TRAIN_STATE).unlink(missing_ok=True)
            self.writer.close()
            m = metrics
            print(
                f"best β={m['eval/best_beta']:g} (on validation): test return {m['eval/episodic_return']:.3f} "
                f"(normalized {m['eval/normalized_score']:.1f}), BC {m.get('eval/bc_episodic_return', 0):.3f}, "
                f"dataset {m['dataset/mean_return']:.3f}, optimal {m['ref/optimal_episodic_return']:.3f}; "
                f"wall {wall:.0f}s -> {self.run_dir}"
            )
        if self.world_size > 1:  # every rank tears down together, after rank 0 has saved (each frees its gloo threads)
            dist.barrier()
            dist.destroy_process_group()


def checkpoint_model_dir(path: str) -> Path:
    """The save_pretrained dir of --checkpoint (a run dir of this script, or its model/ dir); one-line error else."""
    p = Path(path) / "model" if (Path(path) / "model").is_dir() else Path(path)
    if not (p / "config.json").is_file() or not (p / HEADS_FILE).is_file():
        raise SystemExit(f"error: --checkpoint '{path}' is not a run dir of this script (no config.json/{HEADS_FILE})")
    return p


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


def init_torchrun(cuda: bool) -> tuple[int, int, torch.device]:
    """torchrun sets WORLD_SIZE / RANK / LOCAL_RANK: join the process group (nccl with --cuda on GPUs, gloo on CPU).
    One process (no torchrun): rank 0 of 1 and no process group. Returns (rank, world_size, device)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and cuda
    if world_size == 1:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=DIST_TIMEOUT)
    return dist.get_rank(), world_size, torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")


if __name__ == "__main__":
    main()
