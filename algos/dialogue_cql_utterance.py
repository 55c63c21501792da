"""Per-utterance CQL for dialogue (CHAI-style): one RL time step = one agent utterance of GuessTheImage.

Lecture part 3: a dialogue is a POMDP over histories with the reward at the end; offline value-based RL learns from
logged conversations. Here the time step is an *utterance*: the horizon is short (<= 8 turns) but the action space is
all token sequences, so max_a Q(s, a) cannot be enumerated. As in CHAI, a BC language model proposes N candidate
utterances for a history, a critic Q(history, utterance) scores them, the Bellman target takes the max over the
*sampled* next candidates, and a CQL penalty keeps Q low on candidates the data does not support; the policy says the
highest-Q of N fresh samples. Claim: like per-token ILQL (`ilql_per_token.py`, the same data and evaluation), it
beats BC and filtered BC: the two scripts measure "per token or per utterance?" (Problem 21.4) on one task.

Key equations (s = history, a = utterance, C(s) = deduplicated set of N samples from pi_BC(.|s)):
  y          = r + gamma * (1 - done) * max_{a' in C(s')} min_{j=1,2} Q_target_j(s', a')      (0 at the dialogue end)
  L_Q        = sum_j (Q_j(s, a) - y)^2
  L_CQL      = sum_j [ logsumexp_{b in C(s) u {a}} Q_j(s, b) - Q_j(s, a) ]                  (CQL(H), Kumar et al.)
  L          = L_Q + alpha * L_CQL;   Q_target <- (1 - tau) Q_target + tau Q                  (Polyak)
  policy     pi(s) = argmax_{b in C_N(s)} min_j Q_j(s, b)                                     (N fresh BC samples)

Implementation details:
  1. BC LM: a tiny GPT-2 trained by next-token cross-entropy on every token, the answerer's replies too (a
     world-model auxiliary that teaches it to read the answers; agent tokens only scored far lower).
  2. Candidates are sampled ONCE per distinct history after BC training, normalized and deduplicated, with a
     `StaticCache` (one forward pass per token for all histories x N); special tokens other than <sep> never.
  3. Critic: each history turn (utterance + reply) is mean-pooled embeddings + a linear layer, a GRU runs over the
     turns, each candidate a GRU over its words; twin MLP heads on [h, u, h * u]. A turn as a unit binds each question
     to its answer (a token GRU over the whole history learned it poorly).
  4. Twin Q heads share the encoders (as in Snell's re-implementation); min over target heads, and when acting.
  5. Truncation after max_turns is terminal (the history shows the turn count; nothing follows).
  6. Evaluation: 500 online episodes, one batched call per turn; also the BC proposer alone (1 sample, no critic).
  7. The acting temperature is chosen on validation episodes (as ILQL chooses beta), which beat a fixed 0.5;
     training candidates are sampled at 0.7: still diverse for the max and the logsumexp, fewer malformed than at 1.
  8. Real checkpoints (`--model-name-or-path`) keep their tokenizer; "<sep>" and "<pad>" are added when missing.
  9. Problem 21.4: `timestep/*` logs the horizon, the action space and the candidate set the Bellman max runs over.
 10. A checkpoint at the phase ends and every `--save-every` critic steps; `--resume` continues exactly.

References:
  [1] Verma, Fu, Yang, Levine 2022, CHAI: A CHatbot AI for Task-Oriented Dialogue with Offline RL (NAACL).
  [2] Kumar, Zhou, Tucker, Levine 2020, Conservative Q-Learning for Offline Reinforcement Learning (CQL(H)).
  [3] Snell et al. 2022, Implicit Language Q Learning; code Sea-Snell/Implicit-Language-Q-Learning
      `src/models/chai_model.py` (the CHAI baseline re-implementation). [4] vwxyzjn/cleanrl `dqn.py` (layout).
Details, measurements, usage (--resume, real models): docs/dialogue_cql_utterance.md.
Reproduce: python algos/dialogue_cql_utterance.py --seed 1
"""

import copy
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
import tyro
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file, save_model
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make `envs/` importable as `python algos/x.py`
import envs  # noqa: E402,F401  (registers the seqrl/ environments)
import envs.guess_image as G  # noqa: E402
from envs.tokenizer import build_tokenizer  # noqa: E402

TASK_ID = "seqrl/GuessTheImage-v0"  # the task name in the run dir
SEP_TOKEN, PAD_TOKEN = "<sep>", "<pad>"  # added to a checkpoint's tokenizer that lacks a turn separator / pad token
MASKED_Q = -1e9  # value given to padded candidate slots before a max / logsumexp
BC_SORT_BLOCK = 32  # BC minibatches are formed from length-sorted blocks of 32 minibatches (less padding)
BC_WARMUP_STEPS = 50  # linear learning-rate warmup of the BC LM (then cosine decay to 0)
LM_POSITIONS = 256  # GPT-2 context: 8 turns of 12-word (malformed) utterances + replies + a 13-token sample < 256


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (models, minibatches, candidate sampling)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = False
    """use the GPU if `--cuda` and one is available"""
    threads: int = 1
    """torch CPU threads: 1 lets runs side by side share the cores; more can speed up one run of a real model alone"""
    runs_dir: str = "runs"
    """where run directories are created"""
    eval_episodes: int = 500
    """online evaluation episodes against the scripted answerer (secrets stratified over the 18 objects)"""
    eval_seed: int = 0
    """seed of `G.evaluate_policy` (the secrets' order); the same for every method of the table"""
    val_episodes: int = 180
    """online validation episodes per acting temperature, used only to choose it (10 per object)"""
    val_seed: int = 1
    """seed of the validation episodes (a different secret order than the test episodes)"""
    eval_only: bool = False
    """only evaluate the run dir given by `--checkpoint` (its bc_lm/ and critic.safetensors)"""
    checkpoint: str | None = None
    """a run dir written by this script, for `--eval-only`"""
    save_every: int = 500
    """critic steps between saves of the checkpoint RUN_DIR/train_state.safetensors; with N > 0 the end of the BC and
    the candidate phases saves it too (0 = none; Ctrl-C or SIGTERM always saves it, at the end of the current phase
    or after the current critic step): all that `--resume` needs to continue exactly; deleted when the run ends"""
    resume: str | None = None
    """a run dir of this script with a checkpoint: continue that run there, with its own arguments"""

    # data (identical defaults to ilql_per_token.py: the same offline dataset)
    dataset_size: int = 20000
    """dialogues generated by `G.make_dataset` (default behavior mixture) when no --dataset-path is given"""
    dataset_seed: int = 1
    """seed of `G.make_dataset`"""
    dataset_path: str | None = None
    """a JSONL file written by `G.write_dataset` (used instead of generating the dataset)"""

    # STEP 1: the BC utterance model (proposer)
    model_name_or_path: str | None = None
    """base causal LM to fine-tune as the proposer: a save_pretrained dir or a hub id (gpt2, EleutherAI/pythia-70m,
    ...), kept with its own tokenizer ("<sep>" / "<pad>" added when missing, detail 8); None: a tiny GPT-2 built from
    a config over the built-in word-level tokenizer"""
    n_embd: int = 64
    """width of the tiny GPT-2"""
    n_layer: int = 2
    """layers of the tiny GPT-2"""
    n_head: int = 4
    """attention heads of the tiny GPT-2"""
    bc_epochs: int = 10
    """passes of next-token cross-entropy over all dialogues (every token, or agent tokens with --no-bc-all-tokens)"""
    bc_lr: float = 3e-3
    """peak AdamW learning rate of the BC LM (linear warmup, cosine decay to 0)"""
    bc_batch_size: int = 64
    """distinct dialogues per BC minibatch (each weighted by its count)"""
    bc_all_tokens: bool = True
    """train the proposer on every next token, the answerer's replies too (a world-model auxiliary, as
    `ilql_per_token.py --lm-all-tokens`); sampling only ever writes agent tokens. False = agent tokens only"""
    belief_coef: float = 1.0
    """weight of the BC LM's belief auxiliary: a linear head on the last hidden state predicts the logged secret
    object from every prefix (cross-entropy; its minimizer is the posterior over the 18 objects, the belief state).
    The secret is read from the offline logs during training only. It teaches the proposer to read the answers, and
    the critic's choice improves with it. 0 = off"""

    # STEP 2: candidates
    n_candidates: int = 16
    """N: utterances sampled from the BC LM per history (training targets, CQL set and acting), then deduplicated"""
    temperature: float = 0.7
    """sampling temperature of the proposer for the training candidates (and the proposer-alone baseline); 1.0 gives
    fewer well-formed candidates to learn from (details 7)"""
    act_temperatures: tuple[float, ...] = (1.0, 0.7, 0.5, 0.3)
    """proposer temperatures swept when acting (N samples, critic argmax); the best on validation is the headline"""
    gen_batch_size: int = 256
    """histories per generation batch (each expanded to N samples; K/V buffers ~ 22 MB per 256 x 8 rows)"""

    # STEP 3: the critic
    critic_dim: int = 64
    """word embedding and GRU width of the critic's history and utterance encoders"""
    critic_hidden: int = 128
    """hidden width of each twin Q head"""
    critic_steps: int = 2000
    """gradient steps of the critic"""
    batch_size: int = 256
    """transitions (history, utterance, reward, next history) per critic minibatch"""
    critic_lr: float = 1e-3
    """Adam learning rate of the critic"""
    gamma: float = 0.99
    """discount per utterance (Snell et al.'s value)"""
    cql_alpha: float = 0.5
    """weight of the CQL penalty logsumexp_C Q - Q(data) (0 = plain fitted Q-iteration over BC samples)"""
    tau: float = 0.02
    """Polyak rate of the target critic, every step"""
    max_grad_norm: float = 1.0
    """gradient clipping of the critic"""
    log_every: int = 100
    """critic steps between loss logs"""

    # filled in at runtime
    n_states: int = 0
    """distinct non-final histories of the dataset"""
    n_transitions: int = 0
    """utterances (turns) in the dataset"""


