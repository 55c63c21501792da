"""RLHF reward model: learn r_psi(s, a) from pairwise / K-wise preferences (Bradley-Terry).

Lecture part 2: a human cannot reliably emit "Paris = +1, 'I don't know' = -0.1", but can compare two answers. Model
the comparison as p(a1 > a2 | s) = σ(r(s,a1) - r(s,a2)), the max-ent-IRL form, and fit r_psi by maximum likelihood.
The "human" is the hidden gold utility of `envs/preference.py` behind a Bradley-Terry labeler, so we can measure what
a reward model learns: held-out accuracy against the labeler's Bayes-optimal ceiling, rank correlation with the gold
utility, and the calibration of σ(Δr). Claim: a small reward model gets close to the ceiling and orders held-out
completions like the gold utility within a prompt.

Key equations:
  pairwise (Bradley-Terry NLL):   L = -log σ(r_c - r_r - m) + λ_c (r_c + r_r)^2      (m margin, λ_c centering)
  K-wise "pairs" (InstructGPT):   L = mean over the C(K,2) ordered pairs (i above j) of one ranking of the above
  K-wise "softmax" (Ziegler):     L = -log softmax(r_1..r_K)[best]                      (= pairwise when K = 2)
  normalization after training:   r <- (r - mean_SFT) / std_SFT, folded into the saved weights

Implementation details:
  0. The backbone is first fine-tuned on demonstrations (SFT, as InstructGPT does), then the scalar head is added:
     the SFT LM learns the fact table, so Bradley-Terry only has to read it out (from scratch it learns it poorly).
  1. The reward is read at the LAST NON-PAD token (`last_non_pad_index`; pad distinct from EOS), so a finished
     completion is scored at its EOS; position ids come from the attention mask, so left padding is correct too.
  2. The ids scored are the tokenizer's encoding of `prompt + " " + text`, plus its EOS if the completion ended
     (`encode`): `rlhf_ppo_kl.py` scores the same way, with any tokenizer.
  3. K-wise "pairs" keeps all C(K,2) pairs of a ranking in ONE batch element: K forward passes instead of K(K-1),
     and no epoch sees one completion in many minibatches (InstructGPT's fix for overfitting).
  4. Reward centering (`--center-coef`, Eisenstein et al.) pins the per-prompt offset Bradley-Terry leaves free.
  5. Accuracy and calibration are measured on the raw reward; then it is normalized on SFT demonstrations and the
     shift folded into a bias (`fold_normalization`), so a loader needs no extra code.
  6. No dropout by default: on tiny data and short runs it only slowed convergence.
  7. Three Spearman ρ with the gold utility: pooled, within-prompt, and prompt-centered (r minus the mean reward of
     SFT-like completions of the same prompt): Bradley-Terry fixes r only up to a constant per prompt.
  8. torchrun: each rank takes its share of every global minibatch, its loss weighted by that share, and the ranks'
     gradients are summed (`run.sync_grads`), so the sum is the global minibatch's gradient.
  9. Checkpoints (`--save-every`, Ctrl-C) and `--resume` continue a run exactly (all in RUN MANAGEMENT).
 10. `--learning-rate 1e-3`, not 3e-3: the larger rate makes the reward step forget the SFT fact table. LP-FT
     (`--head-only-fraction`: the head first, on the frozen backbone) is off by default (docs/tuning.md).

References:
  [1] Christiano et al. 2017, Deep RL from human preferences. [2] Ziegler et al. 2019, Fine-tuning LMs from human
  preferences (K-way softmax, reward normalization). [3] Ouyang et al. 2022, InstructGPT (all C(K,2) pairs per batch
  element). [4] Eisenstein et al. 2023, Helping or herding? (reward centering). [5] huggingface/trl `RewardTrainer`
  (margin, center_rewards_coefficient). [6] Kumar et al. 2022, Fine-tuning can distort pretrained features (LP-FT).
Details, measurements, usage (torchrun, --resume, real models): docs/rlhf_reward_model.md.
Reproduce: python algos/rlhf_reward_model.py --seed 1
"""

import copy
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
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
import tyro
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
import envs  # noqa: E402, F401  (registers the seqrl/ environments)
from envs import preference  # noqa: E402
from envs.tokenizer import build_tokenizer  # noqa: E402

LOG_EVERY = 20  # reward-model updates between logged training scalars
N_POSITIONS = 64  # tiny GPT-2 context: prompt (<= 9 tokens) + completion (<= 16 tokens) fits with room
CALIBRATION_BINS = 10  # equal-width bins of σ(Δr) for the calibration table / error
SCORE_BATCH = 512  # sequences per no-grad scoring forward pass
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "gpt2", "EleutherAI/pythia-70m": a name from_pretrained fetches
PROBES = (  # off-distribution completions of the lecture prompt: does the proxy reward repetition? (gold says no)
    preference.Completion("paris paris paris paris", ended=True),
    preference.Completion("paris , of course , paris , of course", ended=True),
    preference.Completion("paris", ended=False),  # the right answer, cut off: never ended
)


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (data, labels, initialization)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """use the GPU if available"""
    threads: int = 1
    """torch CPU threads: 1 lets runs side by side share the cores; more can speed up one run of a real model alone"""
    runs_dir: str = "runs"
    """where run directories are written"""
    eval_episodes: int = 2000
    """held-out comparisons (prompts with K ranked completions, from held-out prompts) to evaluate on: 2,000 give
    12,000 pairs, on which the sampled labels move the accuracy by ±0.35 points (1 SD; 500: ±0.7), so a 1-point gap
    to the noise-free `eval/bayes_accuracy` is about 3 SD"""
    eval_only: bool = False
    """only evaluate the reward model given by `--checkpoint` (a run dir or its reward_model/ dir)"""
    checkpoint: str | None = None
    """path of a saved run dir or `save_pretrained` reward-model dir to evaluate with `--eval-only`"""
    save_every: int = 250
    """write a training checkpoint into RUN_DIR/checkpoints/ every N gradient steps (SFT and reward-model updates
    counted together; the default run has ~1,130) and at the last update; 0 = only on Ctrl-C (details 9)"""
    resume: str | None = None
    """continue the run in this run dir from its latest checkpoint, with its saved args (details 9)"""

    # model
    model_name_or_path: str | None = None
    """a local `save_pretrained` dir or a hub id of a causal LM to start from (its weights and tokenizer; SFT
    fine-tunes it, the reward model gets its backbone); None = a tiny GPT-2 built from a config over the seqrl
    tokenizer's vocabulary"""
    n_layer: int = 2
    """tiny GPT-2: transformer blocks"""
    n_embd: int = 64
    """tiny GPT-2: width"""
    n_head: int = 4
    """tiny GPT-2: attention heads"""
    dropout: float = 0.0
    """tiny GPT-2: dropout of embeddings, attention and residual branches (the reward model inherits it)"""

    # 1. supervised fine-tuning of the backbone (InstructGPT initializes the reward model from the SFT model)
    sft_epochs: int = 12
    """epochs of causal-LM training on demonstrations before the preference training (0 = start from the
    (random or `--model-name-or-path`) backbone as is)"""
    sft_examples: int = 4000
    """(prompt, completion) demonstrations from `envs/preference.make_sft_dataset` (training prompts)"""
    sft_learning_rate: float = 3e-3
    """AdamW learning rate of the SFT step (linearly decayed to 0)"""
    sft_batch_size: int = 64
    """demonstrations per SFT minibatch"""

    # preference data (envs/preference.py)
    n_train_prompts: int = 3000
    """ranked comparisons to train on (each: K completions of one training prompt)"""
    k: int = 4
    """completions ranked per prompt (K); each ranking gives C(K,2) pairs"""
    temperature: float = 1.0
    """labeler's Bradley-Terry temperature T: p(a > b) = σ((u_a - u_b)/T)"""
    flip_prob: float = 0.0
    """labeler's probability of handing in a flipped label / reversed ranking"""
    n_norm_samples: int = 2000
    """SFT demonstrations the reward is normalized on (mean 0, std 1) after training"""
    n_center_samples: int = 256
    """SFT-like completions sampled per held-out prompt for the prompt-centered Spearman ρ (the per-prompt gauge)"""

    # loss and optimization
    loss: Literal["pairwise", "kwise"] = "kwise"
    """pairwise: every pair its own example; kwise: one ranking per batch element"""
    kwise_form: Literal["pairs", "softmax"] = "pairs"
    """kwise loss: all C(K,2) pairs of a ranking (InstructGPT) or K-way softmax over the best (lm-human-prefs)"""
    margin: float = 0.0
    """margin m in -log σ(r_c - r_r - m)"""
    center_coef: float = 0.0
    """reward-centering coefficient λ_c on (sum of an element's rewards)^2"""
    epochs: int = 8
    """passes over the preference data"""
    head_only_fraction: float = 0.0
    """the first fraction of the updates train only the new `score` head on the frozen SFT backbone, then everything
    (LP-FT [6]: fine-tuning under a random head can distort the SFT features); 0 = all from the start"""
    batch_size: int = 64
    """rankings per minibatch (kwise) or pairs per minibatch (pairwise)"""
    learning_rate: float = 1e-3
    """AdamW learning rate of the reward-model step (linearly decayed to 0); 3e-3 forgets the SFT fact table on
    some seeds (details 10)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    val_prompts: int = 0
    """extra ranked comparisons of training prompts (another labeler seed), never trained on: their loss and pair
    accuracy after every epoch (`val/loss`, `val/accuracy`: does the model overfit the labels' noise?); 0 = none"""


# ------------------------------------------------------------------------------------------------------------
# Losses and metrics (pure functions, imported by the tests)
# ------------------------------------------------------------------------------------------------------------
def pairwise_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0, center_coef: float = 0.0
) -> torch.Tensor:
    """Bradley-Terry NLL -log σ(r_c - r_r - margin) + center_coef (r_c + r_r)^2, mean over pairs. (B,), (B,) -> ()"""
    nll = -F.logsigmoid(r_chosen - r_rejected - margin)
    return (nll + center_coef * (r_chosen + r_rejected) ** 2).mean()


