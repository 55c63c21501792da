"""RLHF with PPO and a KL penalty: the InstructGPT recipe end to end on the seqrl preference task.

Lecture part 2 casts RLHF as a one-step bandit: the prompt is the state s, the whole completion the action a, and
pi_theta(a|s) = prod_t p(x_t | x_<t). One batch of slow generations funds K epochs of importance-weighted (PPO-clipped)
updates. The reward is a learned Bradley-Terry model r_psi, an imperfect stand-in for the hidden human
(`envs.preference.gold_utility`, never seen by the policy). Optimizing hard against r_psi is offline model-based RL and
over-optimizes: with beta = 0 the proxy reward keeps rising while the gold reward peaks and falls (Gao et al. 2022).
Claim: a KL penalty toward the SFT policy keeps the gold reward high; best-of-n at the same KL is about as good. The
four steps of the recipe run inline: 1. SFT, 2. K SFT samples per prompt ranked by the noisy labeler, 3. a Bradley-Terry
reward model from the SFT transformer, 4. PPO with a per-token KL penalty toward the frozen SFT policy.

Key equations (per rollout of B prompts, completion tokens t = 1..T_i, EOS included):
  kl_t        = log pi_theta(x_t|x_<t) - log pi_SFT(x_t|x_<t)                 (k1; k3: (rho-1) - log rho, rho=pi_SFT/pi)
  r~_t        = -beta * kl_t  + [t = T_i] * score(s, a),   score = r_psi + c(s) - penalty * [no EOS]
  bandit:  A_t = R - mean_batch(R), R = sum_t r~_t;   gae: delta_t = r~_t + gamma V_{t+1} - V_t, A_t = GAE(gamma, lam)
  L_pg     = E_t max(-A_t rho_t, -A_t clip(rho_t, 1-eps, 1+eps)),  rho_t = pi_theta(x_t|.) / pi_bar(x_t|.)
  L_vf     = 0.5 E_t max((V - G)^2, (clip(V, V_old - eps_v, V_old + eps_v) - G)^2)
  adaptive beta (Ziegler et al.): beta <- beta (1 + clip(KL/KL_target - 1, -0.2, 0.2) * B / horizon)
  best-of-n from SFT: the best score(s, a) of n samples, KL_bon(n) = log n - (n-1)/n, n matched to PPO's KL

Implementation details:
  1. Logits are divided by the sampling temperature wherever a log-prob is computed and dropout is off, so the ratio
     is exactly 1 at the first minibatch of every update.
  2. Prompts are left-padded so completions start at one column; position ids come from the attention mask.
  3. Completions end at the first EOS (later tokens masked). Tokens that are not text (pad, bos, unk, sep, unused
     rows) get probability 0 in sampling and in every log-prob, so "<pad>" is no exploit route.
  4. The reward model scores `prompt + " " + text` (+ EOS if it ended) at the last non-pad token, as
     `rlhf_reward_model.py` does; a completion without EOS loses `--missing-eos-penalty`.
  5. Scores are normalized to mean 0, std 1 on SFT samples before PPO, so beta means the same for every reward model.
  6. Advantages are whitened over the batch's completion tokens; rewards optionally (`--whiten-rewards`).
  7. GAE mode: a zero-initialized value head on the policy's last hidden state (shared backbone), value clipping.
  8. Approximate KL, clip fraction and ratio are logged with TRL's metric names.
  9. Evaluation: one completion per held-out prompt with fixed noise: gold, proxy and KL(pi || pi_SFT), a curve point.
 10. torchrun: each rank generates its shard of the global batch; its loss is scaled by its share of the global
     minibatch's tokens (`token_share`), so the ranks' gradients, summed by DDP (`run.data_parallel`), are global.
 11. Checkpoints and `--resume` continue a run exactly (RUN_DIR/train_state.safetensors, STEPS 1-3 included).
 12. STEP 4 re-seeds: a run given another run's `sft_model/` and `reward_model/` (same seed) is that run from STEP 4 on.
Problem 21.3(c), --reward-offset: a constant c(s) per prompt keeps the optimum; the value head absorbs it once learned.

References:
  [1] Ouyang et al. 2022, InstructGPT. [2] Ziegler et al. 2019, Fine-Tuning Language Models from Human Preferences.
  [3] Stiennon et al. 2020, Learning to summarize from human feedback. [4] Gao et al. 2022, Scaling Laws for Reward
  Model Overoptimization. [5] huggingface/trl `ppo_trainer.py`; vwxyzjn/lm-human-preference-details; cleanrl `ppo.py`.
Details, measurements, usage (torchrun, --resume, real models): docs/rlhf_ppo_kl.md.
Reproduce: python algos/rlhf_ppo_kl.py --seed 1 --kl-coef 0.1
"""

import copy
import functools
import inspect
import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Literal

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
from safetensors.torch import safe_open, save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
import envs  # noqa: E402,F401  (registers the seqrl/ environments)
from envs import preference  # noqa: E402
from envs.tokenizer import build_tokenizer  # noqa: E402

EPS = 1e-8  # numerical floor for variances in whitening
BETA_STEP_CLIP = 0.2  # Ziegler et al.'s clip of the proportional adaptive-KL error
LOG_STD_FLOOR = 1e-6  # floor for the reward-normalization std
NORM_SAMPLES = 512  # SFT samples (cycling over the training prompts) that set the reward normalization
LATE_FRACTION = 0.2  # eval/late_gold_reward: the mean gold of the evaluations in the last 20% of the updates
# logit of a token that is not text (pad, bos, unk, ...): exp underflows to exactly 0 at any temperature <= 1e6, yet it
# is finite, so the log-prob of the padding after an EOS stays finite and masked losses never compute inf - inf
NOT_TEXT_LOGIT = -1e9
SEED_STRIDE = 1_000_003  # torchrun: rank r samples with seed + SEED_STRIDE * r (rank 0: the single-process seed)


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (data, models, sampling)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """use the GPU if `--cuda` and one is available"""
    threads: int = 1
    """torch CPU threads: 1 lets runs side by side share the cores; more can speed up one run of a real model alone"""
    runs_dir: str = "runs"
    """where run directories are created"""
    eval_episodes: int = 160
    """completions per evaluation, cycling over the held-out prompts"""
    eval_only: bool = False
    """only evaluate the run dir given by `--checkpoint` (its policy/, sft_model/, reward_model/)"""
    checkpoint: str | None = None
    """a run dir written by this script, for `--eval-only`"""
    save_every: int = 20
    """write the checkpoint RUN_DIR/train_state.safetensors every this many PPO updates (and when PPO starts), for
    `--resume`; 0 = only on Ctrl-C / SIGTERM. 20 = five per default run"""
    resume: str | None = None
    """continue the run in this run dir from its checkpoint (its args are used; flags that change the run are
    refused)"""

    # models
    model_name_or_path: str | None = None
    """base causal LM to fine-tune: a local `save_pretrained` dir or a hub id (weights and tokenizer are kept; a pad
    token is added if missing); None: a tiny GPT-2 built from a config over the seqrl tokenizer"""
    sft_model_path: str | None = None
    """a `save_pretrained` dir of an SFT policy: skips STEP 1"""
    reward_model_path: str | None = None
    """a `save_pretrained` dir of a reward model (e.g. from rlhf_reward_model.py): skips STEPS 2-3"""
    n_embd: int = 64
    """width of the tiny GPT-2 (policy and reward model built here)"""
    n_layer: int = 2
    """layers of the tiny GPT-2"""
    n_head: int = 4
    """attention heads of the tiny GPT-2"""
    n_positions: int = 64
    """context length of the tiny GPT-2 (prompt + completion fit easily)"""

    # STEP 1: supervised fine-tuning
    sft_examples: int = 4000
    """(prompt, completion) demonstrations from `make_sft_dataset`"""
    sft_epochs: int = 10
    """passes over the demonstrations"""
    sft_lr: float = 1e-3
    """Adam learning rate of SFT"""
    sft_batch_size: int = 64
    """SFT minibatch size"""

    # STEPS 2-3: preference data and reward model
    pref_prompts: int = 1024
    """training prompts for which K SFT completions are sampled and ranked by the labeler"""
    pref_k: int = 4
    """completions per prompt (ranked; all C(K,2) pairs are used)"""
    labeler_temperature: float = 0.3
    """the labeler's Bradley-Terry temperature on the gold utility (noise of the human)"""
    labeler_flip_prob: float = 0.0
    """probability the labeler flips a comparison at random"""
    rm_epochs: int = 6
    """passes of the reward model over the pairs"""
    rm_lr: float = 1e-3
    """Adam learning rate of the reward model"""
    rm_batch_size: int = 64
    """pairs per reward-model minibatch"""

    # STEP 4: PPO with a KL penalty
    num_updates: int = 100
    """PPO updates (each: one rollout batch, `update_epochs` epochs of minibatches)"""
    batch_size: int = 64
    """prompts (= completions) per rollout"""
    num_minibatches: int = 4
    """minibatches per epoch"""
    update_epochs: int = 4
    """K: epochs over each rollout batch (importance-weighted by pi_theta / pi_bar)"""
    learning_rate: float = 2e-4
    """Adam learning rate of PPO"""
    temperature: float = 1.0
    """sampling temperature (logits are divided by it for every log-prob)"""
    max_new_tokens: int | None = None
    """completion length limit in model tokens (a completion without EOS by then is cut off and penalized); None =
    the longest SFT demonstration in the model's tokens, EOS included (16 with the built-in word-level tokenizer)"""
    kl_coef: float = 0.1
    """beta: weight of the per-token KL penalty toward pi_SFT (initial value if adaptive)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimator: k1 = log pi - log pi_SFT, k3 = (rho - 1) - log rho with rho = pi_SFT / pi"""
    adaptive_kl: bool = False
    """adapt beta toward `target_kl` (Ziegler et al. 2019)"""
    target_kl: float = 3.0
    """target sequence KL (nats) of the adaptive controller"""
    kl_horizon: int = 2000
    """horizon (in samples) of the adaptive controller"""
    advantage: Literal["bandit", "gae"] = "gae"
    """bandit: one sequence-level advantage with a batch-mean baseline; gae: per-token GAE with a value head"""
    gamma: float = 1.0
    """discount over completion tokens (GAE)"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """PPO ratio clip epsilon"""
    cliprange_value: float = 0.2
    """value clip range (GAE)"""
    vf_coef: float = 0.1
    """value-loss weight (GAE)"""
    whiten_rewards: bool = False
    """whiten the per-token rewards over the batch before GAE"""
    missing_eos_penalty: float = 1.0
    """subtracted from the normalized score of a completion that never emits EOS"""
    reward_offset: float = 0.0
    """Problem 21.3(c): add a per-prompt constant c(s) ~ Uniform(-a, a) (fixed per run, seeded) to r_psi in the
    objective PPO and best-of-n optimize; 0 = off. Same optimum; the value head absorbs c(s) once it has learned it,
    and until then c(s) is noise in the advantages"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    eval_every: int = 5
    """evaluate (gold, proxy, KL; one `curve.jsonl` line) every this many updates"""
    bon_max_n: int = 64
    """largest n tried for best-of-n sampling at the final policy's KL"""

    # filled in at runtime
    minibatch_size: int = 0
    """batch_size // num_minibatches"""