# ---------------------------------------------------------------------------------------------------------------
# Pure functions (losses, targets, candidate sets): imported by the tests
# ---------------------------------------------------------------------------------------------------------------
def dedupe_utterances(samples: list[str], data_utterance: str | None = None) -> list[str]:
    """Normalised, deduplicated candidate set in first-seen order; the data utterance (if given) first."""
    seen = [] if data_utterance is None else [G.normalize_utterance(data_utterance)]
    for s in samples:
        u = G.normalize_utterance(s)
        if u not in seen:
            seen.append(u)
    return seen


def with_data_first(sampled_idx: torch.Tensor, data_idx: torch.Tensor) -> torch.Tensor:
    """The CQL candidate set C(s) u {a}: (B, K) sampled utterance ids (-1 = padding), (B,) data ids -> (B, K + 1)
    with the data utterance in column 0 and its duplicates among the samples replaced by -1 (a set, not a bag)."""
    sampled = sampled_idx.masked_fill(sampled_idx == data_idx[:, None], -1)  # (B, K)
    return torch.cat([data_idx[:, None], sampled], dim=1)  # (B, K + 1)


# not ilql_per_token's token_cql_penalty: here over a sampled candidate set, with padded slots masked
def candidate_cql_penalty(q_cands: torch.Tensor, cand_mask: torch.Tensor, q_data: torch.Tensor) -> torch.Tensor:
    """CQL(H) per state: logsumexp over the valid candidates (B, K) of Q minus Q of the data utterance (B,)."""
    return torch.logsumexp(q_cands.masked_fill(~cand_mask, MASKED_Q), dim=1) - q_data  # (B,)