def kwise_loss(
    rewards_ranked: torch.Tensor, form: str = "pairs", margin: float = 0.0, center_coef: float = 0.0
) -> torch.Tensor:
    """K-wise loss of rewards already sorted best first, (B, K) -> ().

    "pairs": mean over the C(K,2) pairs (i above j) of the Bradley-Terry NLL, per element, then over elements;
    "softmax": -log softmax(r)[best] (the best of K against all others). Both equal the pairwise loss for K = 2.
    """
    k = rewards_ranked.shape[1]
    if form == "pairs":
        i, j = torch.triu_indices(k, k, offset=1)  # all i < j: i ranked above j
        diff = rewards_ranked[:, i] - rewards_ranked[:, j] - margin  # (B, C(K,2))
        nll = -F.logsigmoid(diff).mean(1)  # (B,)
    elif form == "softmax":
        nll = -torch.log_softmax(rewards_ranked, dim=1)[:, 0]  # (B,); margin is not defined for this form
    else:
        raise ValueError(f"unknown kwise form {form!r} (pairs | softmax)")
    return (nll + center_coef * rewards_ranked.sum(1) ** 2).mean()


def last_non_pad_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the rightmost real token of each row, for left or right padding. (B, L) -> (B,) int64."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)  # (L,)
    return (positions * attention_mask.long()).argmax(1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1, clamped at 0: positions that ignore left padding."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..N with ties given their average rank (as scipy.stats.rankdata)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's ρ = Pearson correlation of the (tie-averaged) ranks."""
    rx, ry = rankdata(np.asarray(x, np.float64)), rankdata(np.asarray(y, np.float64))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / np.sqrt((rx**2).sum() * (ry**2).sum()))


def calibration_table(p_model: np.ndarray, p_true: np.ndarray, n_bins: int = CALIBRATION_BINS):
    """Bin σ(Δr) into equal-width bins; per bin (lo, hi, count, mean predicted, mean true), and the expected
    calibration error Σ_b (n_b/N) |mean predicted_b - mean true_b|."""
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    bins = np.clip(np.digitize(p_model, edges[1:-1]), 0, n_bins - 1)
    rows, ece = [], 0.0
    for b in range(n_bins):
        sel = bins == b
        if sel.any():
            pred, true = p_model[sel].mean(), p_true[sel].mean()
            rows.append((edges[b], edges[b + 1], int(sel.sum()), float(pred), float(true)))
            ece += sel.mean() * abs(pred - true)
    return rows, float(ece)


# ------------------------------------------------------------------------------------------------------------
# Model helpers
# ------------------------------------------------------------------------------------------------------------
def rm_text(prompt: str, completion: preference.Completion) -> str:
    """The words a reward model reads: prompt, space, the completion's text (no markup; see `encode` for its end)."""
    return f"{prompt} {completion.text}".rstrip()