# ---- Pure functions (unit-tested in tests/test_rlhf_ppo_kl.py) -------------------------------------------------------
def response_logprobs(logits: torch.Tensor, response_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(x_t | x_<t) of each completion token, with logits divided by the sampling temperature.

    logits: (B, T, V) predicting the completion tokens; response_ids: (B, T). Returns (B, T)."""
    logp = F.log_softmax(logits / temperature, dim=-1)  # (B, T, V)
    return torch.gather(logp, 2, response_ids.unsqueeze(-1)).squeeze(-1)  # (B, T)


def completion_mask(response_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of completion tokens up to and including the first EOS, and whether an EOS was emitted.

    response_ids: (B, T). Returns mask (B, T) bool, has_eos (B,) bool."""
    is_eos = response_ids == eos_id  # (B, T)
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before t
    return eos_before == 0, is_eos.any(dim=1)


def per_token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on samples from pi (Schulman's k1 / k3)."""
    logr = ref_logprobs - logprobs  # log rho, rho = pi_ref / pi
    return -logr if estimator == "k1" else torch.expm1(logr) - logr  # k3 >= 0, unbiased


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, beta: float, estimator: str = "k1"):
    """Per-token rewards r~_t = -beta kl_t on completion tokens, plus the sequence score at the last token.

    scores: (B,); logprobs, ref_logprobs: (B, T); mask: (B, T) bool (a prefix of each row).
    Returns rewards (B, T) (zero outside the mask) and kl (B, T) (zero outside the mask)."""
    kl = per_token_kl(logprobs, ref_logprobs, estimator) * mask  # (B, T)
    rewards = -beta * kl  # (B, T)
    last = mask.long().sum(dim=1) - 1  # (B,) index of the EOS / last completion token
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of x over the entries where mask is 1 (all entries if mask is None)."""
    return x.mean() if mask is None else (x * mask).sum() / mask.sum()


def masked_mean_var(x: torch.Tensor, mask: torch.Tensor, sum_over_ranks=lambda total: total):
    """Mean and unbiased variance of x over the masked entries; `sum_over_ranks` (run.global_sum): the global batch."""
    n = sum_over_ranks(mask.sum())
    mean = sum_over_ranks((x * mask).sum()) / n
    return mean, sum_over_ranks(((x - mean) ** 2 * mask).sum()) / (n - 1).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, mean_var=None) -> torch.Tensor:
    """(x - mean) / std over the masked entries (mean kept if not shift_mean, as TRL does for rewards). mean_var: the
    (mean, variance) to use, e.g. the global batch's under torchrun (`masked_mean_var`); None: x's own."""
    mean, var = masked_mean_var(x, mask) if mean_var is None else mean_var
    whitened = (x - mean) * torch.rsqrt(var + EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def gae(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over completion tokens. rewards, values, mask: (B, T); values past the end count as 0.

    Returns advantages (B, T) and returns = advantages + values (both zero outside the mask)."""
    values, T = values * mask, rewards.shape[1]
    lastgaelam = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask  # (B, T)
    return advantages, (advantages + values) * mask


def bandit_advantages(rewards: torch.Tensor, mask: torch.Tensor, baseline=None) -> torch.Tensor:
    """Sequence-level advantage R - mean_batch(R), R = sum_t r~_t, given to every completion token. baseline: the
    batch mean of R to use, e.g. the global batch's under torchrun; None: this batch's."""
    returns = rewards.sum(dim=1)  # (B,)
    return (returns - (returns.mean() if baseline is None else baseline)).unsqueeze(1) * mask  # (B, T)


def clipped_surrogate_loss(new_logprobs, old_logprobs, advantages, mask, cliprange: float) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate, a masked mean over completion tokens, and its diagnostics."""
    logratio = new_logprobs - old_logprobs
    ratio = torch.exp(logratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_losses2 > pg_losses).float(), mask).item(),
            "approxkl": 0.5 * masked_mean(logratio**2, mask).item(),
            "ratio": masked_mean(ratio, mask).item(),
        }
    return loss, stats


def clipped_value_loss(vpred, old_values, returns, mask, cliprange_value: float) -> tuple[torch.Tensor, float]:
    """0.5 max((V - G)^2, (clip(V, V_old +- eps) - G)^2), masked mean; also the value clip fraction."""
    vpredclipped = old_values + torch.clamp(vpred - old_values, -cliprange_value, cliprange_value)
    vf_losses1, vf_losses2 = (vpred - returns) ** 2, (vpredclipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    return loss, masked_mean((vf_losses2 > vf_losses1).float(), mask).item()


def ppo_minibatch_loss(
    policy, query_ids, response_ids, mask, old_logprobs, old_values, advantages, returns, args, pad_id, not_text
):
    """The loss of one (rank-local) minibatch: the clipped surrogate, plus vf_coef x the clipped value loss in GAE
    mode (both masked means over its completion tokens). Returns the loss and its diagnostics (floats)."""
    new_logits, vpred = policy(query_ids, response_ids, pad_id, not_text)
    new_logprobs = response_logprobs(new_logits, response_ids, args.temperature)
    pg_loss, stats = clipped_surrogate_loss(new_logprobs, old_logprobs, advantages, mask, args.cliprange)
    stats["pg_loss"], loss = pg_loss.item(), pg_loss
    if args.advantage == "gae":
        vf_loss, stats["vf_clipfrac"] = clipped_value_loss(vpred, old_values, returns, mask, args.cliprange_value)
        loss = loss + args.vf_coef * vf_loss
        stats["vf_loss"] = vf_loss.item()
    return loss, stats


def token_share(mb_mask: torch.Tensor, global_tokens: torch.Tensor) -> torch.Tensor:
    """This rank's completion tokens / the global minibatch's (details 10; 1 in one process): a rank's masked-mean loss
    times this has the gradient sum_shard / n_global, so the ranks' SUM (`run.data_parallel`) is the global one's."""
    return mb_mask.sum() / global_tokens


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """-log sigma(r_chosen - r_rejected), the negative log-likelihood of the preference."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def bon_kl(n: int) -> float:
    """KL(best-of-n || base) = log n - (n - 1) / n (Stiennon et al. 2020)."""
    return math.log(n) - (n - 1) / n


def matched_bon_n(kl: float, max_n: int) -> int:
    """The n in 1..max_n whose best-of-n KL, log n - (n-1)/n, is closest to `kl` (ties: the smaller n)."""
    kl, n = max(kl, 0.0), 1
    while n < max_n and bon_kl(n + 1) <= kl:
        n += 1
    if n < max_n and abs(bon_kl(n + 1) - kl) < abs(bon_kl(n) - kl):
        n += 1
    return n


def adaptive_kl_update(beta: float, kl: float, target: float, n_steps: int, horizon: int) -> float:
    """Ziegler et al.'s proportional controller on beta."""
    error = float(np.clip(kl / target - 1.0, -BETA_STEP_CLIP, BETA_STEP_CLIP))
    return beta * (1.0 + error * n_steps / horizon)


# ---- Models, generation, scoring -------------------------------------------------------------------------------------
class PolicyWithValue(nn.Module):
    """Any causal LM plus a scalar value head on its last hidden state (shared backbone)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        hidden = lm.config.get_text_config().hidden_size
        self.v_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    def forward(self, query_ids, response_ids, pad_id, not_text):
        """Logits predicting each completion token (B, T, V) and the value before each (B, T)."""
        logits, hidden = lm_forward(self.lm, query_ids, response_ids, pad_id, not_text, hidden=True)
        return logits, self.v_head(hidden).squeeze(-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1, clamped at 0: positions that ignore left padding."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def text_only(logits: torch.Tensor, not_text: torch.Tensor) -> torch.Tensor:
    """Logits with every non-text token (`not_text`, (V,) bool) at NOT_TEXT_LOGIT: probability exactly 0."""
    return logits.masked_fill(not_text, NOT_TEXT_LOGIT)


def lm_forward(lm, query_ids, response_ids, pad_id, not_text, hidden=False):
    """Run the LM on [left-padded query, completion]; return the outputs at the positions predicting the completion.

    query_ids: (B, Lq) left-padded; response_ids: (B, T) right-padded; not_text: (V,) bool (details 3).
    Returns logits (B, T, V) with non-text tokens at NOT_TEXT_LOGIT, the logits `generate` samples from (and hidden
    (B, T, H))."""
    input_ids = torch.cat([query_ids, response_ids], dim=1)  # (B, Lq + T)
    attention_mask = input_ids != pad_id  # pad is never sampled, so it marks exactly the padding
    out = lm(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        output_hidden_states=hidden,
        use_cache=False,
        position_ids=position_ids_from_mask(attention_mask),
    )
    Lq, T = query_ids.shape[1], response_ids.shape[1]
    logits = text_only(out.logits[:, Lq - 1 : Lq + T - 1], not_text)  # (B, T, V): position i predicts token i + 1
    if hidden:
        return logits, out.hidden_states[-1][:, Lq - 1 : Lq + T - 1]
    return logits


@torch.no_grad()
def generate(lm, query_ids, pad_id, eos_id, not_text, max_new_tokens, temperature, generator=None, return_logits=False):
    """Sample completions with a KV cache. query_ids: (B, Lq) left-padded. Returns (B, max_new_tokens) with
    padding after the first EOS (and, with `return_logits`, the logits each token was sampled from, (B, T, V))."""
    B = query_ids.shape[0]
    attention_mask = (query_ids != pad_id).long()  # (B, Lq)
    position_ids = position_ids_from_mask(attention_mask)
    # transformers >= 5.x names the KV cache `cache` (older: `past_key_values`)
    cache_kw = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
    out = lm(input_ids=query_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    past, next_logits = out[cache_kw], text_only(out.logits[:, -1], not_text)  # (B, V)
    last_pos = position_ids[:, -1:]  # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=query_ids.device)
    tokens, step_logits = [], []
    for _ in range(max_new_tokens):
        probs = torch.softmax(next_logits.float() / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        tokens.append(token)
        step_logits.append(next_logits)
        done = done | (token == eos_id)
        if done.all():
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        last_pos = last_pos + 1
        out = lm(
            input_ids=token[:, None],
            attention_mask=attention_mask,
            position_ids=last_pos,
            use_cache=True,
            **{cache_kw: past},
        )
        past, next_logits = out[cache_kw], text_only(out.logits[:, -1], not_text)
    response = torch.stack(tokens, dim=1)  # (B, <= max_new_tokens)
    response = F.pad(response, (0, max_new_tokens - response.shape[1]), value=pad_id)
    return (response, torch.stack(step_logits, dim=1)) if return_logits else response


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt's ids, BOS first when the tokenizer has one (GPT-2's is its <|endoftext|> document separator)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def completion_ids(tokenizer, prompt: str, completion: preference.Completion) -> list[int]:
    """A completion's ids as they follow its prompt, then the tokenizer's EOS id if it ended (details 3).

    The ids of `prompt + " " + text` after the prompt's own: a BPE tokenizer spells the first word with its leading
    space (" paris" is one GPT-2 token, "paris" two), as the model reads it after the prompt."""
    q = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full = tokenizer(f"{prompt} {completion.text}".rstrip(), add_special_tokens=False)["input_ids"]
    ids = full[len(q) :] if full[: len(q)] == q else tokenizer(completion.text, add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.eos_token_id] if completion.ended else [])


def encode_prompts(tokenizer, prompts, device):
    """Left-padded prompt ids (B, Lq) (`prompt_ids`)."""
    rows = [prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(r) for r in rows)
    ids = [[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows]
    return torch.tensor(ids, dtype=torch.long, device=device)


def decode_completions(tokenizer, response_ids, mask, has_eos) -> list[preference.Completion]:
    """What the task reads: the text of each completion (special tokens skipped) and whether it ended with EOS."""
    return [
        preference.Completion(tokenizer.decode(ids[: int(m.sum())].tolist(), skip_special_tokens=True).strip(), bool(e))
        for ids, m, e in zip(response_ids, mask, has_eos, strict=True)
    ]


def rm_encode(rm_tokenizer, prompts, completions, device) -> dict:
    """A reward model's input (as rlhf_reward_model.py `encode`): ids of `prompt + " " + text` in the tokenizer's own
    convention (Llama: <s> first), the tokenizer's EOS id if the completion ended, right-padded. (B, L) each."""
    texts = [f"{p} {c.text}".rstrip() for p, c in zip(prompts, completions, strict=True)]
    rows = rm_tokenizer(texts)["input_ids"]
    rows = [ids + [rm_tokenizer.eos_token_id] if c.ended else ids for ids, c in zip(rows, completions, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), rm_tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    attention_mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()  # (B, L)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


@torch.no_grad()
def rm_scores(rm, rm_tokenizer, prompts, completions, device, batch_size=256):
    """Raw scalar scores (B,) of a sequence-classification RM, read at the last non-pad token (right padding)."""
    scores = []
    for i in range(0, len(prompts), batch_size):
        enc = rm_encode(rm_tokenizer, prompts[i : i + batch_size], completions[i : i + batch_size], device)
        scores.append(rm(**enc).logits[:, 0].float())
    return torch.cat(scores)


def objective_scores(rm, rm_tokenizer, norm, offsets, prompts, completions, missing_eos_penalty, device):
    """score(s, a) = normalized r_psi + c(s) - penalty * [no EOS], what PPO and best-of-n both maximize. (B,)"""
    scores = (rm_scores(rm, rm_tokenizer, prompts, completions, device) - norm[0]) / norm[1]  # (B,)
    scores = scores + torch.tensor([offsets[p] for p in prompts], dtype=scores.dtype, device=device)
    ended = torch.tensor([c.ended for c in completions], device=device)
    return scores - missing_eos_penalty * (~ended).float()


def prompt_offsets(prompts, scale: float, seed: int) -> dict[str, float]:
    """Problem 21.3(c): an arbitrary constant c(s) ~ Uniform(-scale, scale) per prompt (0.0 for all if scale = 0)."""
    draws = np.random.default_rng(seed).uniform(-scale, scale, size=len(prompts)) if scale > 0 else [0.0] * len(prompts)
    return {p: float(c) for p, c in zip(prompts, draws, strict=True)}


def tiny_gpt2_config(vocab_size, args, tokenizer):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # no dropout: ratio = 1 at start
        activation_function="gelu_pytorch_tanh",  # GPT-2's tanh GELU as one torch kernel (gelu_new: 13% of a run)
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def not_text_mask(tokenizer, vocab_size: int, device) -> torch.Tensor:
    """(V,) bool: the ids a completion may never contain: special tokens other than EOS (pad, bos, unk, sep, ...)
    and embedding rows beyond the tokenizer's vocabulary (checkpoints often pad the table to a multiple of 64)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[[i for i in tokenizer.all_special_ids if i != tokenizer.eos_token_id]] = True
    mask[len(tokenizer) :] = True
    return mask


def disable_dropout(model):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


# ---- STEPS 1-3 of the recipe (short, inline) -------------------------------------------------------------------------
def supervised_fine_tune(lm, tokenizer, args, device, log):
    """STEP 1: next-token cross-entropy on the completion tokens of demonstrations (prompt tokens masked)."""
    data = preference.make_sft_dataset(args.sft_examples, seed=args.seed)
    pad = tokenizer.pad_token_id
    rows = []
    for prompt, completion in data:
        q, c = prompt_ids(tokenizer, prompt), completion_ids(tokenizer, prompt, completion)
        rows.append((q + c, [0] * len(q) + [1] * len(c)))
    optimizer = torch.optim.Adam(lm.parameters(), lr=args.sft_lr)
    for epoch in range(args.sft_epochs):
        perm = np.random.permutation(len(rows))
        for start in range(0, len(rows), args.sft_batch_size):
            batch = [rows[i] for i in perm[start : start + args.sft_batch_size]]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in batch], device=device)  # (B, L)
            target_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], device=device)  # (B, L)
            attention_mask = (ids != pad).long()
            logits = lm(
                input_ids=ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
            ).logits  # (B, L, V)
            nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (B, L - 1)
            loss = masked_mean(nll, target_mask[:, 1:].float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        log(epoch, {"losses/sft_nll": loss.item()})
        print(f"[sft] epoch {epoch} nll {loss.item():.3f}")


def longest_demonstration(tokenizer, args) -> int:
    """Default `--max-new-tokens`: the longest SFT demonstration's completion in the model's tokens, EOS included."""
    data = preference.make_sft_dataset(args.sft_examples, seed=args.seed)
    return max(len(completion_ids(tokenizer, prompt, completion)) for prompt, completion in data)


def sample_completions(lm, tokenizer, not_text, prompts, args, device, generator=None, batch_size=256):
    """One sampled completion per prompt, decoded into what the task reads (`decode_completions`)."""
    completions = []
    for i in range(0, len(prompts), batch_size):
        q = encode_prompts(tokenizer, prompts[i : i + batch_size], device)
        pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        r = generate(lm, q, pad_id, eos_id, not_text, args.max_new_tokens, args.temperature, generator)
        mask, has_eos = completion_mask(r, tokenizer.eos_token_id)
        completions += decode_completions(tokenizer, r, mask, has_eos)
    return completions


def fit_reward_model(sft_lm, tokenizer, not_text, train_prompts, args, device, log, fit=True):
    """STEPS 2-3: sample K completions per prompt from pi_SFT, let the labeler rank them, fit Bradley-Terry (if fit)."""
    from transformers import AutoModelForSequenceClassification

    # STEP 2: K samples per prompt from the SFT policy, ranked by the (noisy) labeler (Plackett-Luce)
    rng = np.random.default_rng(args.seed)
    prompts = [train_prompts[i] for i in rng.integers(0, len(train_prompts), size=args.pref_prompts * fit)]
    repeated = [p for p in prompts for _ in range(args.pref_k)]
    completions = sample_completions(sft_lm, tokenizer, not_text, repeated, args, device)
    groups = [completions[j * args.pref_k : (j + 1) * args.pref_k] for j in range(len(prompts))]
    labeler = preference.Labeler(temperature=args.labeler_temperature, flip_prob=args.labeler_flip_prob, seed=args.seed)
    rankings = labeler.rank_batch(prompts, groups) if fit else []  # (pref_prompts, K) indices, best first
    chosen, rejected, pair_prompts = [], [], []
    for prompt, group, ranking in zip(prompts, groups, rankings, strict=True):
        for a in range(args.pref_k):  # all C(K, 2) pairs of the ranking (InstructGPT)
            for b in range(a + 1, args.pref_k):
                pair_prompts.append(prompt)
                chosen.append(group[ranking[a]])
                rejected.append(group[ranking[b]])
    # STEP 3: Bradley-Terry reward model, scalar head at the last non-pad token
    # initialized from the SFT policy's transformer (InstructGPT, lm-human-preferences): it starts out knowing
    # what the policy knows (the facts), the scalar head is new; works for any architecture via `base_model`
    config = copy.deepcopy(sft_lm.config)
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    rm = AutoModelForSequenceClassification.from_config(config).to(device)
    rm.base_model.load_state_dict(sft_lm.base_model.state_dict())
    optimizer = torch.optim.Adam(rm.parameters(), lr=args.rm_lr)
    n = len(chosen)
    for epoch in range(args.rm_epochs * fit):
        perm, accs = np.random.permutation(n), []
        for start in range(0, n, args.rm_batch_size):
            idx = perm[start : start + args.rm_batch_size]
            pairs = [chosen[i] for i in idx] + [rejected[i] for i in idx]
            enc = rm_encode(tokenizer, [pair_prompts[i] for i in idx] * 2, pairs, device)
            r = rm(**enc).logits[:, 0]  # (2 B,): chosen, then rejected
            loss = bradley_terry_loss(r[: len(idx)], r[len(idx) :])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            accs.append((r[: len(idx)] > r[len(idx) :]).float().mean().item())
        log(epoch, {"losses/rm_loss": loss.item()})
        print(f"[rm] epoch {epoch} loss {loss.item():.3f} train acc {np.mean(accs):.3f} ({n} pairs)")
    return rm.eval()


# ---- STEP 4: PPO with a KL penalty -----------------------------------------------------------------------------------
@dataclass
class TrainState:
    """What PPO carries from one update to the next (a checkpoint saves every field; `run.restore` loads them)."""

    policy: nn.Module  # pi_theta and its value head (PolicyWithValue)
    optimizer: torch.optim.Optimizer
    sample_gen: torch.Generator | None  # torchrun: this rank's sampling noise (one process: the global RNG, None)
    prompt_rng: np.random.Generator  # draws the prompts of each rollout batch
    norm: tuple[float, float] | None  # (mean, std) of r_psi on SFT samples (details 5); None until restored
    beta: float  # the KL coefficient (changes every update with --adaptive-kl)
    setup: dict  # STEPS 1-3, name -> (model, tokenizer): saved once, with the first checkpoint (a resume loads them)
    sft_metrics: dict | None = None  # the evaluation of the SFT policy (update 0)
    metrics: dict | None = None  # the latest evaluation
    curve: list = field(default_factory=list)  # one point per evaluation, as in curve.jsonl


def seed_everything(seed: int) -> None:
    """python's, numpy's and torch's global RNGs from `seed` (at the start of a run, and where a phase restarts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    run = start_run(args)  # torchrun, device, the run dir (a resume: its own), tensorboard (details 10-11)
    device = run.device
    # sampling noise of rollouts and of the reward normalization: the global RNG in one process, one stream per rank
    sample_gen = torch.Generator(device).manual_seed(args.seed + SEED_STRIDE * run.rank) if run.world_size > 1 else None
    train_prompts, heldout_prompts = list(preference.train_prompts()), list(preference.heldout_prompts())
    eval_prompts = [heldout_prompts[i % len(heldout_prompts)] for i in range(args.eval_episodes)]

    # ---- STEP 1: the SFT policy (loaded, or fine-tuned here from a base model; a resume loads the run's own) ----
    if args.sft_model_path is not None or args.model_name_or_path is not None:  # the base: a hub id or a local dir
        sft_lm, tokenizer = run.load_pretrained(args.sft_model_path or args.model_name_or_path, "causal")
    else:
        from transformers import AutoModelForCausalLM

        tokenizer = build_tokenizer()
        sft_lm = AutoModelForCausalLM.from_config(tiny_gpt2_config(len(tokenizer), args, tokenizer))
    if args.sft_model_path is None and not run.resuming:  # a resume restores the run's own (run.restore)
        supervised_fine_tune(disable_dropout(sft_lm).to(device), tokenizer, args, device, run.log)
    sft_lm = disable_dropout(sft_lm).to(device).eval()
    run.broadcast_params(sft_lm)  # torchrun: every rank ran STEP 1 identically; rank 0's weights make sure of it
    sft_lm.requires_grad_(False)
    not_text = not_text_mask(tokenizer, sft_lm.get_output_embeddings().weight.shape[0], device)  # (V,) details 3
    if args.max_new_tokens is None:
        args.max_new_tokens = longest_demonstration(tokenizer, args)

    # ---- STEPS 2-3: the reward model (loaded, or fit here on SFT samples ranked by the labeler) ----
    rm_tokenizer = tokenizer  # a loaded reward model brings its own
    if args.reward_model_path is not None:
        rm, rm_tokenizer = run.load_pretrained(args.reward_model_path, "classifier")
    else:  # a resume: no data, no fit (fit=False); run.restore loads the run's reward model
        rm = fit_reward_model(sft_lm, tokenizer, not_text, train_prompts, args, device, run.log, fit=not run.resuming)
    rm = rm.to(device).eval()
    run.broadcast_params(rm)
    rm.requires_grad_(False)
    # STEP 4 starts from the seed again: loaded (--sft-model-path, --reward-model-path) or made here, the same SFT
    # policy and reward model give the same run (a KL sweep can share one pair, details 12)
    seed_everything(args.seed)
    norm = None  # a resume restores the run's own (run.restore)
    if not run.resuming:  # normalize r_psi to mean 0, std 1 on SFT samples of the training prompts (details 5)
        norm_prompts = run.shard([train_prompts[i % len(train_prompts)] for i in range(NORM_SAMPLES)])  # this rank's
        norm_completions = sample_completions(sft_lm, tokenizer, not_text, norm_prompts, args, device, sample_gen)
        raw = torch.cat(run.gather(rm_scores(rm, rm_tokenizer, norm_prompts, norm_completions, device)))  # all
        norm = (raw.mean().item(), max(raw.std().item(), LOG_STD_FLOOR))
    # Problem 21.3(c): an arbitrary constant per prompt in the objective (all 0 unless --reward-offset)
    offsets = prompt_offsets(train_prompts + heldout_prompts, args.reward_offset, args.seed + 40_000)

    # ---- STEP 4: PPO with a KL penalty ----
    policy = PolicyWithValue(copy.deepcopy(sft_lm)).to(device)
    if args.eval_only:
        policy.lm = disable_dropout(run.load_pretrained(str(Path(args.checkpoint) / "policy"), "causal")[0])
        policy = policy.to(device)
    policy.requires_grad_(True)
    minibatch_loss = run.data_parallel(ppo_minibatch_loss, policy)  # torchrun: through DDP (details 10)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-5)  # CleanRL's Adam eps
    setup = {"sft_model": (sft_lm, tokenizer), "reward_model": (rm, rm_tokenizer)}  # STEPS 1-3, saved once
    state = TrainState(policy, optimizer, sample_gen, np.random.default_rng(args.seed), norm, args.kl_coef, setup)
    frozen = (sft_lm, rm, rm_tokenizer, tokenizer, not_text)  # what an evaluation reads besides the policy
    updates_done = run.restore(state)  # a resume: the checkpoint's state, weights, Adam and RNG states
    if not run.resuming:  # the SFT policy's evaluation is update 0 of the curve; the first checkpoint holds STEPS 1-3
        state.sft_metrics = state.metrics = evaluate(0, policy, frozen, state, eval_prompts, args, run)
        run.end_step(0, state)
    num_updates = 0 if args.eval_only else args.num_updates
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    local_batch_size, local_minibatch_size = args.batch_size // run.world_size, args.minibatch_size // run.world_size
    start_time = run.start_time  # a resume counts the time before its checkpoint
    sum_over_ranks = run.global_sum  # torchrun: the batch statistics below are the global batch's (details 10)
    for update in range(updates_done + 1, num_updates + 1):
        # 1. generate: the batch's prompts (drawn alike on every rank; this rank's shard), completions from pi_theta
        prompts = run.shard([train_prompts[i] for i in state.prompt_rng.choice(len(train_prompts), args.batch_size)])
        query_ids = encode_prompts(tokenizer, prompts, device)  # (B, Lq), left-padded
        policy.eval()
        response_ids = generate(
            policy.lm, query_ids, pad_id, eos_id, not_text, args.max_new_tokens, args.temperature, sample_gen
        )  # (B, T)
        mask, has_eos = completion_mask(response_ids, eos_id)  # (B, T), (B,)
        maskf = mask.float()
        with torch.no_grad():
            # 2. score: normalized r_psi (at the EOS token) + c(s), minus the missing-EOS penalty
            completions = decode_completions(tokenizer, response_ids, mask, has_eos)
            scores = objective_scores(
                rm, rm_tokenizer, state.norm, offsets, prompts, completions, args.missing_eos_penalty, device
            )  # (B,)
            # 3. snapshot pi_bar: log-probs and values of the batch under the current policy; pi_SFT log-probs
            logits, values = policy(query_ids, response_ids, pad_id, not_text)  # (B, T, V), (B, T)
            old_logprobs = response_logprobs(logits, response_ids, args.temperature)  # (B, T)
            ref_logprobs = response_logprobs(
                lm_forward(sft_lm, query_ids, response_ids, pad_id, not_text), response_ids, args.temperature
            )  # (B, T)
            entropy = torch.special.entr(torch.softmax(logits / args.temperature, dim=-1)).sum(-1)  # (B, T)
            # 4. KL penalty folded into the reward: -beta kl_t per token, the score at the last token
            rewards, kl = kl_penalized_rewards(scores, old_logprobs, ref_logprobs, mask, state.beta, args.kl_estimator)
            if args.whiten_rewards:  # by the global batch's statistics (torchrun: summed over the ranks)
                rewards = masked_whiten(rewards, maskf, False, masked_mean_var(rewards, maskf, sum_over_ranks))
            # 5. advantages: sequence-level (bandit) or per-token GAE with the value head, whitened
            if args.advantage == "gae":
                advantages, returns = gae(rewards, values, maskf, args.gamma, args.lam)
            else:
                seq_rewards, n_seqs = rewards.sum(1), torch.tensor(float(len(rewards)), device=device)  # R: (B,)
                baseline = sum_over_ranks(seq_rewards.sum()) / sum_over_ranks(n_seqs)  # the global batch's mean R
                advantages, returns = bandit_advantages(rewards, maskf, baseline), torch.zeros_like(rewards)
            advantages = masked_whiten(advantages, maskf, mean_var=masked_mean_var(advantages, maskf, sum_over_ranks))
        rollout = (query_ids, response_ids, maskf, old_logprobs, values, advantages, returns)  # (B, ...) each
        # 6. K epochs of minibatch updates with the clipped importance ratio pi_theta / pi_bar
        policy.train()
        stats = {k: [] for k in ("approxkl", "clipfrac", "ratio", "pg_loss", "vf_loss", "vf_clipfrac")}
        for _epoch in range(args.update_epochs):
            perm = torch.randperm(local_batch_size, device=device)
            for start in range(0, local_batch_size, local_minibatch_size):
                mb = perm[start : start + local_minibatch_size]  # torchrun: the ranks' mb together = the global one
                mb_mask = maskf[mb]
                loss, mb_stats = minibatch_loss(*(x[mb] for x in rollout), args, pad_id, not_text)
                loss = loss * token_share(mb_mask, run.global_sum(mb_mask.sum()))  # x 1 in one process (details 10)
                optimizer.zero_grad()
                loss.backward()  # torchrun: DDP sums the ranks' gradients, the global minibatch's gradient
                nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                optimizer.step()
                for k, v in mb_stats.items():
                    stats[k].append(v)
        # 7. log the global batch's statistics (TRL's names; ranks' equal shards: their mean), then the adaptive KL
        log = {
            "objective/kl": kl.sum(1).mean().item(),
            "objective/kl_coef": state.beta,
            "objective/entropy": (entropy * maskf).sum(1).mean().item(),
            "objective/non_score_reward": (-state.beta * kl.sum(1)).mean().item(),
            "objective/scores": scores.mean().item(),
            "objective/rlhf_reward": (scores - state.beta * kl.sum(1)).mean().item(),
            "policy/approxkl_avg": float(np.mean(stats["approxkl"])),
            "policy/clipfrac_avg": float(np.mean(stats["clipfrac"])),
            "policy/entropy_avg": masked_mean(entropy, maskf).item(),
            "losses/policy_avg": float(np.mean(stats["pg_loss"])),
            "val/ratio": float(np.mean(stats["ratio"])),
            "val/ratio_var": float(np.var(stats["ratio"])),
            "val/num_eos_tokens": has_eos.float().sum().item(),
            "charts/episodic_length": mask.sum(1).float().mean().item(),
        }
        if args.advantage == "gae":
            log["losses/value_avg"] = float(np.mean(stats["vf_loss"]))
            log["val/clipfrac_avg"] = float(np.mean(stats["vf_clipfrac"]))
        sums = run.global_sum(torch.tensor([*log.values()], dtype=torch.float64, device=device)).tolist()
        log = {k: t if k == "val/num_eos_tokens" else t / run.world_size for k, t in zip(log, sums, strict=True)}
        log["charts/learning_rate"] = optimizer.param_groups[0]["lr"]
        log["charts/SPS"] = update * args.batch_size / (time.time() - start_time)
        run.log(update, log)
        if args.adaptive_kl:
            state.beta = adaptive_kl_update(
                state.beta, log["objective/kl"], args.target_kl, args.batch_size, args.kl_horizon
            )
        # 8. evaluate every --eval-every updates (details 9): gold, proxy and KL, a point of the curve
        if update % args.eval_every == 0 or update == num_updates:
            state.metrics = evaluate(update, policy, frozen, state, eval_prompts, args, run)
        elif update % max(1, args.eval_every // 2) == 0:
            print(
                f"update {update}: scores {log['objective/scores']:.3f} kl {log['objective/kl']:.2f} "
                f"beta {state.beta:.3f} clipfrac {log['policy/clipfrac_avg']:.3f} "
                f"approxkl {log['policy/approxkl_avg']:.4f}"
            )
        # 9. checkpoint every --save-every updates, and on Ctrl-C / SIGTERM (then exit with STOP_EXIT_CODE)
        run.end_step(update, state)

    # best-of-n from pi_SFT at the KL of the final policy (n capped at --bon-max-n), by the same objective
    bon_n = matched_bon_n(state.metrics["eval/kl"], args.bon_max_n)
    bon_seed = args.seed + 20_000 + SEED_STRIDE * run.rank  # this rank's sampling noise
    bon_models = (sft_lm, rm, rm_tokenizer, state.norm, offsets, tokenizer, not_text)  # what best-of-n reads
    bon_gold = best_of_n(*bon_models, run.shard(eval_prompts), bon_n, args, device, bon_seed, run.gather)
    run.end_training()  # after best-of-n (its samples are split over the ranks): under torchrun, rank 0 goes on alone
    print(f"[bon] n={bon_n} (KL {bon_kl(bon_n):.2f}) gold {bon_gold:.3f}")
    metrics, sft_metrics = state.metrics, state.sft_metrics
    summary_metrics = {
        "eval/episodic_return": metrics["eval/gold_reward"],
        **metrics,
        "eval/sft_gold_reward": sft_metrics["eval/gold_reward"],
        "eval/sft_proxy_reward": sft_metrics["eval/proxy_reward"],
        "eval/sft_eos_rate": sft_metrics["eval/eos_rate"],
        "eval/bon_gold_reward": bon_gold,
        "eval/bon_n": float(bon_n),
        "eval/bon_kl": bon_kl(bon_n),
        "eval/max_gold_reward": max(point["gold_reward"] for point in state.curve),
        "eval/late_gold_reward": float(
            np.mean([p["gold_reward"] for p in state.curve if p["step"] >= (1 - LATE_FRACTION) * num_updates])
        ),  # where the run ends, less noisy than its last evaluation alone
        "model/final_kl_coef": float(state.beta),
    }
    run.log(num_updates, {k: summary_metrics[k] for k in ("eval/bon_gold_reward", "eval/bon_n", "eval/bon_kl")})
    models = {"policy": (policy.lm, tokenizer), "value_head": policy.v_head, **state.setup}  # each with its tokenizer
    run.finish(summary_metrics, models, samples=num_updates * args.batch_size)


# ---- Evaluation ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def sequence_kl(policy_lm, sft_lm, tokenizer, not_text, prompts, completions_ids, mask, args, device):
    """Mean over samples of sum_t (log pi - log pi_SFT): KL(pi || pi_SFT) on the policy's own samples."""
    q, pad = encode_prompts(tokenizer, prompts, device), tokenizer.pad_token_id
    lp = response_logprobs(lm_forward(policy_lm, q, completions_ids, pad, not_text), completions_ids, args.temperature)
    ref = response_logprobs(lm_forward(sft_lm, q, completions_ids, pad, not_text), completions_ids, args.temperature)
    return ((lp - ref) * mask).sum(1)  # (B,)


@torch.no_grad()
def evaluate(update, policy, frozen, state, prompts, args, run) -> dict:
    """Gold reward, proxy reward (normalized r_psi) and KL(pi || pi_SFT) of one sample per prompt after `update`
    updates, fixed sampling noise (details 9; torchrun: each rank its share of the prompts, values gathered), to
    tensorboard, the curve (state.curve, curve.jsonl) and one printed line; returns the metrics."""
    sft_lm, rm, rm_tokenizer, tokenizer, not_text = frozen
    device, prompts = run.device, run.shard(prompts)
    generator = torch.Generator(device=device).manual_seed(args.seed + 10_000 + SEED_STRIDE * run.rank)
    policy.eval()
    q, pad_id, eos_id = encode_prompts(tokenizer, prompts, device), tokenizer.pad_token_id, tokenizer.eos_token_id
    r = generate(policy.lm, q, pad_id, eos_id, not_text, args.max_new_tokens, args.temperature, generator)
    mask, has_eos = completion_mask(r, tokenizer.eos_token_id)
    completions = decode_completions(tokenizer, r, mask, has_eos)
    proxy = (rm_scores(rm, rm_tokenizer, prompts, completions, device) - state.norm[0]) / state.norm[1]
    gold = preference.gold_utility_batch(prompts, completions)
    kl = sequence_kl(policy.lm, sft_lm, tokenizer, not_text, prompts, r, mask, args, device)
    policy.train()
    proxy, kl, has_eos, lengths = (torch.cat(run.gather(x)) for x in (proxy, kl, has_eos, mask.sum(1)))
    gold = np.concatenate(run.gather(gold))
    proxy_np = proxy.cpu().numpy()
    corr = float(np.corrcoef(proxy_np, gold)[0, 1]) if proxy_np.std() > 0 and gold.std() > 0 else 0.0
    metrics = {
        "eval/proxy_gold_corr": corr,
        "eval/gold_reward": float(np.mean(gold)),
        "eval/gold_reward_std": float(np.std(gold)),
        "eval/proxy_reward": float(proxy.mean()),
        "eval/kl": float(kl.mean()),
        "eval/eos_rate": float(has_eos.float().mean()),
        "eval/completion_length": float(lengths.float().mean()),
    }
    run.log(update, metrics)
    point = {"step": update, "kl": metrics["eval/kl"], "proxy_reward": metrics["eval/proxy_reward"]}
    point["gold_reward"] = metrics["eval/gold_reward"]  # one point of the curve
    state.curve.append(point)  # curve.jsonl (written by run.end_step)
    print(
        f"[eval] update {update}: gold {metrics['eval/gold_reward']:.3f} proxy {metrics['eval/proxy_reward']:.3f} "
        f"kl {metrics['eval/kl']:.2f} corr {metrics['eval/proxy_gold_corr']:.2f} "
        f"eos {metrics['eval/eos_rate']:.2f} | {prompts[0]} -> {completions[0]}"
    )
    return metrics


@torch.no_grad()
def best_of_n(
    sft_lm, rm, rm_tokenizer, norm, offsets, tokenizer, not_text, prompts, n, args, device, seed, gather=None
):
    """Best-of-n from pi_SFT: n samples per prompt, keep the one with the highest PPO objective score(s, a)
    (`objective_scores`: normalized r_psi + c(s) - the missing-EOS penalty); its mean gold reward. Under torchrun
    `prompts` and `seed` are this rank's and `gather` (run.gather) collects the ranks' gold rewards."""
    generator = torch.Generator(device=device).manual_seed(seed)
    repeated = [p for p in prompts for _ in range(n)]
    completions = sample_completions(sft_lm, tokenizer, not_text, repeated, args, device, generator)
    scores = objective_scores(
        rm, rm_tokenizer, norm, offsets, repeated, completions, args.missing_eos_penalty, device
    ).view(len(prompts), n)
    best = scores.argmax(1).cpu().numpy()
    gold = preference.gold_utility_batch(prompts, [completions[i * n + int(b)] for i, b in enumerate(best)])
    return float(np.mean(gold if gather is None else np.concatenate(gather(gold))))


# === RUN MANAGEMENT (not the algorithm: validation, run dir, torchrun, checkpoints and --resume, Ctrl-C, summary) ===
TASK_ID = "seqrl-preference"  # the task name in the run dir
DIST_TIMEOUT = timedelta(minutes=10)  # a rank waiting this long in a collective gives up (a failed rank never hangs)
SCRIPT = Path(__file__).stem  # names this script in summary.json and in the checkpoint (a resume checks it)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "gpt2", "EleutherAI/pythia-70m": a name from_pretrained fetches
RESUME_FREE_FIELDS = ("resume", "save_every", "cuda", "runs_dir", "minibatch_size", "threads")  # may differ on resume
AT_LEAST = [  # (least value, Args fields): each a one-line error naming the flag
    (0, "seed sft_epochs rm_epochs num_updates save_every kl_coef reward_offset sft_lr rm_lr learning_rate vf_coef"),
    (0, "missing_eos_penalty"),
    (1, "threads batch_size num_minibatches update_epochs eval_episodes eval_every bon_max_n kl_horizon sft_examples"),
    (1, "sft_batch_size pref_prompts rm_batch_size n_embd n_layer n_head n_positions"),
    (2, "pref_k"),
]
POSITIVE = "temperature labeler_temperature cliprange cliprange_value max_grad_norm target_kl".split()  # > 0


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work; the minibatch size; `--resume`: the run's own
    args; `--eval-only`: the SFT reference and reward model of its run dir."""
    args, world = tyro.cli(Args), int(os.environ.get("WORLD_SIZE", 1))  # WORLD_SIZE: set by torchrun (details 10)
    if args.resume is not None and not args.eval_only:  # the run's own args; the command line may only repeat them
        args, saved = resume_args(args)
        if len(saved["rng"]) != world:
            raise SystemExit(f"error: the run used {len(saved['rng'])} processes; resume it with as many")
    args.minibatch_size = args.batch_size // max(args.num_minibatches, 1)
    flag = {field: "--" + field.replace("_", "-") for field in asdict(args)}
    for ok, message in [
        *[(getattr(args, f) >= n, f"{flag[f]} must be >= {n}") for n, names in AT_LEAST for f in names.split()],
        *[(getattr(args, f) > 0, f"{flag[f]} must be > 0") for f in POSITIVE],
        *[(0 <= getattr(args, f) <= 1, f"{flag[f]} must be in [0, 1]") for f in ("labeler_flip_prob", "gamma", "lam")],
        (args.batch_size % max(args.num_minibatches, 1) == 0, "--batch-size not divisible by --num-minibatches"),
        (args.minibatch_size % world == 0, f"the minibatch {args.minibatch_size} must split over {world} ranks"),
        (args.n_embd % max(args.n_head, 1) == 0, "--n-embd must be divisible by --n-head"),
        (args.max_new_tokens is None or args.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (not args.reward_model_path or Path(args.reward_model_path).is_dir(), "--reward-model-path: no such directory"),
        (not args.sft_model_path or Path(args.sft_model_path).is_dir(), "--sft-model-path: no such directory"),
        (not (args.eval_only and args.resume), "--eval-only evaluates a saved run: there is nothing to --resume"),
        (
            not args.eval_only or (Path(args.checkpoint or "-") / "policy").is_dir(),
            "--eval-only needs --checkpoint RUN",
        ),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    if args.eval_only:  # a run dir of this script: its policy, SFT reference and reward model
        args.sft_model_path = args.sft_model_path or str(Path(args.checkpoint) / "sft_model")
        args.reward_model_path = args.reward_model_path or str(Path(args.checkpoint) / "reward_model")
    return args


def start_run(args: Args) -> "Run":
    return Run(args)  # torchrun, the device, the run dir (new, or --resume's), tensorboard, Ctrl-C / SIGTERM


class Run:
    """This process under torchrun (rank, world_size, device; DDP and collectives, details 10), the run dir with
    tensorboard and curve.jsonl (rank 0), the checkpoint a --resume continues (details 11), the stop flag."""

    def __init__(self, args: Args):
        self.args, self.start_time, self.stop = args, time.time(), {"signal": None, "previous": {}}
        self.rank, self.world_size, self.device = init_torchrun(args.cuda)
        self.ddp = None  # torchrun: the DistributedDataParallel module of data_parallel
        if self.rank > 0:
            sys.stdout = open(os.devnull, "w")  # rank 0 prints (errors still reach stderr)
        self.checkpoint = read_train_state(Path(args.resume)) if args.resume else None  # (parse_args: not --eval-only)
        self.resuming, self.run_dir = self.checkpoint is not None, Path(args.resume or ".")
        self.start_time -= self.checkpoint["elapsed_s"] if self.resuming else 0  # SPS and wall time of the whole run
        name = f"{TASK_ID}__{args.exp_name}__{args.seed}__{int(time.time())}"
        for suffix in range(0 if self.resuming or self.rank else 10**6):  # a new dir (mkdir is atomic): -1, -2, ...
            self.run_dir = Path(args.runs_dir) / (f"{name}-{suffix}" if suffix else name)
            try:
                self.run_dir.mkdir(parents=True)
                break
            except FileExistsError:  # taken by a run started in the same second
                continue
            except OSError as err:
                raise SystemExit(f"error: --runs-dir {args.runs_dir}: {err.strerror}") from None
        if self.world_size > 1:  # every rank learns rank 0's run dir
            dist.broadcast_object_list(shared := [self.run_dir], src=0)
            self.run_dir = shared[0]
        purge = self.checkpoint["update"] + 1 if self.resuming else None  # drop what was logged after the checkpoint
        self.writer = SummaryWriter(str(self.run_dir), purge_step=purge) if self.rank == 0 else None
        if self.rank == 0 and not self.resuming:  # the hyperparameter table
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        if not args.eval_only:  # Ctrl-C / SIGTERM: a checkpoint at the end of the update, then exit (end_step)
            self.stop = install_stop_handlers()

    def shard(self, items: list) -> list:
        """This rank's contiguous share of a global list (all of it in one process)."""
        n = len(items)
        return items[self.rank * n // self.world_size : (self.rank + 1) * n // self.world_size]

    def gather(self, obj) -> list:
        """Every rank's obj (tensors moved to the CPU), in rank order; [obj] in one process."""
        parts = [obj] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(parts, obj.cpu() if torch.is_tensor(obj) else obj)
        return parts

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x itself in one process)."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def broadcast_params(self, *modules: nn.Module) -> None:
        """Rank 0's weights on every rank, for the frozen models (the policy's DDP does this for it)."""
        for tensor in [t for m in modules for t in m.state_dict().values()] if self.world_size > 1 else []:
            dist.broadcast(tensor, src=0)

    def data_parallel(self, forward, *modules: nn.Module):
        """`forward(*modules, ...)` as one call; under torchrun a DistributedDataParallel module: rank 0's weights on
        every rank, and backward() SUMS the ranks' gradients (DDP's default averages them; each shard's loss is its
        share of the global minibatch's mean); it finds parameters a step leaves unused (bandit: the value head)."""
        if self.world_size == 1:
            return functools.partial(forward, *modules)
        holder = nn.ModuleList(modules)  # DDP's module: its forward is `forward` over `modules`
        holder.forward = functools.partial(forward, *modules)
        self.ddp = DDP(holder, find_unused_parameters=True)

        def sum_hook(_, bucket):  # DDP's default comm hook, but a sum
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])

        self.ddp.register_comm_hook(None, sum_hook)
        return lambda *inputs: self.ddp(*inputs)  # (end_training lets DDP go: it holds the process group)

    def log(self, step: int, metrics: dict) -> None:
        for tag, value in metrics.items() if self.rank == 0 else ():  # tensorboard: a str value as text
            (self.writer.add_text if isinstance(value, str) else self.writer.add_scalar)(tag, value, step)

    def load_pretrained(self, path: str, kind: Literal["causal", "classifier"]):
        """(model, tokenizer) of a `save_pretrained` dir or hub id with a pad token; one-line errors name the flag."""
        what = next((f"--{k.replace('_', '-')}" for k, v in asdict(self.args).items() if v == path), "checkpoint")
        return with_pad_token(*load_pretrained(path, kind, what), f"{what} '{path}'")

    def restore(self, state: TrainState) -> int:
        """--resume: the checkpoint's fields (weights and optimizer by state_dict, STEPS 1-3's models, the prompt
        sampler, this rank's RNGs) loaded into `state`; returns the updates it had done. Otherwise 0."""
        if not self.resuming:
            return 0
        rng = self.checkpoint["rng"][self.rank]  # this rank's
        for f in fields(state):
            value, saved = getattr(state, f.name), self.checkpoint.get(f.name)
            if isinstance(value, torch.Generator):
                value.set_state(rng[f.name])
            elif isinstance(value, np.random.Generator):
                value.bit_generator.state = saved
            elif f.name == "setup":  # name -> (model, tokenizer): the models of STEPS 1-3
                for name, (model, _) in value.items():
                    model.load_state_dict(saved[name])
            else:
                value.load_state_dict(saved) if hasattr(value, "load_state_dict") else setattr(state, f.name, saved)
        set_rng_state(rng["global"])
        print(f"resumed {self.run_dir} after update {self.checkpoint['update']}")
        return self.checkpoint["update"]

    def end_step(self, step: int, state: TrainState) -> None:
        """After update `step`: curve.jsonl; the checkpoint every --save-every updates (update 0: with STEPS 1-3) and on
        a stop signal to any rank, after which every rank exits with STOP_EXIT_CODE naming the --resume command."""
        if self.rank == 0:
            (self.run_dir / "curve.jsonl").write_text("".join(json.dumps(point) + "\n" for point in state.curve))
        stop = self.global_sum(torch.tensor([float(self.stop["signal"] is not None)], device=self.device)).item() > 0
        if self.args.eval_only or not stop and (self.args.save_every == 0 or step % self.args.save_every):
            return
        values = {f.name: getattr(state, f.name) for f in fields(state)}
        rng = {"global": rng_state()} | {k: v.get_state() for k, v in values.items() if isinstance(v, torch.Generator)}
        rngs = [rng] * self.world_size  # each rank draws from its own RNGs (sample_gen): rank 0 saves them all
        if self.world_size > 1:
            dist.all_gather_object(rngs, rng)
        if self.rank == 0:
            saved = {}
            for key, value in values.items():
                if isinstance(value, np.random.Generator):
                    saved[key] = value.bit_generator.state
                elif key == "setup":  # name -> (model, tokenizer): the models of STEPS 1-3
                    saved[key] = {name: model.state_dict() for name, (model, _) in value.items()}
                elif not isinstance(value, torch.Generator):  # (in rngs)
                    saved[key] = value.state_dict() if hasattr(value, "state_dict") else value
            extra = {"args": asdict(self.args), "update": step, "rng": rngs, "elapsed_s": time.time() - self.start_time}
            save_train_state(self.run_dir, saved | extra)
            self.writer.flush()  # the scalars logged so far reach the disk with the checkpoint
        if self.world_size > 1:
            dist.barrier()  # no rank goes on, or exits (torchrun would stop rank 0), before the checkpoint is complete
        if stop:
            launcher = "python" if self.world_size == 1 else f"torchrun --nproc_per_node {self.world_size}"
            if self.rank == 0:
                self.writer.close()
                print(f"interrupted; continue with: {launcher} {sys.argv[0]} --resume {self.run_dir}", file=sys.stderr)
            self.ddp = None  # DDP lets go of the process group
            if self.world_size > 1:
                dist.destroy_process_group()
            raise SystemExit(STOP_EXIT_CODE)

    def end_training(self) -> None:
        """After the last update: Ctrl-C and SIGTERM stop at once again; under torchrun rank 0 alone goes on."""
        restore_signal_handlers(self.stop)
        self.ddp = None  # DDP lets go of the process group
        if self.world_size > 1:
            dist.barrier()  # every rank tears down together (then each frees its gloo threads)
            dist.destroy_process_group()
            if self.rank != 0:
                raise SystemExit(0)

    def finish(self, metrics: dict, models: dict, samples: int) -> None:
        """`models` (save_models: loadable by --sft-model-path / --reward-model-path / --eval-only), args.json, then
        summary.json (renamed into place: a run dir with one holds a finished run); the checkpoint goes."""
        wall = time.time() - self.start_time
        self.writer.close()
        summary = {"script": SCRIPT, "run_name": self.run_dir.name, "run_dir": str(self.run_dir)}
        summary |= {"args": asdict(self.args), "metrics": metrics, "wall_time_s": wall, "sps": samples / wall}
        save_models(self.run_dir, models)
        (self.run_dir / "args.json").write_text(json.dumps(asdict(self.args), indent=2))
        write_json_atomic(self.run_dir / "summary.json", summary)
        (self.run_dir / TRAIN_STATE).unlink(missing_ok=True)
        print(json.dumps(metrics, indent=1))


def load_pretrained(path, kind, what):
    """from_pretrained (model and tokenizer) of a local dir or a hub id, with one-line errors naming `what` (the flag);
    offline, a hub id that is not cached is one too. docs/rlhf_ppo_kl.md: real models."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    local = Path(path).exists() or not HUB_ID.fullmatch(path)
    if local and not (Path(path) / "config.json").is_file():
        raise SystemExit(f"error: {what} '{path}' is not a save_pretrained directory (no config.json)")
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    try:
        return cls.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:  # offline and not cached, no such repo, no tokenizer, ...
        raise SystemExit(f"error: could not load {what} '{path}': {str(e).splitlines()[0]}") from None


def with_pad_token(model, tokenizer, what):
    """The tokenizer with a pad token distinct from EOS ("<pad>", embeddings resized; GPT-2 and Llama checkpoints ship
    without one), the model's config with its id. Returns (model, tokenizer)."""
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: the tokenizer of {what} has no EOS token to end an answer with")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temporary file, then rename it into place: a kill leaves the old file or none, never half."""
    tmp = path.with_name(f".tmp_{path.name}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def save_models(run_dir: Path, models: dict) -> None:
    """Each `name -> what` of `models`: a torch module to name.safetensors; a transformers model or tokenizer, or a
    tuple of them (a model and its tokenizer), `save_pretrained` into name/."""
    for name, what in models.items():
        for part in what if isinstance(what, tuple) else (what,):
            if hasattr(part, "save_pretrained"):
                part.save_pretrained(run_dir / name)
            else:
                save_file({k: v.contiguous() for k, v in part.state_dict().items()}, run_dir / f"{name}.safetensors")


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