# not dqn_framestack's td_target: the max runs over the sampled next candidates, min over the twin targets
def candidate_td_target(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    next_q_target: torch.Tensor,
    next_mask: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """y = r + gamma (1 - done) max_{a' in C(s')} min_j Q_target_j(s', a').

    rewards, dones: (B,); next_q_target: (B, K, 2) twin target Q of the sampled next candidates; next_mask (B, K).
    A state without any valid candidate (only possible at done) contributes 0."""
    min_q = next_q_target.min(dim=-1).values.masked_fill(~next_mask, MASKED_Q)  # (B, K)
    max_q = min_q.max(dim=1).values  # (B,)
    has_next = next_mask.any(dim=1) & ~dones
    return rewards + gamma * torch.where(has_next, max_q, torch.zeros_like(max_q))


@torch.no_grad()
def polyak_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """target <- (1 - tau) target + tau online (tau = 1: hard copy)."""
    for t, o in zip(target.parameters(), online.parameters(), strict=True):
        t.mul_(1.0 - tau).add_(o, alpha=tau)


# ---------------------------------------------------------------------------------------------------------------
# Critic
# ---------------------------------------------------------------------------------------------------------------
class UtteranceCritic(nn.Module):
    """Q(history, utterance) with twin MLP heads on [h, u, h*u]. Shared word embeddings; a turn (agent utterance +
    reply, e.g. "is it big ? yes , it is big .") is mean-pooled word embeddings + a linear layer + ReLU; a candidate
    is a GRU over its words (order-sensitive, so malformed word salads differ from valid utterances); the history
    is a GRU over its turn vectors (a learned start vector first, so the empty history has
    length 1). Reading a turn as one unit binds each question to its answer, which a token-level GRU must learn."""

    def __init__(self, vocab_size: int, dim: int, hidden: int, pad_id: int):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.turn_proj = nn.Sequential(nn.Linear(dim, dim), nn.ReLU())
        self.utterance_rnn = nn.GRU(dim, dim, batch_first=True)  # word order matters: "is it is the ..." is invalid
        self.start = nn.Parameter(torch.zeros(dim))
        self.history_rnn = nn.GRU(dim, dim, batch_first=True)
        self.heads = nn.ModuleList(
            nn.Sequential(
                nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
            )
            for _ in range(2)
        )

    def _pool(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids (N, L) right-padded, lengths (N,) >= 1 -> mean word embedding (N, D)."""
        return self.embed(ids).sum(1) / lengths[:, None].to(self.start.dtype).to(ids.device)

    def encode_turns(self, ids, lengths):
        return self.turn_proj(self._pool(ids, lengths))  # (N, D)

    def encode_utterances(self, ids, lengths):
        """ids (N, L) right-padded, lengths (N,) >= 1 -> final GRU state (N, D)."""
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(ids), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        return self.utterance_rnn(packed)[1][0]  # h_n: (1, N, D) -> (N, D)

    def encode_histories(self, turn_vecs: torch.Tensor, turn_idx: torch.Tensor, n_turns: torch.Tensor):
        """turn_vecs (U, D) encoded turns, turn_idx (B, T) ids into them (-1 = padding), n_turns (B,) -> (B, D)."""
        x = turn_vecs[turn_idx.clamp(min=0)]  # (B, T, D)
        x = torch.cat([self.start.expand(len(x), 1, -1), x], dim=1)  # (B, T + 1, D)
        packed = nn.utils.rnn.pack_padded_sequence(x, (n_turns + 1).cpu(), batch_first=True, enforce_sorted=False)
        return self.history_rnn(packed)[1][0]  # h_n: (1, B, D) -> (B, D)

    def q_values(self, h: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """h (B, D) histories, u (B, K, D) candidates -> (B, K, 2) twin Q values."""
        h = h[:, None].expand_as(u)  # (B, K, D)
        x = torch.cat([h, u, h * u], dim=-1)  # (B, K, 3D)
        return torch.cat([head(x) for head in self.heads], dim=-1)  # (B, K, 2)


def history_turn_ids(histories, table) -> tuple[torch.Tensor, torch.Tensor]:
    """Histories (lists of (agent, reply)) -> turn ids (N, max turns) into `table` (-1 = padding), n_turns (N,)."""
    n_turns = torch.tensor([len(h) for h in histories], dtype=torch.long)
    idx = torch.full((len(histories), max(1, int(n_turns.max()))), -1, dtype=torch.long)
    for i, h in enumerate(histories):
        for k, (agent, reply) in enumerate(h):
            idx[i, k] = table.add(f"{G.normalize_utterance(agent)} {reply}")
    return idx, n_turns


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists -> ids (N, L), lengths (N,)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max())
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long), lengths


# ---------------------------------------------------------------------------------------------------------------
# BC LM: build, train, sample
# ---------------------------------------------------------------------------------------------------------------
def build_proposer(args):
    """The proposer and its tokenizer: a tiny GPT-2 from a config over the built-in word-level tokenizer, or the
    pretrained `--model-name-or-path` (a save_pretrained dir or a hub id) with its own tokenizer, weights kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    if args.model_name_or_path is None:
        tokenizer = build_tokenizer()
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=LM_POSITIONS,
            n_embd=args.n_embd,
            n_layer=args.n_layer,
            n_head=args.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,  # no dropout: tiny model, big data
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return GPT2LMHeadModel(config), tokenizer
    path = args.model_name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        lm = AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(
            f"error: could not load --model-name-or-path '{path}' (a save_pretrained dir, or a hub id that is in the "
            f"local Hugging Face cache when offline): {str(e).strip().splitlines()[0]}"
        ) from None
    added = add_dialogue_tokens(tokenizer, lm)
    print(f"loaded {type(lm).__name__} from '{path}'; added special tokens {added}", flush=True)
    return lm, tokenizer


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


def n_logits(lm) -> int:
    """Rows of the LM head (the tokenizer's size, or more for checkpoints that pad their embedding table)."""
    return lm.get_output_embeddings().weight.shape[0]


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


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1, clamped at 0: positions that ignore left padding."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def dedupe_dialogues(tokenized: list[dict], secrets=None) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """Identical dialogues (same token ids and, if given, the same logged secret) merged into one with a count:
    (distinct dialogues, counts (D,), secrets (D,) or -1). A count-weighted loss over them equals the loss over all
    dialogues (20k dialogues -> ~11k distinct)."""
    secrets = np.full(len(tokenized), -1) if secrets is None else np.asarray(secrets)
    index: dict[tuple, int] = {}
    distinct, counts, distinct_secrets = [], [], []
    for d, secret in zip(tokenized, secrets, strict=True):
        key = (d["input_ids"].tobytes(), int(secret))
        if key not in index:
            index[key] = len(distinct)
            distinct.append(d)
            counts.append(0)
            distinct_secrets.append(int(secret))
        counts[index[key]] += 1
    return distinct, np.asarray(counts, dtype=np.float32), np.asarray(distinct_secrets, dtype=np.int64)


def bc_loss(logits: torch.Tensor, ids: torch.Tensor, agent: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Count-weighted next-token NLL on the agent tokens: logits (B, L, V), ids (B, L), agent (B, L) bool (the
    action of position i is token i + 1), weights (B,) dialogue counts. Mean NLL per agent token of the data."""
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (B, L - 1)
    mask = agent[:, 1:].float() * weights[:, None]  # (B, L - 1)
    return (nll * mask).sum() / mask.sum()


# not ilql_per_token's belief_loss: each distinct dialogue is weighted by its count (`dedupe_dialogues`)
def weighted_belief_loss(
    belief_logits: torch.Tensor, secret: torch.Tensor, real: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Count-weighted cross-entropy of the logged secret from every real prefix: belief_logits (B, L, N_OBJECTS),
    secret (B,), real (B, L) bool, weights (B,). Minimized by p(secret | prefix), the belief over the 18 objects."""
    target = secret[:, None].expand(-1, belief_logits.shape[1])  # (B, L)
    nll = F.cross_entropy(belief_logits.transpose(1, 2), target, reduction="none")  # (B, L)
    mask = real.float() * weights[:, None]  # (B, L)
    return (nll * mask).sum() / mask.sum()


def train_bc(lm, tokenized: list[dict], secrets, args, device, log, pad_id: int):
    """STEP 1: next-token cross-entropy on every token (or the agent tokens) of every dialogue, plus the belief
    auxiliary. Identical dialogues are merged with their counts as weights; AdamW with linear warmup, cosine decay.
    `log(step, metrics)` records the curves. Returns the trained LM and its BC NLL over the first and the last 10%
    of the steps."""
    tokenized, counts, secrets = dedupe_dialogues(tokenized, secrets)
    n = len(tokenized)
    n_batches = math.ceil(n / args.bc_batch_size)
    total_steps = max(1, args.bc_epochs * n_batches)
    belief_head = nn.Linear(lm.config.hidden_size, G.N_OBJECTS).to(device)  # training-only auxiliary head
    optimizer = torch.optim.AdamW([*lm.parameters(), *belief_head.parameters()], lr=args.bc_lr, weight_decay=0.0)
    warmup = min(BC_WARMUP_STEPS, total_steps // 10 + 1)
    schedule = lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / total_steps)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    rng = np.random.default_rng(args.seed)
    lengths = np.array([len(d["input_ids"]) for d in tokenized])
    print(f"[bc] {n} distinct dialogues (of {int(counts.sum())}), {total_steps} steps", flush=True)
    step, loss_bc, nll_curve = 0, torch.tensor(float("nan")), []
    loss_belief = torch.tensor(float("nan"))
    for epoch in range(args.bc_epochs):
        perm = rng.permutation(n)
        block = args.bc_batch_size * BC_SORT_BLOCK  # sort by length inside shuffled blocks: less padding
        perm = np.concatenate(
            [p[np.argsort(lengths[p], kind="stable")] for p in np.split(perm, range(block, n, block))]
        )
        for start in rng.permutation(np.arange(0, n, args.bc_batch_size)):
            rows = perm[start : start + args.bc_batch_size]
            ids, _ = pad_rows([tokenized[i]["input_ids"].tolist() for i in rows], pad_id)  # (B, L)
            if args.bc_all_tokens:
                agent = ids != pad_id  # (B, L): every real token is a target
            else:
                agent = pad_rows([tokenized[i]["agent_mask"].tolist() for i in rows], 0)[0].bool()  # (B, L)
            ids, agent, weights = ids.to(device), agent.to(device), torch.from_numpy(counts[rows]).to(device)
            use_belief = args.belief_coef > 0
            out = lm(input_ids=ids, attention_mask=(ids != pad_id).long(), output_hidden_states=use_belief)
            loss = loss_bc = bc_loss(out.logits, ids, agent, weights)  # logits (B, L, V)
            if use_belief:  # hidden_states[-1]: the final (normed) hidden state (B, L, d)
                secret = torch.from_numpy(secrets[rows]).to(device)  # (B,)
                loss_belief = weighted_belief_loss(belief_head(out.hidden_states[-1]), secret, ids != pad_id, weights)
                loss = loss + args.belief_coef * loss_belief
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_([*lm.parameters(), *belief_head.parameters()], 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            nll_curve.append(loss_bc.item())
            if step % 50 == 0:
                curves = {"losses/bc_nll": loss_bc.item(), "charts/bc_learning_rate": scheduler.get_last_lr()[0]}
                log(step, curves | ({"losses/belief_nll": loss_belief.item()} if use_belief else {}))
        belief_text = f" belief nll {loss_belief.item():.3f}" if args.belief_coef > 0 else ""
        print(f"[bc] epoch {epoch} nll {loss_bc.item():.3f}{belief_text}", flush=True)
    window = max(1, len(nll_curve) // 10)  # the first and the last 10% of the steps
    if not nll_curve:  # --bc-epochs 0
        return lm, {}
    return lm, {"model/bc_nll_start": np.mean(nll_curve[:window]), "model/bc_nll_end": np.mean(nll_curve[-window:])}


@torch.no_grad()
def sample_utterances(
    lm,
    tokenizer,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    device,
    generator: torch.Generator,
    batch_size: int,
) -> list[list[str]]:
    """n sampled utterances for each prompt: tokens up to the agent's separator, never a banned special token,
    decoded without special tokens and normalised (`G.normalize_utterance`); temperature 0 = greedy (argmax).

    The prompts (left-padded) are encoded once into a transformers `StaticCache` (K/V buffers preallocated for the
    prompt and the utterance budget, any architecture), whose rows are then repeated n times (`reorder_cache`);
    each sampled token's keys/values are written into it in place, one forward pass per token for all B * n rows."""
    from transformers import StaticCache

    pad, sep = tokenizer.pad_token_id, tokenizer.sep_token_id
    banned = banned_token_mask(tokenizer, n_logits(lm)).to(device)
    steps = utterance_budget(tokenizer)
    out: list[list[str]] = []
    for begin in range(0, len(prompts), batch_size):
        chunk = prompts[begin : begin + batch_size]
        B, Lp = len(chunk), max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (Lp - len(p)) + p for p in chunk], device=device)  # (B, Lp) left-padded
        mask = torch.tensor([[0] * (Lp - len(p)) + [1] * len(p) for p in chunk], device=device)  # (B, Lp)
        positions = position_ids_from_mask(mask)  # (B, Lp)
        cache = StaticCache(config=lm.config, max_cache_len=Lp + steps)
        prefill = lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1)
        cache.reorder_cache(torch.arange(B, device=device).repeat_interleave(n))  # the prompt's K/V, n rows each
        logits = prefill.logits[:, -1].repeat_interleave(n, dim=0)  # (B * n, V): only the last position's logits
        mask, pos = mask.repeat_interleave(n, dim=0), positions[:, -1:].repeat_interleave(n, dim=0)  # (B * n, .)
        done = torch.zeros(B * n, dtype=torch.bool, device=device)
        tokens = []
        for t in range(steps):
            logits = logits.masked_fill(banned, float("-inf"))  # CRUCIAL: pad/bos/eos/unk are not text
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)  # (B * n,)
            else:
                token = logits.argmax(dim=-1)
            token = torch.where(done, torch.full_like(token, pad), token)
            tokens.append(token)
            done = done | (token == sep)
            if done.all() or t == steps - 1:
                break
            mask, pos = F.pad(mask, (0, 1), value=1), pos + 1  # (B * n, Lp + t + 1), (B * n, 1)
            step = lm(input_ids=token[:, None], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
            logits = step.logits[:, -1]  # (B * n, V)
        rows = torch.stack(tokens, dim=1).tolist()  # (B * n, <= steps)
        texts = []
        for row in rows:
            row = row[: row.index(sep)] if sep in row else [t for t in row if t != pad]
            texts.append(G.normalize_utterance(tokenizer.decode(row, skip_special_tokens=True)))
        out += [texts[i * n : (i + 1) * n] for i in range(B)]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Data: histories, transitions, utterance table
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


class UtteranceTable:
    """Every distinct utterance string seen so far -> integer id, with its token ids (for the utterance GRU)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.tokens = tokenizer, {}, []

    def add(self, text: str) -> int:
        if text not in self.ids:
            self.ids[text] = len(self.tokens)
            toks = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self.tokens.append(toks if toks else [self.tokenizer.unk_token_id])
        return self.ids[text]

    def tensors(self, device):
        ids, lengths = pad_rows(self.tokens, self.tokenizer.pad_token_id)
        return ids.to(device), lengths

    def state_dict(self) -> dict:
        return {"utterances": list(self.ids)}

    def load_state_dict(self, state: dict) -> None:
        """The saved utterances, of which those already here (the data's, added first) must be the first."""
        if state["utterances"][: len(self.tokens)] != list(self.ids):
            raise ValueError("the dataset's utterances differ from the saved table's")
        for utterance in state["utterances"][len(self.tokens) :]:
            self.add(utterance)


def build_transitions(dialogues, tokenizer, table: UtteranceTable):
    """Distinct non-final histories (states) and one transition per turn: (s, a, r, done, s')."""
    state_ids: dict[tuple, int] = {}
    states: list[list[tuple[str, str]]] = []
    s_idx, a_idx, rewards, dones, s2_idx = [], [], [], [], []

    def state(history):
        key = tuple(history)
        if key not in state_ids:
            state_ids[key] = len(states)
            states.append(list(history))
        return state_ids[key]

    for d in dialogues:
        history = []
        for k, t in enumerate(d["turns"]):
            agent = G.normalize_utterance(t["agent"])
            s = state(history)
            history = history + [(agent, t["reply"])]
            last = k == len(d["turns"]) - 1
            s_idx.append(s)
            a_idx.append(table.add(agent))
            rewards.append(float(t["reward"]))
            dones.append(last)
            s2_idx.append(s if last else state(history))  # a dummy (masked by done) at the dialogue end
    cache: dict = {}
    prompts = [G.tokenize_prompt(h, tokenizer, cache) for h in states]
    return (
        states,
        prompts,
        {
            "s": torch.tensor(s_idx),
            "a": torch.tensor(a_idx),
            "r": torch.tensor(rewards, dtype=torch.float32),
            "done": torch.tensor(dones),
            "s2": torch.tensor(s2_idx),
        },
    )


# ---------------------------------------------------------------------------------------------------------------
# Acting: BC proposals scored by the critic
# ---------------------------------------------------------------------------------------------------------------
class CriticPolicy:
    """`act_batch(histories)` for `G.evaluate_policy`: N BC samples per history, the highest min-twin-Q one
    (critic None or N = 1: the BC proposer alone)."""

    def __init__(self, lm, critic, tokenizer, n: int, temperature: float, device, seed: int, batch_size: int):
        self.lm, self.critic, self.tokenizer, self.n = lm, critic, tokenizer, n
        self.temperature, self.device, self.batch_size = temperature, device, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.cache: dict = {}

    @torch.no_grad()
    def act_batch(self, histories):
        prompts = [G.tokenize_prompt(h, self.tokenizer, self.cache) for h in histories]
        samples = sample_utterances(
            self.lm, self.tokenizer, prompts, self.n, self.temperature, self.device, self.generator, self.batch_size
        )
        if self.critic is None or self.n == 1:
            return [s[0] for s in samples]
        cands = [dedupe_utterances(s) for s in samples]
        table = UtteranceTable(self.tokenizer)
        cand_idx = torch.full((len(cands), self.n), -1, dtype=torch.long)
        for i, cs in enumerate(cands):
            cand_idx[i, : len(cs)] = torch.tensor([table.add(c) for c in cs])
        u_ids, u_len = table.tensors(self.device)
        turns = UtteranceTable(self.tokenizer)
        turn_idx, n_turns = history_turn_ids(histories, turns)
        t_ids, t_len = turns.tensors(self.device) if turns.tokens else (None, None)
        t_vecs = self.critic.encode_turns(t_ids, t_len) if t_ids is not None else self.critic.start[None]
        h = self.critic.encode_histories(t_vecs, turn_idx.to(self.device), n_turns)  # (B, D)
        u = self.critic.encode_utterances(u_ids, u_len)  # (U, D)
        q = self.critic.q_values(h, u[cand_idx.clamp(min=0).to(self.device)]).min(dim=-1).values  # (B, N)
        best = q.masked_fill(cand_idx.to(self.device) < 0, MASKED_Q).argmax(dim=1).tolist()
        return [cs[b] for cs, b in zip(cands, best, strict=True)]


def evaluate(policy, n_episodes: int, seed: int) -> dict:
    res = G.evaluate_policy(policy, n_episodes=n_episodes, seed=seed, return_dialogues=True)
    turns = [t for d in res["dialogues"] for t in d["turns"]]
    return {
        "success_rate": res["success_rate"],
        "episodic_return": res["mean_return"],
        "episodic_return_std": res["return_std"],
        "episodic_length": res["mean_length"],
        "normalized_score": G.normalized_score(res["mean_return"]),
        # fraction of the agent's turns the answerer understood (one of the 26 valid utterances)
        "valid_utterance_rate": sum(t["reply"] != G.NOT_UNDERSTOOD for t in turns) / max(len(turns), 1),
        # where the points go: outcome shares and wasted turns per dialogue (G.failure_kinds)
        **{f"outcome/{k}": v for k, v in G.failure_kinds(res["dialogues"]).items()},
    }


# not ilql_per_token's timestep_stats: here one RL step is an utterance, not a token
def utterance_timestep_stats(dialogues, tokenizer, lm, cand: torch.Tensor, tr: dict) -> dict:
    """Lecture Problem 21.4, per utterance: the RL horizon is the number of agent turns of a dialogue; the action
    space of one step is every token sequence up to the utterance budget (W^L for W writable tokens, L tokens before
    the separator: astronomically many), of which the data uses a few dozen distinct utterances, and the Bellman
    max runs over the deduplicated candidate set C(s') of N samples (its mean size is `actions_per_step`)."""
    turns = torch.tensor([len(d["turns"]) for d in dialogues], dtype=torch.float32)
    writable = int((~banned_token_mask(tokenizer, n_logits(lm))).sum())
    return {
        "timestep/rl_steps_per_dialogue": float(turns.mean()),
        "timestep/rl_steps_per_dialogue_max": float(turns.max()),
        "timestep/vocab_size": float(len(tokenizer)),
        "timestep/action_space_log10": (utterance_budget(tokenizer) - 1) * math.log10(writable),
        "timestep/actions_per_step": float((cand >= 0).sum(dim=1).float().mean()),
        "timestep/distinct_data_utterances": float(len(set(tr["a"].tolist()))),
        "timestep/distinct_candidate_utterances": float(len(set(cand[cand >= 0].tolist()))),
    }


# ---------------------------------------------------------------------------------------------------------------
# Training: STEP 0-3 in main(); STEP 4, the evaluation, follows it
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """What one phase hands to the next: all that a checkpoint holds for `--resume` (None: not made yet)."""

    phase: str | None  # the last phase done: None, "bc", "candidates" or "critic"
    lm: nn.Module  # the proposer (frozen after the BC phase)
    table: UtteranceTable  # utterance string -> id: the data's utterances first, then the sampled ones
    bc_nll: dict = field(default_factory=dict)  # the BC fit (model/bc_nll_start, model/bc_nll_end)
    timings: dict = field(default_factory=dict)  # wall seconds of each phase
    cand: torch.Tensor | None = None  # (S, N) sampled candidate ids of each distinct history (-1 = padding)
    critic: nn.Module | None = None
    target: nn.Module | None = None  # the Polyak target critic
    optimizer: torch.optim.Optimizer | None = None
    rng: np.random.Generator | None = None  # the critic's minibatches


def main():
    args = parse_args()  # tyro + validation; --resume: the run's own arguments
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    dialogues = load_dialogues(args)
    data_stats = G.dataset_stats(dialogues)
    if args.eval_only:  # STEP 4 alone, on the proposer, tokenizer and critic of a finished run (--checkpoint)
        run = start_run(args)
        lm, tokenizer = run.load_pretrained(str(Path(args.checkpoint) / "bc_lm"), "causal")
        critic = UtteranceCritic(len(tokenizer), args.critic_dim, args.critic_hidden, tokenizer.pad_token_id)
        critic = run.load_model(critic).to(run.device)
        metrics = evaluate_agents(lm, critic, tokenizer, args, run.device, data_stats)
        run.log(0, metrics | headline_charts(metrics))
        run.finish(metrics, {}, samples=0)
        return

    # STEP 0: the proposer to train and its tokenizer (built-in, or the checkpoint's own + <sep>/<pad>, detail 8);
    # the distinct histories (states), one transition per turn and the utterance table (the data utterances first)
    lm, tokenizer = build_proposer(args)
    table = UtteranceTable(tokenizer)
    states, prompts, tr = build_transitions(dialogues, tokenizer, table)
    args.n_states, args.n_transitions = len(states), len(tr["s"])
    run = start_run(args)  # device, run dir (new, or the resumed one), tensorboard, Ctrl-C / SIGTERM handlers
    device = run.device
    lm = lm.to(device)
    print(f"run dir {run.run_dir}; dataset: {data_stats['n']} dialogues, mean return {data_stats['mean_return']:.3f}")
    # --resume: the phases done, as the checkpoint left them (the proposer's weights, the table, the candidates and
    # the RNG states restored into `state`)
    state = TrainState(phase=None, lm=lm, table=table)
    run.restore(state)

    # STEP 1: the BC utterance model
    if state.phase is None:
        t0 = time.time()
        secrets = [d["secret_id"] for d in dialogues] if args.belief_coef > 0 else None
        tokenized = G.tokenize_dialogues(dialogues, tokenizer)
        lm, state.bc_nll = train_bc(lm, tokenized, secrets, args, device, run.log, tokenizer.pad_token_id)
        state.phase, state.timings = "bc", {"bc_s": time.time() - t0}
        print(f"[bc] trained in {state.timings['bc_s']:.0f}s", flush=True)
        run.end_step(0, state)  # a checkpoint with --save-every > 0, and one after Ctrl-C / SIGTERM (then exit)
    lm.eval()  # frozen from here on
    timings = state.timings  # wall time of each phase

    # STEP 2: N candidate utterances per distinct history, sampled once, deduplicated
    if state.phase == "bc":
        t0 = time.time()
        generator = torch.Generator().manual_seed(args.seed)
        samples = sample_utterances(
            lm, tokenizer, prompts, args.n_candidates, args.temperature, device, generator, args.gen_batch_size
        )
        cand = torch.full((len(states), args.n_candidates), -1, dtype=torch.long)  # (S, N) sampled set C(s)
        for i, s in enumerate(samples):
            cs = dedupe_utterances(s)
            cand[i, : len(cs)] = torch.tensor([table.add(c) for c in cs])
        coverage = (cand[tr["s"]] == tr["a"][:, None]).any(dim=1).float().mean().item()
        set_size = (cand >= 0).sum(dim=1).float().mean().item()
        timings["candidates_s"] = time.time() - t0
        print(
            f"[candidates] {len(states)} histories x {args.n_candidates} samples in {timings['candidates_s']:.0f}s;"
            f" mean set size {set_size:.2f}; data utterance sampled for {coverage:.1%} of transitions; "
            f"{len(table.tokens)} distinct utterances",
            flush=True,
        )
        run.log(0, {"charts/candidate_set_size": set_size, "charts/data_utterance_coverage": coverage})
        state.phase, state.cand = "candidates", cand
        run.end_step(0, state)  # a checkpoint with --save-every > 0, and one after Ctrl-C / SIGTERM (then exit)
    cand = state.cand
    problem = {**utterance_timestep_stats(dialogues, tokenizer, lm, cand, tr), **state.bc_nll}  # Problem 21.4 + BC fit

    # STEP 3: the critic with twin Q heads, a Polyak target and the CQL penalty
    critic = UtteranceCritic(len(tokenizer), args.critic_dim, args.critic_hidden, tokenizer.pad_token_id).to(device)
    target = copy.deepcopy(critic)
    for p in target.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.Adam(critic.parameters(), lr=args.critic_lr)
    turns = UtteranceTable(tokenizer)  # every distinct (utterance, reply) turn of the dataset, a few hundred
    turn_idx_all, n_turns_all = history_turn_ids(states, turns)  # (S, max turns), (S,)
    t_ids, t_len = turns.tensors(device)
    u_ids, u_len = table.tensors(device)
    cql_cands = with_data_first(cand[tr["s"]], tr["a"])  # (T, N + 1): C(s) u {a}, data first
    rng = np.random.default_rng(args.seed)  # the critic's minibatches
    state.phase, state.critic, state.target, state.optimizer, state.rng = "critic", critic, target, optimizer, rng
    steps_done = run.restore(state)  # --resume after critic step k: k (its critic, target, Adam and rng restored)
    t0 = time.time() - timings.get("critic_s", 0.0)
    for step in range(steps_done + 1, args.critic_steps + 1):
        b = torch.from_numpy(rng.integers(0, len(tr["s"]), size=args.batch_size))  # (B,)
        s, s2 = tr["s"][b], tr["s2"][b]
        ns, ns2 = n_turns_all[s], n_turns_all[s2]  # (B,)
        hs = turn_idx_all[s, : max(1, int(ns.max()))].to(device)  # (B, T) turn ids
        hs2 = turn_idx_all[s2, : max(1, int(ns2.max()))].to(device)
        cq = cql_cands[b].to(device)  # (B, N + 1)
        nc = cand[s2].to(device)  # (B, N) sampled next candidates (no data utterance)
        # encode only the utterances this minibatch uses (the sampled table can hold thousands of strings)
        used, inverse = torch.unique(torch.cat([cq.flatten(), nc.flatten()]).clamp(min=0), return_inverse=True)
        cq_u, nc_u = inverse[: cq.numel()].view_as(cq), inverse[cq.numel() :].view_as(nc)  # ids into `used`
        # ALGO LOGIC: target y = r + gamma (1 - done) max over sampled next candidates of min target Q
        with torch.no_grad():
            q_next = target.q_values(
                target.encode_histories(target.encode_turns(t_ids, t_len), hs2, ns2),
                target.encode_utterances(u_ids[used], u_len[used])[nc_u],
            )  # (B, N, 2)
            y = candidate_td_target(tr["r"][b].to(device), tr["done"][b].to(device), q_next, nc >= 0, args.gamma)
        q = critic.q_values(
            critic.encode_histories(critic.encode_turns(t_ids, t_len), hs, ns),
            critic.encode_utterances(u_ids[used], u_len[used])[cq_u],
        )  # (B, N + 1, 2)
        q_data = q[:, 0]  # (B, 2): Q of the dataset utterance
        q_loss = ((q_data - y[:, None]) ** 2).mean(0).sum()
        cql = sum(candidate_cql_penalty(q[..., j], cq >= 0, q_data[:, j]).mean() for j in range(2))
        loss = q_loss + args.cql_alpha * cql
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
        optimizer.step()
        polyak_update(target, critic, args.tau)
        timings["critic_s"] = time.time() - t0  # (a checkpoint keeps it)
        if step % args.log_every == 0 or step == args.critic_steps:
            sps = step * args.batch_size / (time.time() - t0)
            logged = {"losses/q_loss": q_loss.item(), "losses/cql_loss": cql.item()}
            logged |= {"losses/q_data": q_data.mean().item(), "losses/q_candidates": q[..., 0][cq >= 0].mean().item()}
            run.log(step, logged | {"charts/learning_rate": args.critic_lr, "charts/SPS": sps})
            print(
                f"[critic] step {step} q_loss {q_loss.item():.4f} cql {cql.item():.3f} "
                f"Q(data) {q_data.mean().item():.3f} SPS {sps:.0f}",
                flush=True,
            )
        run.end_step(step, state)  # a checkpoint every --save-every steps and at the last; after Ctrl-C, then exit
    run.end_training()  # Ctrl-C and SIGTERM stop the run at once again
    critic.eval()
    timings["critic_s"] = time.time() - t0

    # STEP 4: online evaluation of the BC proposer alone and of BC proposals + critic argmax
    t0 = time.time()
    metrics = {**evaluate_agents(lm, critic, tokenizer, args, device, data_stats), **problem}
    timings["eval_s"] = time.time() - t0
    print("[time] " + ", ".join(f"{phase} {seconds:.0f}s" for phase, seconds in timings.items()), flush=True)
    run.log(0, metrics | headline_charts(metrics))
    run.finish(metrics, {"bc_lm": (lm, tokenizer), "critic": critic}, samples=args.critic_steps * args.batch_size)


def evaluate_agents(lm, critic, tokenizer, args, device, data_stats: dict) -> dict:
    """STEP 4: the BC proposer alone (1 sample) and BC proposals + critic argmax (N samples) against the scripted
    answerer; the acting temperature is chosen on validation episodes (as ilql_per_token.py chooses beta) and
    reported on test episodes. Returns the metrics (the tensorboard tags)."""
    t0 = time.time()
    gen_seed = args.seed + 1  # sampling noise of the evaluation (distinct from the candidate generation)
    bc_policy = CriticPolicy(lm, None, tokenizer, 1, args.temperature, device, gen_seed, args.gen_batch_size)
    bc = evaluate(bc_policy, args.eval_episodes, args.eval_seed)
    metrics, val, test = {}, {}, {}
    for temp in args.act_temperatures:
        # a fresh sampling generator for each of validation and test: test noise does not depend on validation
        val_agent, test_agent = (
            CriticPolicy(lm, critic, tokenizer, args.n_candidates, temp, device, gen_seed, args.gen_batch_size)
            for _ in range(2)
        )
        val[temp] = evaluate(val_agent, args.val_episodes, args.val_seed)
        test[temp] = evaluate(test_agent, args.eval_episodes, args.eval_seed)
        for name, res in (("val_", val[temp]), ("", test[temp])):
            metrics[f"eval/{name}act_temperature_{temp:g}_episodic_return"] = float(res["episodic_return"])
        print(
            f"[eval] act temperature {temp:g}: val return {val[temp]['episodic_return']:.3f}, test return "
            f"{test[temp]['episodic_return']:.3f} success {test[temp]['success_rate']:.3f}",
            flush=True,
        )
    best_temp = max(args.act_temperatures, key=lambda t: (val[t]["episodic_return"], t))  # ties -> the hotter one
    cql_res = test[best_temp]
    print(
        f"[eval] {time.time() - t0:.0f}s; BC proposer: return {bc['episodic_return']:.3f} success "
        f"{bc['success_rate']:.3f}; per-utterance CQL (act temperature {best_temp:g}, chosen on validation): return "
        f"{cql_res['episodic_return']:.3f} success {cql_res['success_rate']:.3f} length "
        f"{cql_res['episodic_length']:.2f} (optimal {G.OPTIMAL_MEAN_RETURN:.3f}, "
        f"dataset {data_stats['mean_return']:.3f})",
        flush=True,
    )
    metrics.update({f"eval/{k}": float(v) for k, v in cql_res.items()})
    metrics["eval/act_temperature"] = float(best_temp)
    metrics.update({f"eval/bc_proposer_{k}": float(v) for k, v in bc.items()})
    metrics["dataset/mean_return"] = float(data_stats["mean_return"])
    metrics["dataset/success_rate"] = float(data_stats["success_rate"])
    return metrics


def headline_charts(metrics: dict) -> dict:
    """The headline test result under CleanRL's chart tags."""
    return {
        "charts/episodic_return": metrics["eval/episodic_return"],
        "charts/episodic_length": metrics["eval/episodic_length"],
    }


# === RUN MANAGEMENT (not the algorithm: validation, run dir, checkpoint and --resume, Ctrl-C, summary) ===
# RUN_DIR/train_state.safetensors holds the TrainState at the end of the BC phase, at the end of the candidate phase
# and every `--save-every` critic steps (and at the critic's last), or wherever Ctrl-C / SIGTERM stopped the run; a
# kill during the BC phase restarts it. `--resume RUN_DIR` rebuilds the data (deterministic), skips the phases done and
# ends with the metrics of the uninterrupted run (tests/test_resume_dialogue_cql_utterance.py). Tensorboard: the BC
# and critic curves share the step axis, so no `purge_step`: critic points logged after the checkpoint appear twice.
SCRIPT = Path(__file__).stem  # names this script in summary.json and in checkpoints (--resume checks it)
RESUME_FREE_FIELDS = ("resume", "save_every", "runs_dir", "threads")  # may change on --resume; the rest is the run's
ARCH_FIELDS = ("critic_dim", "critic_hidden")  # --eval-only: the critic's sizes, from its run's args.json


def parse_args() -> Args:
    """tyro.cli(Args), each check a one-line `error:` before any work (the --dataset-path file too); --resume takes the
    run's own arguments (but RESUME_FREE_FIELDS), --eval-only its checkpoint's ARCH_FIELDS."""
    args = tyro.cli(Args)
    ckpt = Path(str(args.checkpoint))
    for ok, message in [
        (args.threads >= 1, f"--threads must be at least 1, got {args.threads}"),
        (
            args.resume is None or not args.eval_only,
            "--resume continues a training run; it does not go with --eval-only",
        ),
        (args.n_candidates >= 1, f"--n-candidates must be >= 1, got {args.n_candidates}"),
        (args.temperature > 0, f"--temperature must be > 0, got {args.temperature}"),
        (len(args.act_temperatures) > 0 and min(args.act_temperatures) > 0, "--act-temperatures must be > 0"),
        (args.val_episodes >= 1, f"--val-episodes must be >= 1, got {args.val_episodes}"),
        (min(args.batch_size, args.bc_batch_size, args.gen_batch_size) >= 1, "batch sizes must be >= 1"),
        (args.dataset_size >= 1, f"--dataset-size must be >= 1, got {args.dataset_size}"),
        (0.0 < args.tau <= 1.0, f"--tau must be in (0, 1], got {args.tau}"),
        (0.0 <= args.gamma <= 1.0, f"--gamma must be in [0, 1], got {args.gamma}"),
        (args.cql_alpha >= 0.0, f"--cql-alpha must be >= 0, got {args.cql_alpha}"),
        (args.belief_coef >= 0.0, f"--belief-coef must be >= 0, got {args.belief_coef}"),
        (args.eval_episodes >= 1, f"--eval-episodes must be >= 1, got {args.eval_episodes}"),
        (args.critic_steps >= 0 and args.bc_epochs >= 0, "--critic-steps and --bc-epochs must be >= 0"),
        (args.save_every >= 0, f"--save-every must be >= 0 (0 = no periodic checkpoints), got {args.save_every}"),
        (args.seed >= 0, f"--seed must be >= 0, got {args.seed}"),
        (min(args.n_layer, args.n_embd, args.n_head) >= 1, "--n-layer, --n-embd and --n-head must be >= 1"),
        (args.n_embd % max(args.n_head, 1) == 0, f"--n-embd {args.n_embd} not divisible by --n-head {args.n_head}"),
        (min(args.critic_dim, args.critic_hidden) >= 1, "--critic-dim and --critic-hidden must be >= 1"),
        (min(args.bc_lr, args.critic_lr) >= 0.0, "--bc-lr and --critic-lr must be >= 0"),
        (args.max_grad_norm > 0.0, f"--max-grad-norm must be > 0, got {args.max_grad_norm}"),
        (args.log_every >= 1, f"--log-every must be >= 1, got {args.log_every}"),
        (
            not args.eval_only
            or ((ckpt / "bc_lm" / "config.json").exists() and (ckpt / "critic.safetensors").exists()),
            f"--eval-only needs --checkpoint RUN_DIR with bc_lm/ and critic.safetensors (got {args.checkpoint})",
        ),
    ]:
        if not ok:
            raise SystemExit(f"error: {message}")
    if args.resume is not None:
        args = resume_args(args)[0]
    if args.eval_only:
        try:
            saved = json.loads((ckpt / "args.json").read_text())
            args = replace(args, **{key: saved[key] for key in ARCH_FIELDS})
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: could not load checkpoint '{ckpt}': {str(e).splitlines()[0]}") from None
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


def start_run(args: Args) -> "Run":
    return Run(args)  # the device, the run dir (new, or the resumed one), tensorboard, Ctrl-C / SIGTERM


class Run:
    """The device, the run dir and tensorboard, train_state.safetensors (at the phase ends and every --save-every critic
    steps) and --resume, Ctrl-C / SIGTERM, summary.json."""

    def __init__(self, args: Args):
        self.args, self.start_time, self.restored = args, time.time(), set()  # restored: the TrainState fields loaded
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        self.checkpoint = read_train_state(Path(args.resume)) if args.resume else None
        name = f"{TASK_ID.replace('/', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.run_dir = Path(str(args.resume))  # a new one but with --resume:
        for suffix in range(0 if args.resume else 10**6):  # (mkdir is atomic)
            self.run_dir = Path(args.runs_dir) / (f"{name}-{suffix}" if suffix else name)
            try:
                self.run_dir.mkdir(parents=True)
                break
            except FileExistsError:  # runs started in the same second get -1, -2, ...
                continue
            except OSError as err:
                raise SystemExit(f"error: --runs-dir {args.runs_dir}: {err.strerror}") from None
        self.writer = SummaryWriter(str(self.run_dir))  # (a resume: no purge_step, see the comment at the marker)
        if not args.resume:
            table = "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        self.stop = {"signal": None, "previous": {}} if args.eval_only else install_stop_handlers()

    def log(self, step: int, metrics: dict) -> None:
        """tensorboard at `step`: each tag -> value as a scalar (a str value as text)."""
        for tag, value in metrics.items():
            (self.writer.add_text if isinstance(value, str) else self.writer.add_scalar)(tag, value, step)

    def load_pretrained(self, path: str, kind: str):
        """(model, tokenizer) of a save_pretrained dir (--eval-only: the run's bc_lm/); kind: "causal" only."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            return AutoModelForCausalLM.from_pretrained(path).to(self.device), AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise SystemExit(f"error: could not load checkpoint '{path}': {str(e).splitlines()[0]}") from None

    def load_model(self, module: nn.Module) -> nn.Module:
        """--eval-only: the critic of --checkpoint (critic.safetensors) loaded into `module`."""
        path = Path(self.args.checkpoint) / "critic.safetensors"
        try:
            module.load_state_dict(load_file(path))
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise SystemExit(f"error: could not load checkpoint '{path}': {str(e).splitlines()[0]}") from None
        return module

    def restore(self, state: TrainState) -> int:
        """--resume: the checkpoint loaded into the fields of `state` not loaded yet whose object `state` holds by now
        (main calls it at the start: the phases done, the proposer, the table, the candidates; and again once the
        critic phase has built its critic, target, Adam and rng), and the RNG states whenever that loaded a field.
        Returns the critic steps the checkpoint had done (0 without --resume or before the critic phase)."""
        saved, loaded = self.checkpoint or {}, set()
        for f in fields(state):
            value, new = getattr(state, f.name), saved.get(f.name)
            if f.name in self.restored or new is None or (value is None and isinstance(new, dict)):
                continue  # loaded already, not in the checkpoint, or an object main has not built yet
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(new)
            elif isinstance(value, np.random.Generator):
                value.bit_generator.state = new
            else:
                setattr(state, f.name, new)
            loaded.add(f.name)
        if loaded:
            set_rng_state(saved["rngs"][0])
            print(f"resumed {self.run_dir}: {', '.join(sorted(loaded))} of its {saved['phase']} phase", flush=True)
            self.restored |= loaded
        return saved.get("critic_step", 0) if "critic" in self.restored else 0

    def end_step(self, step: int, state: TrainState) -> None:
        """At the end of the BC or the candidate phase (step 0) or of critic step `step`: the checkpoint when
        --save-every > 0 (every phase end, every --save-every critic steps and the last one) or a stop signal arrived;
        after a stop signal, exit with STOP_EXIT_CODE and the command that continues the run."""
        every = self.args.save_every
        due = every and (state.phase != "critic" or step % every == 0 or step == self.args.critic_steps)
        if due or self.stop["signal"]:
            saved = {}
            for f in fields(state):  # modules, optimizer, table: their state_dict; the minibatch rng: its state
                value = getattr(state, f.name)
                value = value.bit_generator.state if isinstance(value, np.random.Generator) else value
                saved[f.name] = value.state_dict() if hasattr(value, "state_dict") else value
            saved |= {"critic_step": step, "args": asdict(self.args), "rngs": [rng_state()]}
            save_train_state(self.run_dir, saved)
            self.writer.flush()
        if self.stop["signal"]:
            self.writer.close()
            resume = f"python {sys.argv[0]} --resume {self.run_dir}"
            print(
                f"{self.stop['signal']}: checkpoint saved in {state.phase} step {step}; continue with: {resume}",
                file=sys.stderr,
            )
            raise SystemExit(STOP_EXIT_CODE)

    def end_training(self) -> None:
        restore_signal_handlers(self.stop)  # training is over: Ctrl-C stops at once (a resume would redo the rest)

    def finish(self, metrics: dict, models: dict, samples: int) -> None:
        """`models` (name -> module: name.safetensors; a (model, tokenizer) pair: save_pretrained into name/),
        args.json, then summary.json (renamed into place: a finished run has it; `sps` = samples / wall time), and
        deletes the checkpoint (a finished run is not resumed)."""
        wall = time.time() - self.start_time
        for name, obj in models.items():
            for part in obj if isinstance(obj, tuple) else ():
                part.save_pretrained(self.run_dir / name)
            if isinstance(obj, nn.Module):
                save_model(obj, str(self.run_dir / f"{name}.safetensors"))
        (self.run_dir / "args.json").write_text(json.dumps(asdict(self.args), indent=2))
        summary = {"script": SCRIPT, "run_name": self.run_dir.name, "run_dir": str(self.run_dir)}
        summary |= {"args": asdict(self.args), "metrics": metrics, "wall_time_s": wall, "sps": samples / wall}
        (self.run_dir / ".summary.json").write_text(json.dumps(summary, indent=2))  # then renamed: never half written
        os.replace(self.run_dir / ".summary.json", self.run_dir / "summary.json")
        (self.run_dir / TRAIN_STATE).unlink(missing_ok=True)
        self.writer.close()
        print(f"done in {wall:.0f}s -> {self.run_dir / 'summary.json'}")


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