def encode(tokenizer, prompts, completions, padding_side: str = "right") -> dict:
    """Padded ids and attention mask (B, L) of `rm_text` in the tokenizer's own convention (Llama: <s> first), with
    the tokenizer's EOS id appended to every completion that ended (details 2)."""
    rows = tokenizer([rm_text(p, c) for p, c in zip(prompts, completions, strict=True)])["input_ids"]
    rows = [ids + [tokenizer.eos_token_id] if c.ended else ids for ids, c in zip(rows, completions, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
    for i, r in enumerate(rows):
        cols = slice(0, len(r)) if padding_side == "right" else slice(width - len(r), width)
        input_ids[i, cols], attention_mask[i, cols] = torch.tensor(r, dtype=torch.long), 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def reward_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar reward per sequence, read at the last non-pad token. (B, L) -> (B,)

    Runs the backbone and the `score` head explicitly so the pooled index is ours (`last_non_pad_index`); it
    equals `model(input_ids, attention_mask).logits[:, 0]` of the saved `AutoModelForSequenceClassification`.
    """
    hidden = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).last_hidden_state  # (B, L, H)
    pooled = hidden[torch.arange(len(hidden), device=hidden.device), last_non_pad_index(attention_mask)]  # (B, H)
    return model.score(pooled).squeeze(-1)  # (B,)


@torch.no_grad()
def score_texts(model, tokenizer, prompts, completions, device) -> np.ndarray:
    """Rewards of many (prompt, completion) pairs, in batches; float64 (N,)."""
    out = []
    for i in range(0, len(prompts), SCORE_BATCH):
        enc = encode(tokenizer, prompts[i : i + SCORE_BATCH], completions[i : i + SCORE_BATCH])
        out.append(reward_forward(model, enc["input_ids"].to(device), enc["attention_mask"].to(device)).cpu())
    return torch.cat(out).double().numpy() if out else np.zeros(0)


def fold_normalization(model, mean: float, std: float) -> str:
    """Make the model output (r - mean) / std: scale the head, put the shift into a bias (see details 5)."""
    head = model.score
    c = -mean / std  # the shift every (scaled) score needs
    with torch.no_grad():
        head.weight /= std
        if getattr(head, "bias", None) is not None:
            head.bias += c
            where = "score.bias"
        else:
            norm = next(
                (
                    getattr(model.base_model, n)
                    for n in ("ln_f", "norm", "final_layer_norm")
                    if hasattr(model.base_model, n)
                ),
                None,
            )
            if norm is not None and getattr(norm, "bias", None) is not None:
                w = head.weight[0]  # (H,) the head direction
                norm.bias += c * w / (w @ w)  # w·(h + δ) = w·h + c for every token
                where = "final-norm bias"
            else:
                model.config.seqrl_reward_offset = c  # no bias anywhere: a loader must add this
                where = "config.seqrl_reward_offset (add it to the model output)"
    model.config.seqrl_reward_mean, model.config.seqrl_reward_std = mean, std
    return where


def build_lm(args, device):
    """(causal LM, tokenizer): a tiny GPT-2 from a config over the seqrl tokenizer, or `--model-name-or-path` (a local
    `save_pretrained` dir or a hub id) with its pretrained weights and tokenizer, given a pad token if it has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

    if args.model_name_or_path is None:
        tokenizer = build_tokenizer()
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=N_POSITIONS,
            n_embd=args.n_embd,
            n_layer=args.n_layer,
            n_head=args.n_head,
            resid_pdrop=args.dropout,
            embd_pdrop=args.dropout,
            attn_pdrop=args.dropout,
            activation_function="gelu_pytorch_tanh",  # GPT-2's tanh GELU as one torch kernel, not gelu_new's 8 ops
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return AutoModelForCausalLM.from_config(config).to(device), tokenizer
    path = args.model_name_or_path
    if not Path(path).exists() and not HUB_ID.fullmatch(path):
        raise SystemExit(f"error: --model-name-or-path '{path}' does not exist (and is not a hub id)")
    try:
        lm = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:  # offline and not cached, no such repo, no tokenizer, ...
        raise SystemExit(f"error: could not load --model-name-or-path '{path}': {str(e).splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: the tokenizer of '{path}' has no EOS token to end an answer with")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})  # a pad distinct from EOS (details 1)
    if len(tokenizer) > lm.get_input_embeddings().num_embeddings:
        lm.resize_token_embeddings(len(tokenizer))
    lm.config.pad_token_id = tokenizer.pad_token_id
    return lm.to(device), tokenizer


def reward_model_from(lm, tokenizer, device):
    """`AutoModelForSequenceClassification` (num_labels=1) on the LM's config, its backbone loaded from the LM's
    (`base_model`: GPT-2 `transformer`, Llama `model`, GPT-NeoX `gpt_neox`); the scalar head `score` is new."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(lm.config)
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_config(config).to(device)
    model.base_model.load_state_dict(lm.base_model.state_dict())
    if not hasattr(model, "score"):
        raise SystemExit(f"error: {type(model).__name__} has no `score` head; use a decoder-only model")
    return model


def causal_lm_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_targets: float | None = None
) -> torch.Tensor:
    """Next-token cross-entropy, mean over the predicted real tokens. (B, L, V), (B, L), (B, L) -> ()
    `n_targets`: divide by this count instead (a rank's share of a global minibatch's token mean, details 8)."""
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, L-1)
    target = attention_mask[:, 1:].float()  # (B, L-1): predict every real token after the first
    return (nll * target).sum() / (target.sum().clamp(min=1.0) if n_targets is None else n_targets)


def sft_minibatch_loss(lm, ids: torch.Tensor, mask: torch.Tensor, n_targets: float | None = None) -> torch.Tensor:
    """Causal-LM loss of right-padded demonstrations (B, W): their token mean, or their NLL summed over tokens and
    divided by `n_targets` (a global minibatch's token count, of which these are a rank's share; details 8)."""
    logits = lm(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits  # (B, W, V)
    return causal_lm_loss(logits, ids, mask, n_targets)


def reward_minibatch_loss(model, ids: torch.Tensor, mask: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Preference loss (`--loss`) of a minibatch of groups (B, G, W), each group's completions best first (G = 2
    for pairwise: [chosen, rejected]), and its rewards (B, G)."""
    n, group, width = ids.shape
    rewards = reward_forward(model, ids.reshape(-1, width), mask.reshape(-1, width)).view(n, group)  # (B, G)
    if args.loss == "pairwise":
        return pairwise_loss(rewards[:, 0], rewards[:, 1], args.margin, args.center_coef), rewards
    return kwise_loss(rewards, args.kwise_form, args.margin, args.center_coef), rewards


@dataclass
class TrainState:
    """Where a training phase's loop stands: all a checkpoint holds (saved and loaded field by field). One phase at a
    time: "sft" (the causal LM on demonstrations, `fine_tune_backbone`), then "reward" (the preference loss)."""

    phase: Literal["sft", "reward"]
    model: nn.Module  # the causal LM (sft) or the reward model (reward)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    epoch: int = 0
    next_start: int = 0  # where in `perm` the next minibatch starts
    perm: torch.Tensor | None = None  # this epoch's order of the examples (None: draw one)
    sft_total: float = 0.0  # sft: this epoch's global minibatch NLLs, each times its size, summed
    sft_count: int = 0  # sft: the demonstrations in sft_total
    sft_nll: float | None = None  # reward: the last SFT epoch's NLL (None: no SFT), reported with the metrics
    global_step: int = 0  # reward: updates done
    n_seen: int = 0  # reward: sequences trained on (for SPS)
    loss: float = float("nan")  # reward: the last global minibatch's loss


def group_ids(tokenizer, data: list[dict], args) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranked comparisons as token ids and mask (N, G, L), each group best first: all C(K,2) pairs of every ranking
    as [chosen, rejected] groups (G = 2) for the pairwise loss, one ranking of K per group (G = K) for kwise."""
    if args.loss == "pairwise":  # every pair its own example: (prompt, chosen, rejected)
        p, c, r = preference.to_pairs(data)
        enc = encode(tokenizer, p + p, c + r)
        ids = enc["input_ids"].view(2, len(p), -1).transpose(0, 1)  # (P, 2, L): [chosen, rejected]
        mask = enc["attention_mask"].view(2, len(p), -1).transpose(0, 1)  # (P, 2, L)
        return ids, mask
    p = [d["prompt"] for d in data for _ in range(args.k)]  # one ranking per example, completions sorted best first
    c = [d["completions"][j] for d in data for j in d["ranking"]]
    enc = encode(tokenizer, p, c)
    return enc["input_ids"].view(len(data), args.k, -1), enc["attention_mask"].view(len(data), args.k, -1)  # (N, K, L)


@torch.no_grad()
def validation_metrics(model, ids: torch.Tensor, mask: torch.Tensor, args, device) -> dict:
    """val/loss (mean) and val/accuracy (over all pairs i above j of each group) of ranked groups (N, G, L)."""
    model.eval()
    total_loss, n_correct, n_pairs = 0.0, 0.0, 0
    for start in range(0, len(ids), SCORE_BATCH // ids.shape[1]):
        sl = slice(start, start + SCORE_BATCH // ids.shape[1])
        width = int(mask[sl].sum(-1).max())
        loss, rewards = reward_minibatch_loss(
            model, ids[sl, :, :width].to(device), mask[sl, :, :width].to(device), args
        )
        i, j = torch.triu_indices(ids.shape[1], ids.shape[1], offset=1)  # all i < j: i ranked above j
        total_loss += loss.item() * len(rewards)
        n_correct += ((rewards[:, i] > rewards[:, j]).sum() + 0.5 * (rewards[:, i] == rewards[:, j]).sum()).item()
        n_pairs += rewards[:, i].numel()
    model.train()
    return {"val/loss": total_loss / len(ids), "val/accuracy": n_correct / n_pairs}


def gradient_step(state: TrainState, loss: torch.Tensor, run, max_grad_norm: float) -> None:
    """One AdamW step of state.model (and its scheduler) on this rank's share of the loss: the gradients summed over
    ranks (`run.sync_grads`: the gradient of the global minibatch's loss, details 8), then clipped."""
    state.optimizer.zero_grad()
    loss.backward()
    run.sync_grads(state.model.parameters())
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), max_grad_norm)
    state.optimizer.step()
    state.scheduler.step()


