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
  8. torchrun: each rank takes its share of every global minibatch, its loss weighted by that share, and DDP sums the
     ranks' gradients (`run.data_parallel`), so the sum is the global minibatch's gradient.
  9. Checkpoints (`--save-every`, Ctrl-C) and `--resume` continue a run exactly (RUN_DIR/train_state.safetensors).
 10. `--learning-rate 1e-3`, not 3e-3: the larger rate makes the reward step forget the SFT fact table. LP-FT
     (`--head-only-fraction`: the head first, on the frozen backbone) is off by default (docs/tuning.md).
 11. An ensemble (`--ensemble-size`): member m repeats steps 2-4 from seed --seed + 1000 m on the same data, and the
     reward is the members' mean, normalized as one. A single model's accuracy moves by several points with its
     initialization (mostly its SFT backbone's), so independent backbones are averaged, not heads on one [4].

References:
  [1] Christiano et al. 2017, Deep RL from human preferences. [2] Ziegler et al. 2019, Fine-tuning LMs from human
  preferences (K-way softmax, reward normalization). [3] Ouyang et al. 2022, InstructGPT (all C(K,2) pairs per batch
  element). [4] Eisenstein et al. 2023, Helping or herding? (reward centering, pretrain ensembles). [5]
  huggingface/trl `RewardTrainer` (margin, center_rewards_coefficient). [6] Kumar et al. 2022, Fine-tuning can
  distort pretrained features (LP-FT).
Details, measurements, usage (torchrun, --resume, real models): docs/rlhf_reward_model.md.
Reproduce: python algos/rlhf_reward_model.py --seed 1
"""

import copy
import dataclasses
import functools
import json
import os
import random
import re
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
import torch.utils._pytree as pytree
import tyro
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
import envs  # noqa: E402, F401  (registers the seqrl/ environments)
from envs import preference  # noqa: E402
from envs.tokenizer import build_tokenizer  # noqa: E402

LOG_EVERY = 20  # reward-model updates between logged training scalars
N_POSITIONS = 64  # tiny GPT-2 context: prompt (<= 9 tokens) + completion (<= 16 tokens) fits with room
CALIBRATION_BINS = 10  # equal-width bins of σ(Δr) for the calibration table / error
SCORE_BATCH = 512  # sequences per no-grad scoring forward pass
MEMBER_SEED_STRIDE = 1000  # ensemble member m is initialized and ordered from --seed + MEMBER_SEED_STRIDE * m
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
    data_seed: int | None = None
    """seed of the data alone (comparisons, labels, demonstrations, held-out pairs); None: --seed. With another
    --seed: the same data, another initialization and minibatch order"""
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
    """write the training checkpoint RUN_DIR/train_state.safetensors every N gradient steps (SFT and reward-model
    updates counted together; the default run has ~1,130); 0 = only on Ctrl-C (details 9)"""
    resume: str | None = None
    """continue the run in this run dir from its checkpoint, with its saved args (details 9)"""

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
    n_train_prompts: int = 12000
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
    epochs: int = 2
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
    ensemble_size: int = 2
    """independent reward models on the same data, each with its own initialization and order (SFT backbone
    included; seeds --seed + 1000 m); the reward is their mean, a "pretrain ensemble" [4] (details 11)"""
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
    A `RewardEnsemble`: the mean of its members' rewards (details 11).
    """
    if isinstance(model, RewardEnsemble):
        return torch.stack([reward_forward(m, input_ids, attention_mask) for m in model]).mean(0)
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


class RewardEnsemble(nn.ModuleList):
    """Reward models whose reward is the mean of theirs (`reward_forward`), each saved as its own model; `config` is
    the first member's (all share the ensemble's normalization, `fold_normalization`)."""

    @property
    def config(self):
        return self[0].config


def fold_normalization(model, mean: float, std: float) -> str:
    """Make the model output (r - mean) / std: scale the head, put the shift into a bias (see details 5); an
    ensemble: every member, so that the mean of theirs is normalized."""
    if isinstance(model, RewardEnsemble):
        return [fold_normalization(m, mean, std) for m in model][0]
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
    """Where a training phase's loop stands: all a checkpoint holds (field by field; a state_dict where a field has
    one). One phase at a time: "sft" (the causal LM on demonstrations, `fine_tune_backbone`), then "reward"."""

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
    member: int = 0  # the ensemble member being trained (details 11)
    finished: list = field(default_factory=list)  # the state_dicts of the members trained before it


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
    """One AdamW step of state.model (and its scheduler) on this rank's share of the loss, computed through
    `run.data_parallel`: backward() sums the ranks' gradients, the global minibatch's (details 8); then clipped."""
    state.optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), max_grad_norm)
    state.optimizer.step()
    state.scheduler.step()