# not rlhf_ppo_kl.py's `supervised_fine_tune`: this one also predicts the prompt (the reward model's input) and is
# sharded over ranks and checkpointed
def fine_tune_backbone(lm, tokenizer, args, run) -> float | None:
    """STEP 2: causal-LM training on demonstrations, in place; returns the last epoch's NLL (None: a resumed run that
    is past this phase).

    The input is the reward model's exact input format (`encode`: prompt + completion + EOS if it ended, right
    padded), so predicting "paris" after "what is the capital of france ?" teaches the backbone the fact table.
    `run`: this process's share under torchrun and the checkpoint it resumes (details 8-9); `Run(args)` in a test.
    """
    device = run.device
    demos = preference.make_sft_dataset(args.sft_examples, seed=args.seed + 30_000, split="train")
    enc = encode(tokenizer, [d[0] for d in demos], [d[1] for d in demos])
    ids, mask = enc["input_ids"], enc["attention_mask"]  # (N, L)
    steps_per_epoch = (len(ids) + args.sft_batch_size - 1) // args.sft_batch_size
    num_updates = args.sft_epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(lm.parameters(), lr=args.sft_learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / num_updates)
    state = TrainState("sft", lm, optimizer, scheduler)  # the start, or the --resume checkpoint's place
    if run.restore(state) > num_updates:  # a checkpoint of the reward phase: SFT is over
        return None
    lm.train()
    epoch_nll = float("nan")
    for epoch in range(state.epoch, args.sft_epochs):
        if epoch > state.epoch or state.perm is None:  # a new epoch: a new order, a new running NLL
            state.epoch, state.next_start, state.perm = epoch, 0, torch.randperm(len(ids))
            state.sft_total, state.sft_count = 0.0, 0
        for start in range(state.next_start, len(ids), args.sft_batch_size):
            mb = state.perm[start : start + args.sft_batch_size]  # the global minibatch (details 8)
            width = int(mask[mb].sum(-1).max())  # right padding: drop its all-pad columns
            n_targets = float(mask[mb, 1:width].sum().clamp(min=1))  # its predicted tokens: the loss is their mean
            part = run.shard(mb)  # this rank's share of it
            loss = sft_minibatch_loss(lm, ids[part, :width].to(device), mask[part, :width].to(device), n_targets)
            gradient_step(state, loss, run, args.max_grad_norm)
            nll = run.global_sum(torch.tensor([loss.item()], dtype=torch.float64, device=device)).item()  # global
            state.next_start = start + args.sft_batch_size
            state.sft_total, state.sft_count = state.sft_total + nll * len(mb), state.sft_count + len(mb)
            run.end_step(epoch * steps_per_epoch + start // args.sft_batch_size + 1, state)
        epoch_nll = state.sft_total / state.sft_count
        run.log(epoch, {"losses/sft_nll": epoch_nll})
        if run.rank == 0:
            print(f"[sft] epoch {epoch + 1}/{args.sft_epochs}: nll {epoch_nll:.4f}")
    return epoch_nll


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    run = start_run(args)  # torchrun, device, run dir (or the resumed one), tensorboard, Ctrl-C handling
    device, start_time = run.device, run.start_time
    # held-out comparisons: K completions of held-out prompts, ranked by the same labeler (other seed)
    heldout = preference.make_preference_dataset(
        args.eval_episodes, args.k, args.seed + 10_000, args.temperature, args.flip_prob, split="heldout"
    )
    if args.eval_only:  # a saved reward model: evaluate it on the Bradley-Terry scale, nothing else
        model, tokenizer = run.load_pretrained(args.checkpoint, "classifier")
        scale = float(getattr(model.config, "seqrl_reward_std", 1.0))
        metrics, report = evaluate(model, tokenizer, heldout, args, device, scale=scale)
        run.log(0, {**metrics, "eval/report": report})
        print(report)
        run.finish(metrics, {}, samples=0)
        return

    # 1. data: K SFT-like completions per training prompt, ranked by the simulated labeler
    data = preference.make_preference_dataset(
        args.n_train_prompts, args.k, args.seed, args.temperature, args.flip_prob, split="train"
    )
    # validation comparisons (--val-prompts): more rankings of training prompts, another labeler seed, never trained on
    val_data = (
        preference.make_preference_dataset(
            args.val_prompts, args.k, args.seed + 40_000, args.temperature, args.flip_prob, split="train"
        )
        if args.val_prompts > 0
        else []
    )
    lm, tokenizer = build_lm(args, device)
    run.broadcast_params(lm)
    # 2. supervised fine-tuning on demonstrations; the reward model starts from the SFT model's backbone
    sft_updates = args.sft_epochs * ((args.sft_examples + args.sft_batch_size - 1) // args.sft_batch_size)
    sft_nll = fine_tune_backbone(lm, tokenizer, args, run) if args.sft_epochs > 0 else None
    if sft_nll is not None:  # (None also when a resumed run is past SFT)
        if run.rank == 0:
            print(f"SFT: {args.sft_examples} demos x {args.sft_epochs} epochs ({time.time() - start_time:.0f}s)")
    model = reward_model_from(lm, tokenizer, device)
    del lm
    run.broadcast_params(model)
    # 3. the comparisons as token ids: one group of G sequences per example, best first
    ids, mask = group_ids(tokenizer, data, args)  # (N, G, L)
    val_ids, val_mask = group_ids(tokenizer, val_data, args) if val_data else (None, None)  # (V, G, L)
    n_examples, group = ids.shape[0], ids.shape[1]
    steps_per_epoch = (n_examples + args.batch_size - 1) // args.batch_size
    num_updates = args.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / num_updates)
    if run.rank == 0:
        print(f"{n_examples} training examples of {group} sequences, {num_updates} updates, device {device}")
    state = TrainState("reward", model, optimizer, scheduler, sft_nll=sft_nll)  # or the --resume checkpoint's place
    run.restore(state)

    # 4. fit r_psi by maximum likelihood of the preferences
    val = {}  # the last epoch's validation metrics (--val-prompts)
    for epoch in range(state.epoch, args.epochs):
        model.train()
        if epoch > state.epoch or state.perm is None:  # a new epoch: a new order
            state.epoch, state.next_start, state.perm = epoch, 0, torch.randperm(n_examples)
        for start in range(state.next_start, n_examples, args.batch_size):
            mb = state.perm[start : start + args.batch_size]  # the global minibatch (details 8)
            width = int(mask[mb].sum(-1).max())  # right padding: drop its all-pad columns
            part = run.shard(mb)  # this rank's share of it
            head_only = state.global_step < args.head_only_fraction * num_updates  # LP-FT: the backbone frozen first
            model.base_model.requires_grad_(not head_only)  # frozen: no gradient, AdamW skips it
            loss, rewards = reward_minibatch_loss(
                model, ids[part, :, :width].to(device), mask[part, :, :width].to(device), args
            )
            loss = loss * (len(part) / len(mb))  # weighted by its share: summed over ranks, the global mean
            gradient_step(state, loss, run, args.max_grad_norm)
            # the global minibatch's loss and how often it scores the top-ranked completion above the second
            stats = torch.tensor([loss.item(), (rewards[:, 0] > rewards[:, 1]).sum().item()], dtype=torch.float64)
            loss_value, n_correct = run.global_sum(stats.to(device)).tolist()
            step = state.global_step + 1
            state.next_start, state.global_step, state.loss = start + args.batch_size, step, loss_value
            state.n_seen += len(mb) * group
            if step % LOG_EVERY == 0 or step == num_updates:
                sps = state.n_seen / (time.time() - start_time)
                run.log(
                    step,
                    {
                        "losses/loss": loss_value,
                        "losses/accuracy_top2": n_correct / len(mb),
                        "charts/learning_rate": scheduler.get_last_lr()[0],
                        "charts/SPS": sps,
                    },
                )
            run.end_step(sft_updates + step, state)  # a checkpoint when due or stopped
        if run.rank == 0:  # --val-prompts: the validation comparisons' loss and pair accuracy with this epoch's weights
            val = validation_metrics(model, val_ids, val_mask, args, device) if val_data else {}
            run.log(epoch, val)
            shown = "".join(f"  {k} {v:.4f}" for k, v in val.items())
            print(f"epoch {epoch + 1}/{args.epochs}: loss {state.loss:.4f}{shown}  ({time.time() - start_time:.0f}s)")
    run.end_training()  # Ctrl-C stops at once again; under torchrun, rank 0 alone goes on (details 8)

    # 5. evaluate on the Bradley-Terry scale (calibration is not invariant to the normalization)
    metrics, report = evaluate(model, tokenizer, heldout, args, device)
    if state.sft_nll is not None:
        metrics["model/sft_nll"] = state.sft_nll
    metrics.update(val)  # the last epoch's validation loss and accuracy (--val-prompts)
    # 6. normalize to mean 0 / std 1 on SFT demonstrations, folded into the saved weights
    demos = preference.make_sft_dataset(args.n_norm_samples, seed=args.seed + 20_000)
    raw = score_texts(model, tokenizer, [d[0] for d in demos], [d[1] for d in demos], device)
    where = fold_normalization(model, float(raw.mean()), float(raw.std()))
    normed = score_texts(model, tokenizer, [d[0] for d in demos], [d[1] for d in demos], device)
    normed = normed + float(getattr(model.config, "seqrl_reward_offset", 0.0))
    print(f"normalized on {len(demos)} SFT demos (shift in {where}): mean {normed.mean():+.4f} std {normed.std():.4f}")
    metrics.update({"model/reward_mean_raw": float(raw.mean()), "model/reward_std_raw": float(raw.std())})
    metrics.update(
        {"model/reward_mean_normalized": float(normed.mean()), "model/reward_std_normalized": float(normed.std())}
    )  # noqa: E501
    score_metrics, score_report = lecture_scores(model, tokenizer, device)  # now on the normalized scale
    metrics.update(score_metrics)
    report = score_report + report[report.index("\n\ncalibration") :]
    run.log(state.global_step, {**metrics, "eval/report": report})
    print(report)
    # 7. save the model (loadable with AutoModelForSequenceClassification.from_pretrained) and summary.json
    run.finish(metrics, {"reward_model": (model, tokenizer)}, samples=state.n_seen)


# ------------------------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, heldout, args, device, scale: float = 1.0) -> tuple[dict, str]:
    """Held-out metrics. `scale` converts the model's output back to the Bradley-Terry scale for calibration."""
    model.eval()
    labeler = preference.Labeler(args.temperature, args.flip_prob)
    prompts, chosen, rejected = preference.to_pairs(heldout)
    r_c = score_texts(model, tokenizer, prompts, chosen, device) * scale
    r_r = score_texts(model, tokenizer, prompts, rejected, device) * scale
    delta = r_c - r_r  # (P,)
    p_true = labeler.preference_prob(prompts, chosen, rejected)  # (P,) P(labeler prefers the "chosen" one)
    metrics = {
        # accuracy on the sampled labels (ties count half)
        "eval/preference_accuracy": float(np.mean((delta > 0) + 0.5 * (delta == 0))),
        # the same accuracy in expectation over the labeler's coin flips (noise-free, same target)
        "eval/expected_accuracy": float(
            np.mean(np.where(delta > 0, p_true, 1 - p_true) * (delta != 0) + 0.5 * (delta == 0))
        ),  # noqa: E501
        "eval/bayes_accuracy": labeler.bayes_accuracy(prompts, chosen, rejected),
        "eval/n_pairs": float(len(delta)),
    }
    rows, metrics["eval/calibration_error"] = calibration_table(1 / (1 + np.exp(-delta)), p_true)
    # Spearman ρ of r_psi with the gold utility over every held-out completion
    flat_p = [d["prompt"] for d in heldout for _ in d["completions"]]
    flat_c = [c for d in heldout for c in d["completions"]]
    rewards = score_texts(model, tokenizer, flat_p, flat_c, device)
    gold = preference.gold_utility_batch(flat_p, flat_c)
    metrics["eval/spearman_gold"] = spearman(rewards, gold)
    # within-prompt ρ: immune to the per-prompt offset Bradley-Terry cannot identify (Problem 21.3b)
    by_prompt: dict[str, list[int]] = {}
    for i, p in enumerate(flat_p):
        by_prompt.setdefault(p, []).append(i)
    within = [spearman(rewards[ix], gold[ix]) for ix in by_prompt.values() if np.ptp(gold[ix]) > 0]
    metrics["eval/spearman_gold_within_prompt"] = float(np.mean(within))
    # prompt-centered ρ: fix the free per-prompt constant c(s) by a baseline, r(s,a) - mean_{a'~SFT-like(.|s)} r(s,a')
    # (the comparison data's own distribution; no gold knowledge), then pool over prompts (details 7)
    baseline = prompt_baselines(model, tokenizer, list(by_prompt), args.n_center_samples, args.seed + 30_000, device)
    centered = rewards - np.array([baseline[p] for p in flat_p])  # (N,)
    metrics["eval/spearman_gold_centered"] = spearman(centered, gold)
    score_metrics, report = lecture_scores(model, tokenizer, device)
    metrics.update(score_metrics)
    report += (
        "\n\ncalibration of σ(Δr) vs the labeler's true p:\n| bin | pairs | mean σ(Δr) | mean p |\n|---|---|---|---|\n"
    )
    report += "\n".join(f"| {lo:.1f}-{hi:.1f} | {n} | {a:.3f} | {b:.3f} |" for lo, hi, n, a, b in rows)
    return metrics, report


def prompt_baselines(model, tokenizer, prompts: list[str], n: int, seed: int, device) -> dict[str, float]:
    """Mean reward of n SFT-like completions (`preference.sample_completions`) of each prompt: {prompt: baseline}."""
    completions = preference.sample_completions(prompts, np.random.default_rng(seed), n=n)  # prompt-major, P * n
    scores = score_texts(model, tokenizer, [p for p in prompts for _ in range(n)], completions, device)
    return dict(zip(prompts, scores.reshape(len(prompts), n).mean(1).tolist(), strict=True))


def lecture_scores(model, tokenizer, device) -> tuple[dict, str]:
    """The lecture's example completions (best first) and off-distribution probes, scored; metrics and a table."""
    prompt, examples = preference.LECTURE_EXAMPLES
    texts = list(examples + PROBES)
    scores = score_texts(model, tokenizer, [prompt] * len(texts), texts, device)
    scores = scores + float(getattr(model.config, "seqrl_reward_offset", 0.0))
    metrics = {"eval/lecture_order_correct": float(np.all(np.diff(scores[: len(examples)]) < 0))}
    lines = ["| completion | gold u | r_psi |", "|---|---|---|"]
    for i, (c, s) in enumerate(zip(texts, scores, strict=True)):
        kind = f"lecture_{i}" if i < len(examples) else f"probe_{i - len(examples)}"
        metrics[f"eval/score_{kind}"] = float(s)
        shown = c.text if c.ended else f"{c.text} (cut off)"
        lines.append(f"| {shown} | {preference.gold_utility(prompt, c):+.2f} | {s:+.3f} |")
    return metrics, f'scores for "{prompt}" (lecture examples best first, then probes):\n' + "\n".join(lines)


# === RUN MANAGEMENT (not the algorithm: validation, run dir, torchrun, checkpoints and --resume, Ctrl-C, summary) ===
TASK_ID = "seqrl-preference"  # run-name prefix
SCRIPT = Path(__file__).stem  # named in summary.json and in every checkpoint's state.json
RESUME_FREE_FIELDS = (
    "cuda",
    "runs_dir",
    "save_every",
    "resume",
    "threads",
)  # what a resumed run may change (rest: the algorithm)
DIST_TIMEOUT = timedelta(minutes=10)  # a rank waiting this long in a collective gives up (a failed rank never hangs)


def parse_args() -> Args:
    """The command line, checked (one-line errors before any work); with --resume, the resumed run's args."""
    args = tyro.cli(Args)
    if args.threads < 1:
        raise SystemExit(f"error: --threads must be at least 1, got {args.threads}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # set by torchrun
    if args.save_every < 0:
        raise SystemExit("error: need --save-every >= 0 (0 = checkpoint only on Ctrl-C)")
    if args.resume is not None and args.eval_only:
        raise SystemExit("error: --resume continues a training run; --eval-only has nothing to resume")
    if args.eval_only and world_size > 1:
        raise SystemExit("error: --eval-only runs in one process (not under torchrun)")
    if args.resume is not None:  # the run's own args; the command line may only repeat them (details 9)
        args = resume_args(args, find_checkpoint(Path(args.resume))["state"]["args"])
    else:
        check_writable_dir(Path(args.runs_dir), "--runs-dir")
    if args.eval_only and args.checkpoint is None:
        raise SystemExit("error: --eval-only needs --checkpoint PATH (a run dir or its reward_model/ dir)")
    if args.checkpoint is not None and not Path(args.checkpoint).exists():
        raise SystemExit(f"error: --checkpoint '{args.checkpoint}' does not exist")
    if args.sft_epochs < 0 or args.sft_examples < 1 or args.sft_batch_size < 1:
        raise SystemExit("error: need --sft-epochs >= 0 and positive --sft-examples, --sft-batch-size")
    if args.k < 2 or args.n_train_prompts < 1 or args.eval_episodes < 1 or args.epochs < 1 or args.batch_size < 1:
        raise SystemExit("error: need --k >= 2 and positive --n-train-prompts, --eval-episodes, --epochs, --batch-size")
    if args.n_center_samples < 1:
        raise SystemExit("error: need --n-center-samples >= 1")
    if args.temperature <= 0 or not 0 <= args.flip_prob <= 1:
        raise SystemExit("error: need --temperature > 0 and 0 <= --flip-prob <= 1")
    if args.loss == "kwise" and args.kwise_form == "softmax" and args.margin != 0:
        raise SystemExit("error: --margin is defined for pairwise / kwise-pairs losses, not --kwise-form softmax")
    if not 0 <= args.head_only_fraction <= 1:
        raise SystemExit(f"error: --head-only-fraction must be in [0, 1], got {args.head_only_fraction}")
    if args.val_prompts < 0:
        raise SystemExit(f"error: --val-prompts must be >= 0 (0 = none), got {args.val_prompts}")
    if args.seed < 0 or args.n_norm_samples < 2 or not 0 <= args.dropout < 1:
        raise SystemExit("error: need --seed >= 0, --n-norm-samples >= 2 and 0 <= --dropout < 1")
    if min(args.n_layer, args.n_embd, args.n_head) < 1 or args.n_embd % args.n_head:
        raise SystemExit("error: need positive --n-layer, --n-embd, --n-head, and --n-embd divisible by --n-head")
    if min(args.sft_learning_rate, args.learning_rate, args.weight_decay, args.center_coef) < 0:
        raise SystemExit("error: need --sft-learning-rate, --learning-rate, --weight-decay, --center-coef >= 0")
    if args.max_grad_norm <= 0:
        raise SystemExit(f"error: --max-grad-norm must be > 0, got {args.max_grad_norm}")
    for flag, n, batch in (
        ("--sft-batch-size", args.sft_examples, args.sft_batch_size),
        ("--batch-size", n_train_examples(args), args.batch_size),
    ):
        if world_size > 1 and (batch % world_size or 0 < n % batch < world_size):  # every rank gets a share
            raise SystemExit(
                f"error: {flag} {batch} (and a last minibatch of {n % batch}) must split over {world_size} ranks"
            )
    return args


def n_train_examples(args: Args) -> int:
    """Examples of the preference step: rankings (kwise) or their C(K,2) pairs each (pairwise)."""
    return args.n_train_prompts * (args.k * (args.k - 1) // 2 if args.loss == "pairwise" else 1)


def resume_args(args: Args, saved: dict) -> Args:
    """The resumed run's args: its saved ones. A field given on the command line (other than its default) must
    agree with them, except the RESUME_FREE_FIELDS, which come from the command line."""
    defaults, merged = asdict(Args()), {}
    for name, value in asdict(args).items():
        if name in RESUME_FREE_FIELDS or name not in saved:
            merged[name] = value
        elif value != defaults[name] and value != saved[name]:
            raise SystemExit(
                f"error: --{name.replace('_', '-')} {value} differs from the resumed run's {saved[name]} (drop it)"
            )
        else:
            merged[name] = saved[name]
    return Args(**merged)


def start_run(args: Args) -> "Run":
    """Join torchrun (when launched by it) and pick the device; make the run dir (--resume: reopen it, and load its
    checkpoint); tensorboard on rank 0 (others: NullWriter); when training, Ctrl-C / SIGTERM set the stop flag."""
    rank, world_size, device = init_torchrun(args.cuda)
    resume = find_checkpoint(Path(args.resume)) if args.resume is not None else None
    start_time = time.time() - (resume["state"]["elapsed_s"] if resume else 0.0)
    if resume is not None:
        run_dir = Path(args.resume)
    else:
        run_dir = new_run_dir(args.runs_dir, TASK_ID, args.exp_name, args.seed) if rank == 0 else None
        if world_size > 1:  # rank 0 made the run dir; every rank learns its name
            shared = [str(run_dir) if rank == 0 else None]
            dist.broadcast_object_list(shared, src=0)
            run_dir = Path(shared[0])
    writer = NullWriter()
    if rank == 0 and resume is None:
        writer = open_writer(run_dir, args)
    elif rank == 0:  # continue the curves: drop what the interrupted run logged after its checkpoint (details 9)
        st = resume["state"]  # losses/sft_nll is logged per SFT epoch, the rest per reward-model update
        purge_step = st["epoch"] if st["phase"] == "sft" else max(st["global_step"] + 1, args.sft_epochs)
        writer = open_writer(run_dir, args, purge_step)
        if purge_step == 0:  # the purge drops the hyperparameter table too (it is logged at step 0)
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
            writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    sft_updates = args.sft_epochs * ((args.sft_examples + args.sft_batch_size - 1) // args.sft_batch_size)
    total_updates = sft_updates + args.epochs * ((n_train_examples(args) + args.batch_size - 1) // args.batch_size)
    stop = {"signal": None, "previous": {}} if args.eval_only else install_stop_handlers()
    return Run(args, device, rank, world_size, run_dir, writer, resume, start_time, total_updates, stop)


@dataclass
class Run:
    """What one process knows beyond Args: its place under torchrun, its device, the run dir, the tensorboard writer,
    the checkpoint it resumes and the stop flag. `Run(args)`: one process on the CPU that writes nothing (tests)."""

    args: Args
    device: torch.device = torch.device("cpu")
    rank: int = 0
    world_size: int = 1
    run_dir: Path | None = None  # None: no checkpoints
    writer: SummaryWriter = field(default_factory=lambda: NullWriter())  # a NullWriter on ranks other than 0
    resume: dict | None = None  # `find_checkpoint` of --resume
    start_time: float = field(default_factory=time.time)  # moved back by the run's time before a resume
    total_updates: int = 0  # SFT + reward-model updates: the last one is always checkpointed
    stop: dict = field(default_factory=lambda: {"signal": None, "previous": {}})  # install_stop_handlers' flag
    resuming: bool = field(init=False)  # --resume continues a checkpoint

    def __post_init__(self):
        self.resuming = self.resume is not None

    def broadcast_params(self, *modules: nn.Module) -> None:
        for module in modules:
            broadcast_params(module, self.world_size)

    def sync_grads(self, params) -> None:
        sync_grads(list(params), self.world_size)

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        return global_sum(x, self.world_size)

    def shard(self, items: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a global minibatch: items[rank * n : (rank + 1) * n] with n = len(items) /
        world_size (a shorter last minibatch is split as evenly as it goes). One process: all of it."""
        return items if self.world_size == 1 else items.tensor_split(self.world_size)[self.rank]

    def log(self, step: int, metrics: dict) -> None:
        for tag, value in metrics.items():
            if isinstance(value, str):
                self.writer.add_text(tag, value, step)
            else:
                self.writer.add_scalar(tag, value, step)

    def restore(self, state: "TrainState") -> int:
        """With --resume: the number of updates the checkpoint had done (SFT and reward updates counted together);
        if it was written in state.phase, its model, optimizer, scheduler, place in the loop and every RNG are loaded
        into `state` too. Otherwise 0, and `state` stays as it is."""
        if not self.resuming:
            return 0
        if self.resume["state"]["phase"] == state.phase:
            load_state(self.resume, state, self.device)
        return self.resume["state"]["update"]

    def end_step(self, step: int, state: "TrainState") -> None:
        """At a step boundary: checkpoint `state` when due (every --save-every updates, and the last one) or when a
        stop signal reached any rank; after a stop, exit with STOP_EXIT_CODE and the --resume command."""
        stop = self.stop["signal"] is not None
        if self.world_size > 1:  # a signal to any rank stops every rank at the same step (details 8)
            stop = global_sum(torch.tensor([float(stop)], device=self.device), self.world_size).item() > 0
        every = self.args.save_every
        due = every > 0 and (step % every == 0 or step == self.total_updates)
        if self.run_dir is None or not (due or stop):
            return
        if self.rank == 0:
            extra = {"update": step, "args": asdict(self.args), "elapsed_s": time.time() - self.start_time}
            step_dir = save_checkpoint(self.run_dir, step, state, extra)
            self.writer.flush()  # the scalars logged so far reach the disk with the checkpoint
        if stop:
            if self.world_size > 1:
                dist.barrier()  # no rank exits (torchrun would end the others) before rank 0's checkpoint is complete
                dist.destroy_process_group()
            if self.rank == 0:
                self.writer.close()
                launcher = "python" if self.world_size == 1 else f"torchrun --nproc_per_node {self.world_size}"
                print(f"interrupted: saved {step_dir}; continue with: {launcher} {sys.argv[0]} --resume {self.run_dir}")
            raise SystemExit(STOP_EXIT_CODE)

    def end_training(self) -> None:
        """After the last update: Ctrl-C stops at once again (a resume would redo the evaluation); under torchrun no
        collective follows: every rank tears down together, and rank 0 alone evaluates, normalizes and saves."""
        restore_signal_handlers(self.stop)
        if self.world_size > 1:
            dist.barrier()  # every rank tears down together (then each frees its gloo threads)
            dist.destroy_process_group()
            if self.rank != 0:
                raise SystemExit(0)

    def load_pretrained(self, path: str, kind: Literal["causal", "classifier"]):
        """(model, tokenizer) of a `save_pretrained` dir (--eval-only: a run dir or its reward_model/ dir)."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        p = Path(path)
        if (p / "reward_model").is_dir():
            p = p / "reward_model"
        if not (p / "config.json").exists():
            raise SystemExit(f"error: --checkpoint '{path}' is not a run dir or save_pretrained dir (no config.json)")
        cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
        try:
            model = cls.from_pretrained(p)
            tokenizer = AutoTokenizer.from_pretrained(p)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: could not load reward model from '{p}': {str(e).splitlines()[0]}") from None
        return model.to(self.device), tokenizer

    def finish(self, metrics: dict, models: dict, samples: int) -> None:
        """Rank 0 at the end: save `models` (`save_models`; the reward model is loadable with
        AutoModelForSequenceClassification.from_pretrained), write args.json and then summary.json (last: its presence
        marks a finished run for --resume; sps = samples / wall time), close tensorboard."""
        run_dir = self.run_dir
        save_models(run_dir, models)
        wall = time.time() - self.start_time
        print(json.dumps({k: round(v, 4) for k, v in metrics.items()}, indent=1))
        summary = {
            "script": SCRIPT,
            "run_name": run_dir.name,
            "run_dir": str(run_dir),
            "args": asdict(self.args),
            "metrics": metrics,
            "wall_time_s": wall,
            "sps": samples / wall,
        }
        (run_dir / "args.json").write_text(json.dumps(asdict(self.args), indent=2))
        write_json_atomic(run_dir / "summary.json", summary)
        self.writer.close()


def save_models(run_dir: Path, models: dict) -> None:
    """Each `name -> what` of `models`: a torch module to name.safetensors; a transformers model or tokenizer, or a
    tuple of them (a model and its tokenizer), `save_pretrained` into name/."""
    for name, what in models.items():
        for part in what if isinstance(what, tuple) else (what,):
            if hasattr(part, "save_pretrained"):
                part.save_pretrained(run_dir / name)
            else:
                save_file({k: v.contiguous() for k, v in part.state_dict().items()}, run_dir / f"{name}.safetensors")


def check_writable_dir(path: Path, flag: str) -> None:
    """A one-line error, before any work, if `path` is a file, cannot be created, or is not writable."""
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: {flag} {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SystemExit(f"error: cannot create {flag} {path}: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SystemExit(f"error: {flag} {path} is not writable")


def new_run_dir(runs_dir: str, task: str, exp_name: str, seed: int) -> Path:
    """Create and return runs_dir/{task}__{exp_name}__{seed}__{unix time}; never an existing directory: mkdir is
    atomic, so runs started in the same second get -1, -2, ..."""
    run_name = f"{task.replace('/', '-').replace(':', '-')}__{exp_name}__{seed}__{int(time.time())}"
    run_dir, suffix = Path(runs_dir) / run_name, 0
    while True:
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
            return run_dir
        except FileExistsError:
            suffix += 1
            run_dir = Path(runs_dir) / f"{run_name}-{suffix}"


def open_writer(run_dir: Path, args, purge_step: int | None = None) -> SummaryWriter:
    """tensorboard in the run dir with the hyperparameters as a markdown table (CleanRL). On a resume, purge_step (the
    checkpoint's step + 1) drops what the killed run logged after its checkpoint, and the table is already there."""
    writer = SummaryWriter(str(run_dir), purge_step=purge_step)
    if purge_step is None:
        table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temporary file, then rename it into place: a kill leaves the old file or none, never half."""
    tmp = path.with_name(f".tmp_{path.name}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


STOP_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a job stopped by Ctrl-C (a SIGTERM stop exits alike)


def install_stop_handlers() -> dict:
    """Ctrl-C (SIGINT) and SIGTERM (what torchrun's agent, job schedulers and `kill` send) set stop["signal"] to the
    signal's name; training reads it at the end of its current step, writes a checkpoint and exits with
    STOP_EXIT_CODE. A second Ctrl-C stops at once; a repeated SIGTERM changes nothing (a scheduler that stops waiting
    sends SIGKILL). stop["previous"] keeps the handlers before, which restore_signal_handlers puts back."""
    stop = {"signal": None, "previous": {}}

    def handler(signum, frame):
        if signum == signal.SIGINT and stop["signal"] is not None:
            raise KeyboardInterrupt
        if stop["signal"] is None:
            stop["signal"] = signal.Signals(signum).name
            # os.write, not print: a handler that prints while the loop prints raises "reentrant call"
            os.write(
                2,
                f"\n{stop['signal']}: a checkpoint follows this step, then the run exits (Ctrl-C again to "
                "stop now)\n".encode(),
            )

    for sig in (signal.SIGINT, signal.SIGTERM):
        stop["previous"][sig] = signal.signal(sig, handler)
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


def sync_grads(params, world_size: int) -> None:
    """SUM the gradients over ranks, one flat all-reduce after backward() and before clipping (CleanRL's
    ppo_atari_multigpu.py averages instead): each rank's loss is already weighted by its share of the global batch,
    so the sum is the gradient of the global batch's loss. Parameters without a gradient are skipped (identically on
    every rank). One process: nothing."""
    if world_size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def global_sum(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The sum of x over ranks (a new tensor); x itself in one process."""
    if world_size == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def broadcast_params(module: nn.Module, world_size: int) -> None:
    """Rank 0's parameters and floating-point buffers on every rank: identical starts whatever each rank's RNG use."""
    if world_size > 1:
        with torch.no_grad():
            for t in [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]:
                dist.broadcast(t.data, src=0)


class NullWriter:
    """What ranks other than 0 write to instead of tensorboard: SummaryWriter's calls as no-ops."""

    def add_scalar(self, *args, **kwargs):
        pass

    add_text = add_histogram = flush = close = add_scalar


def save_checkpoint(run_dir: Path, step: int, state: "TrainState", extra: dict) -> Path:
    """Write RUN_DIR/checkpoints/step_<step>/ atomically, point latest.json at it, delete older ones.

    Every field of `state` (`dataclasses.fields`): a module to <name>.safetensors (`save_model`: tied weights stored
    once), optimizer and scheduler state_dicts together to optimizer.pt (tensors and numbers only), tensors with the
    torch RNG state to rng.safetensors, the rest to state.json (with `extra`, python and numpy RNG states, the byte
    size of every file).
    """
    root = run_dir / "checkpoints"
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
    tmp.mkdir(parents=True)
    rng, state_dicts, plain = {"torch_cpu": torch.get_rng_state()}, {}, {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, nn.Module):
            save_model(value, str(tmp / f"{f.name}.safetensors"))
        elif hasattr(value, "state_dict"):  # optimizer, scheduler
            state_dicts[f.name] = value.state_dict()
        elif isinstance(value, torch.Tensor):
            rng[f.name] = value
        else:
            plain[f.name] = value
    torch.save(state_dicts, tmp / "optimizer.pt")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    save_file({k: v.contiguous().cpu() for k, v in rng.items()}, str(tmp / "rng.safetensors"))
    numpy_rng = np.random.get_state(legacy=False)
    numpy_rng["state"]["key"] = numpy_rng["state"]["key"].tolist()
    python_rng = random.getstate()
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
    saved = {
        **plain,
        **extra,
        "script": SCRIPT,
        "step": step,
        "files": files,
        "numpy_rng": numpy_rng,
        "python_rng": [python_rng[0], list(python_rng[1]), python_rng[2]],
    }
    (tmp / "state.json").write_text(json.dumps(saved))
    if final.exists():  # complete, but latest.json never named it (the run was killed right after the rename)
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_json_atomic(root / "latest.json", {"step": step, "dir": final.name, "phase": state.phase})
    for old in root.glob("step_*"):  # the previous checkpoint goes only now that the new one is complete
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(run_dir: Path) -> dict:
    """The newest complete checkpoint of a run dir, checked: {"state": state.json, "dir": its step dir}; one-line
    errors for a finished run, another script's run, no checkpoint, a missing or truncated file."""
    if not run_dir.is_dir():
        raise SystemExit(f"error: --resume '{run_dir}' is not a run directory")
    if (run_dir / "summary.json").exists():
        raise SystemExit(f"error: --resume '{run_dir}': the run is finished (summary.json exists); nothing to resume")
    latest = run_dir / "checkpoints" / "latest.json"
    if not latest.exists():
        raise SystemExit(f"error: --resume '{run_dir}' has no checkpoint ({latest} missing; see --save-every)")
    try:
        step_dir = latest.parent / json.loads(latest.read_text())["dir"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: checkpoint index {latest} is unreadable ({e})") from None
    try:
        state = json.loads((step_dir / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: checkpoint file {step_dir / 'state.json'} is corrupt or missing ({e})") from None
    if state.get("script") != SCRIPT:
        raise SystemExit(f"error: --resume '{run_dir}' is a run of {state.get('script')}, not of {SCRIPT}")
    for name, size in state["files"].items():
        got = (step_dir / name).stat().st_size if (step_dir / name).exists() else 0
        if got != size:
            raise SystemExit(f"error: checkpoint file {step_dir / name} is truncated ({got} of {size} bytes)")
    return {"state": state, "dir": step_dir}


def load_state(ckpt: dict, state: "TrainState", device) -> None:
    """Load a checkpoint (`find_checkpoint`) into `state`, field by field as `save_checkpoint` wrote them, and set
    every RNG; a corrupt file is a one-line error."""

    def read(name, fn):
        try:
            return fn(ckpt["dir"] / name)
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SystemExit(f"error: checkpoint file {ckpt['dir'] / name} is corrupt ({message})") from None

    state_dicts = read("optimizer.pt", lambda f: torch.load(f, map_location=device, weights_only=True))
    tensors = read("rng.safetensors", lambda f: load_file(str(f)))
    saved = ckpt["state"]
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, nn.Module):
            read(f"{f.name}.safetensors", lambda path, value=value: load_model(value, str(path), device=str(device)))
        elif hasattr(value, "state_dict"):
            value.load_state_dict(state_dicts[f.name])
        elif f.name in tensors:
            setattr(state, f.name, tensors[f.name])
        else:
            setattr(state, f.name, saved[f.name])
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_rng = tensors.get("torch_cuda")
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    random.setstate((saved["python_rng"][0], tuple(saved["python_rng"][1]), saved["python_rng"][2]))
    np.random.set_state(saved["numpy_rng"])


if __name__ == "__main__":
    main()