# not rlhf_ppo_kl.py's `supervised_fine_tune`: this one also predicts the prompt (the reward model's input) and is
# sharded over ranks and checkpointed
def fine_tune_backbone(lm, tokenizer, args, run, member: int, first: int, finished: list) -> float | None:
    """STEP 2: causal-LM training on demonstrations, in place; returns the last epoch's NLL (None: a resumed run that
    is past this phase). `first`: the member's first update in the run's count (SFT and reward of every member).

    The input is the reward model's exact input format (`encode`: prompt + completion + EOS if it ended, right
    padded), so predicting "paris" after "what is the capital of france ?" teaches the backbone the fact table.
    `run`: this process's share and DDP under torchrun, and the checkpoint it resumes (details 8-9).
    """
    device = run.device
    demos = preference.make_sft_dataset(args.sft_examples, seed=data_seed(args) + 30_000, split="train")
    enc = encode(tokenizer, [d[0] for d in demos], [d[1] for d in demos])
    ids, mask = enc["input_ids"], enc["attention_mask"]  # (N, L)
    steps_per_epoch = (len(ids) + args.sft_batch_size - 1) // args.sft_batch_size
    num_updates = args.sft_epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(lm.parameters(), lr=args.sft_learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / num_updates)
    state = TrainState("sft", lm, optimizer, scheduler, member=member, finished=finished)  # or the checkpoint's place
    if run.restore(state) > first + num_updates:  # a checkpoint of this member's reward phase: SFT is over
        return None
    lm.train()
    minibatch_loss = run.data_parallel(sft_minibatch_loss, lm)  # torchrun: through DDP (details 8)
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
            loss = minibatch_loss(ids[part, :width].to(device), mask[part, :width].to(device), n_targets)
            gradient_step(state, loss, run, args.max_grad_norm)
            nll = run.global_sum(torch.tensor([loss.item()], dtype=torch.float64, device=device)).item()  # global
            state.next_start = start + args.sft_batch_size
            state.sft_total, state.sft_count = state.sft_total + nll * len(mb), state.sft_count + len(mb)
            run.end_step(first + epoch * steps_per_epoch + start // args.sft_batch_size + 1, state)
        epoch_nll = state.sft_total / state.sft_count
        run.log(first + (epoch + 1) * steps_per_epoch, {"losses/sft_nll": epoch_nll})
        if run.rank == 0:
            print(f"[sft] member {member}, epoch {epoch + 1}/{args.sft_epochs}: nll {epoch_nll:.4f}")
    return epoch_nll


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    run = start_run(args)  # torchrun, device, run dir (or the resumed one), tensorboard, Ctrl-C handling
    device, start_time = run.device, run.start_time
    # held-out comparisons: K completions of held-out prompts, ranked by the same labeler (other seed)
    heldout = preference.make_preference_dataset(
        args.eval_episodes, args.k, data_seed(args) + 10_000, args.temperature, args.flip_prob, split="heldout"
    )
    if args.eval_only:  # a saved reward model (a run dir: all its members): on the Bradley-Terry scale, nothing else
        paths = sorted(Path(args.checkpoint).glob("reward_model_*")) or [args.checkpoint]
        members = [run.load_pretrained(str(path), "classifier") for path in paths]
        model, tokenizer = RewardEnsemble(m for m, _ in members), members[0][1]
        scale = float(getattr(model.config, "seqrl_reward_std", 1.0))
        metrics, report = evaluate(model, tokenizer, heldout, args, device, scale=scale)
        run.log(0, {**metrics, "eval/report": report})
        print(report)
        run.finish(metrics, {}, samples=0)
        return

    # 1. data: K SFT-like completions per training prompt, ranked by the simulated labeler
    data = preference.make_preference_dataset(
        args.n_train_prompts, args.k, data_seed(args), args.temperature, args.flip_prob, split="train"
    )
    # validation comparisons (--val-prompts): more rankings of training prompts, another labeler seed, never trained on
    val_data = (
        preference.make_preference_dataset(
            args.val_prompts, args.k, data_seed(args) + 40_000, args.temperature, args.flip_prob, split="train"
        )
        if args.val_prompts > 0
        else []
    )
    # 2-4 for each member of the ensemble: its own initialization and minibatch order, the same data (details 11)
    ensemble, finished = RewardEnsemble(), run.checkpoint["finished"] if run.checkpoint else []  # --resume: done ones
    for member in range(args.ensemble_size):
        seed_everything(args.seed + MEMBER_SEED_STRIDE * member)  # member 0: exactly the run of one model
        lm, tokenizer = build_lm(args, device)
        if member == 0:  # 3. the comparisons as token ids (one tokenizer for all): groups of G sequences, best first
            ids, mask = group_ids(tokenizer, data, args)  # (N, G, L)
            val_ids, val_mask = group_ids(tokenizer, val_data, args) if val_data else (None, None)  # (V, G, L)
            n_examples, group = ids.shape[0], ids.shape[1]
            num_updates = args.epochs * ((n_examples + args.batch_size - 1) // args.batch_size)
            sft_updates = args.sft_epochs * ((args.sft_examples + args.sft_batch_size - 1) // args.sft_batch_size)
        first = member * (sft_updates + num_updates)  # the member's first update in the run's count
        if member < len(finished):  # a resumed run: this member was done before its checkpoint
            ensemble.append(reward_model_from(lm, tokenizer, device))
            ensemble[-1].load_state_dict(finished[member])
            continue
        # 2. supervised fine-tuning on demonstrations; the reward model starts from the SFT model's backbone
        sft_nll = fine_tune_backbone(lm, tokenizer, args, run, member, first, finished) if args.sft_epochs else None
        model = reward_model_from(lm, tokenizer, device)
        del lm
        minibatch_loss = run.data_parallel(reward_minibatch_loss, model)  # torchrun: through DDP (details 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s, n=num_updates: 1.0 - s / n)
        state = TrainState("reward", model, optimizer, scheduler, sft_nll=sft_nll, member=member, finished=finished)
        run.restore(state)  # or the --resume checkpoint's place

        # 4. fit r_psi by maximum likelihood of the preferences
        for epoch in range(state.epoch, args.epochs):
            model.train()
            if epoch > state.epoch or state.perm is None:  # a new epoch: a new order
                state.epoch, state.next_start, state.perm = epoch, 0, torch.randperm(n_examples)
            for start in range(state.next_start, n_examples, args.batch_size):
                mb = state.perm[start : start + args.batch_size]  # the global minibatch (details 8)
                width = int(mask[mb].sum(-1).max())  # right padding: drop its all-pad columns
                part = run.shard(mb)  # this rank's share of it
                head_only = state.global_step < args.head_only_fraction * num_updates  # LP-FT: backbone frozen first
                model.base_model.requires_grad_(not head_only)  # frozen: no gradient, AdamW skips it
                loss, rewards = minibatch_loss(ids[part, :, :width].to(device), mask[part, :, :width].to(device), args)
                loss = loss * (len(part) / len(mb))  # weighted by its share of the global minibatch (details 8)
                gradient_step(state, loss, run, args.max_grad_norm)
                # the global minibatch's loss and how often it scores the top-ranked completion above the second
                stats = torch.tensor([loss.item(), (rewards[:, 0] > rewards[:, 1]).sum().item()], dtype=torch.float64)
                loss_value, n_correct = run.global_sum(stats.to(device)).tolist()
                step = state.global_step + 1
                state.next_start, state.global_step, state.loss = start + args.batch_size, step, loss_value
                state.n_seen += len(mb) * group
                if step % LOG_EVERY == 0 or step == num_updates:
                    sps = (member * args.epochs * n_examples * group + state.n_seen) / (time.time() - start_time)
                    run.log(
                        first + sft_updates + step,
                        {
                            "losses/loss": loss_value,
                            "losses/accuracy_top2": n_correct / len(mb),
                            "charts/learning_rate": scheduler.get_last_lr()[0],
                            "charts/SPS": sps,
                        },
                    )
                run.end_step(first + sft_updates + step, state)  # a checkpoint when due or stopped
            if run.rank == 0:  # --val-prompts: the validation comparisons' loss and pair accuracy of this epoch's model
                val = validation_metrics(model, val_ids, val_mask, args, device) if val_data else {}
                run.log(first + sft_updates + state.global_step, val)
                shown = "".join(f"  {k} {v:.4f}" for k, v in val.items())
                print(
                    f"member {member}, epoch {epoch + 1}/{args.epochs}: loss {state.loss:.4f}{shown}",
                    f"({time.time() - start_time:.0f}s)",
                )
        ensemble.append(model.eval())
        finished.append(model.state_dict())  # every later checkpoint holds it
    run.end_training()  # Ctrl-C stops at once again; under torchrun, rank 0 alone goes on (details 8)
    model, step = ensemble, args.ensemble_size * (sft_updates + num_updates)

    # 5. evaluate on the Bradley-Terry scale (calibration is not invariant to the normalization)
    metrics, report = evaluate(model, tokenizer, heldout, args, device)
    if state.sft_nll is not None:  # the last member's
        metrics["model/sft_nll"] = state.sft_nll
    if val_data:  # the validation comparisons' loss and pair accuracy of the ensemble (--val-prompts)
        metrics.update(validation_metrics(model, val_ids, val_mask, args, device))
    # 6. normalize to mean 0 / std 1 on SFT demonstrations, folded into the saved weights
    demos = preference.make_sft_dataset(args.n_norm_samples, seed=data_seed(args) + 20_000)
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
    run.log(step, {**metrics, "eval/report": report})
    print(report)
    # 7. save each member (loadable with AutoModelForSequenceClassification.from_pretrained) and summary.json
    names = ["reward_model"] if len(model) == 1 else [f"reward_model_{m}" for m in range(len(model))]
    run.finish(
        metrics, {n: (m, tokenizer) for n, m in zip(names, model, strict=True)}, samples=state.n_seen * len(model)
    )


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
    baseline = prompt_baselines(
        model, tokenizer, list(by_prompt), args.n_center_samples, data_seed(args) + 30_000, device
    )
    centered = rewards - np.array([baseline[p] for p in flat_p])  # (N,)
    metrics["eval/spearman_gold_centered"] = spearman(centered, gold)
    score_metrics, report = lecture_scores(model, tokenizer, device)
    metrics.update(score_metrics)
    report += (
        "\n\ncalibration of σ(Δr) vs the labeler's true p:\n| bin | pairs | mean σ(Δr) | mean p |\n|---|---|---|---|\n"
    )
    report += "\n".join(f"| {lo:.1f}-{hi:.1f} | {n} | {a:.3f} | {b:.3f} |" for lo, hi, n, a, b in rows)
    return metrics, report


def seed_everything(seed: int) -> None:
    """python's, numpy's and torch's global RNGs from `seed` (at the start of a run, and where a phase restarts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def data_seed(args) -> int:
    """The seed of the data (--data-seed, else --seed): comparisons, labels, demonstrations, held-out pairs."""
    return args.seed if args.data_seed is None else args.data_seed


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
SCRIPT = Path(__file__).stem  # named in summary.json and in the checkpoint
RESUME_FREE_FIELDS = ("cuda", "runs_dir", "save_every", "resume", "threads")  # what a resumed run may change
DIST_TIMEOUT = timedelta(minutes=10)  # a rank waiting this long in a collective gives up (a failed rank never hangs)
AT_LEAST = [  # (least value, Args fields): each a one-line error naming the flag
    (0, "seed data_seed save_every sft_epochs val_prompts sft_learning_rate learning_rate weight_decay center_coef"),
    (1, "threads sft_examples sft_batch_size n_train_prompts eval_episodes epochs batch_size n_center_samples"),
    (1, "n_layer n_embd n_head ensemble_size"),
    (2, "k n_norm_samples"),
]


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work; `--resume`: the run's own args."""
    args, world = tyro.cli(Args), int(os.environ.get("WORLD_SIZE", 1))  # WORLD_SIZE: set by torchrun
    if args.resume is not None and not args.eval_only:  # the run's own args; the command line may only repeat them
        args, saved = resume_args(args)
        if len(saved["rng"]) != world:
            raise SystemExit(f"error: the run used {len(saved['rng'])} processes; resume it with as many")
    examples = args.n_train_prompts * (args.k * (args.k - 1) // 2 if args.loss == "pairwise" else 1)  # (C(K,2) pairs)
    splits = (("--sft-batch-size", args.sft_examples, args.sft_batch_size), ("--batch-size", examples, args.batch_size))
    flag = {field: "--" + field.replace("_", "-") for field in asdict(args)}
    for ok, message in [
        *[((getattr(args, f) or 0) >= n, f"{flag[f]} must be >= {n}") for n, fs in AT_LEAST for f in fs.split()],
        *[(getattr(args, f) > 0, f"{flag[f]} must be > 0") for f in ("temperature", "max_grad_norm")],
        *[(0 <= getattr(args, f) <= 1, f"{flag[f]} must be in [0, 1]") for f in ("flip_prob", "head_only_fraction")],
        (0 <= args.dropout < 1, "--dropout must be in [0, 1)"),
        (args.n_embd % max(args.n_head, 1) == 0, "--n-embd must be divisible by --n-head"),
        (args.margin == 0 or args.loss == "pairwise" or args.kwise_form == "pairs", "--margin is not for softmax"),
        (not (args.eval_only and args.resume), "--eval-only evaluates a saved model: there is nothing to --resume"),
        (not args.eval_only or world == 1, "--eval-only runs in one process (not under torchrun)"),
        (args.checkpoint or not args.eval_only, "--eval-only needs --checkpoint PATH (a run dir or its reward_model/)"),
        (not args.checkpoint or Path(args.checkpoint).exists(), f"--checkpoint {args.checkpoint} does not exist"),
        *[
            (b % world == 0 and not 0 < n % b < world, f"{flag} {b} must split over {world} ranks")
            for flag, n, b in splits
        ],
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    return args


def start_run(args: Args) -> "Run":
    return Run(args)  # torchrun, the device, the run dir (new, or --resume's), tensorboard, Ctrl-C / SIGTERM


class Run:
    """This process under torchrun (rank, world_size, device; DDP), the run dir with tensorboard (rank 0), the
    checkpoint a --resume continues, the Ctrl-C / SIGTERM stop flag while training."""

    def __init__(self, args: Args):
        self.args, self.start_time, self.stop = args, time.time(), {"signal": None, "previous": {}}
        self.rank, self.world_size, self.device = init_torchrun(args.cuda)
        self.ddp = None  # torchrun: the DistributedDataParallel module of data_parallel
        self.checkpoint = read_train_state(Path(args.resume)) if args.resume else None  # (parse_args: not --eval-only)
        self.run_dir, purge = Path(args.resume or "."), None
        if self.checkpoint:  # tensorboard drops what the stopped run logged after its checkpoint (SFT: per epoch)
            saved, self.start_time = self.checkpoint, self.start_time - self.checkpoint["elapsed_s"]
            purge = saved["update"] + (saved["phase"] == "reward")  # SFT logs an epoch after its last checkpoint
        name = f"{TASK_ID}__{args.exp_name}__{args.seed}__{int(time.time())}"
        for suffix in range(0 if self.checkpoint or self.rank else 10**6):  # a new dir (mkdir is atomic): -1, -2, ...
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
        self.writer = SummaryWriter(str(self.run_dir), purge_step=purge) if self.rank == 0 else None
        if self.rank == 0 and not purge:  # the hyperparameter table (a purge from step 0 drops it too)
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        if not args.eval_only:  # Ctrl-C / SIGTERM: a checkpoint at the end of the step, then exit (end_step)
            self.stop = install_stop_handlers()

    def log(self, step: int, metrics: dict) -> None:
        for tag, value in metrics.items() if self.rank == 0 else ():  # tensorboard: a str value as text
            (self.writer.add_text if isinstance(value, str) else self.writer.add_scalar)(tag, value, step)

    def data_parallel(self, forward, *modules: nn.Module):
        """`forward(*modules, ...)` as one call; under torchrun a DistributedDataParallel module: rank 0's weights on
        every rank, and backward() SUMS the ranks' gradients (DDP's default averages them; each shard's loss is its
        share of the global minibatch's mean); it finds parameters a step leaves unused (LP-FT's frozen backbone)."""
        if self.world_size == 1:
            return functools.partial(forward, *modules)
        holder = nn.ModuleList(modules)  # DDP's module: its forward is `forward` over `modules`
        holder.forward = functools.partial(forward, *modules)
        self.ddp = DDP(holder, find_unused_parameters=True)

        def sum_hook(_, bucket):  # DDP's default comm hook, but a sum
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])

        self.ddp.register_comm_hook(None, sum_hook)
        return lambda *inputs: self.ddp(*inputs)  # (end_training lets DDP go: it holds the process group)

    def shard(self, items: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a global minibatch (a short last one split as evenly as it goes)."""
        return items if self.world_size == 1 else items.tensor_split(self.world_size)[self.rank]

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x itself in one process)."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def load_pretrained(self, path: str, kind: Literal["causal", "classifier"]):
        """(model, tokenizer) of a `save_pretrained` dir (--eval-only: a run dir or its reward_model/ dir)."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path) / "reward_model" if (Path(path) / "reward_model").is_dir() else Path(path)
        try:
            cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
            return cls.from_pretrained(path).to(self.device), AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as err:
            raise SystemExit(f"error: cannot load --checkpoint {path}: {str(err).splitlines()[0]}") from None

    def restore(self, state: TrainState) -> int:
        """--resume: the updates done (SFT and reward counted together); the checkpoint loaded into `state` (its fields,
        as state_dicts where they have one, and this rank's RNGs) if it was written in state.phase of state.member."""
        if self.checkpoint and (self.checkpoint["phase"], self.checkpoint["member"]) == (state.phase, state.member):
            for f in dataclasses.fields(state):
                value, saved = getattr(state, f.name), self.checkpoint[f.name]
                value.load_state_dict(saved) if hasattr(value, "load_state_dict") else setattr(state, f.name, saved)
            set_rng_state(self.checkpoint["rng"][self.rank])
        return self.checkpoint["update"] if self.checkpoint else 0

    def end_step(self, step: int, state: TrainState) -> None:
        """After update `step`: the checkpoint every --save-every updates, and on a stop signal to any rank (then every
        rank exits with STOP_EXIT_CODE)."""
        stop = self.global_sum(torch.tensor([float(self.stop["signal"] is not None)], device=self.device)).item() > 0
        if not stop and (self.args.save_every == 0 or step % self.args.save_every):
            return
        rngs = [rng_state()] * self.world_size  # each rank draws from its own RNGs: rank 0 saves them all
        if self.world_size > 1:
            dist.all_gather_object(rngs, rngs[0])
        if self.rank == 0:
            saved = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
            saved = {key: value.state_dict() if hasattr(value, "state_dict") else value for key, value in saved.items()}
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
        """After the last update: Ctrl-C stops at once again; under torchrun rank 0 alone evaluates and saves."""
        restore_signal_handlers(self.stop)
        self.ddp = None  # DDP lets go of the process group
        if self.world_size > 1:
            dist.barrier()  # every rank tears down together (then each frees its gloo threads)
            dist.destroy_process_group()
            if self.rank != 0:
                raise SystemExit(0)

    def finish(self, metrics: dict, models: dict, samples: int) -> None:
        """`models` (save_models), args.json, then summary.json (renamed into place: a run dir with one holds a
        finished run); the checkpoint goes (nothing to resume)."""
        save_models(self.run_dir, models)
        wall = time.time() - self.start_time
        print(json.dumps({k: round(v, 4) for k, v in metrics.items()}, indent=1))
        summary = {"script": SCRIPT, "run_name": self.run_dir.name, "run_dir": str(self.run_dir)}
        summary |= {"args": asdict(self.args), "metrics": metrics, "wall_time_s": wall, "sps": samples / wall}
        (self.run_dir / "args.json").write_text(json.dumps(asdict(self.args), indent=2))
        write_json_atomic(self.run_dir / "summary.json", summary)
        (self.run_dir / TRAIN_STATE).unlink(missing_ok=True)
        self.writer.close()


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
