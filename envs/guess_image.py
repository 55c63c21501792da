"""`seqrl/GuessTheImage-v0`: lecture part 3's visual dialogue made text-only, plus its offline dataset writer.

The answerer holds a secret "image", one of N = 18 objects described by three attributes
(size in {big, small} x color in {red, green, blue} x shape in {circle, square, triangle}). The questioner (the
agent) asks yes/no questions in words and ends the episode with a guess:

    agent: is it big ?                 answerer: yes , it is big .
    agent: is it red ?                 answerer: no , it is not red .
    agent: is it green ?               answerer: yes , it is green .
    agent: is it a circle ?            answerer: no , it is not a circle .
    agent: is it a square ?            answerer: no , it is not a square .
    agent: it is the big green triangle .    answerer: correct .     (reward +1, episode ends)

Rewards: -QUESTION_COST for every non-guess turn (a question or a malformed utterance), +1 for a correct guess,
0 for a wrong guess (both end the episode); after `max_turns` agent turns without a guess the episode is
truncated. Anything that is not exactly one of the 8 questions or 18 guesses (after lower-casing and
whitespace/punctuation normalisation) gets "i do not understand ." and costs a turn; nothing crashes.

It is a POMDP whose state is the history: the secret is never observed, only the replies. Guessing blind
succeeds with probability 1/18; the Bayes-optimal questioner asks only informative questions until one object
is left (13/3 questions on average), so its success rate is exactly 1 and its mean return exactly
1 - 0.05 * 13/3 = 0.78333 (`optimal_value()` computes it by dynamic programming over belief states,
`exact_policy_stats(OptimalPolicy())` by enumerating every secret; both agree).

The task speaks words, a model's tokenizer speaks tokens. Text layout (observation): plain text without tokenizer
markup, the whole history with one utterance or reply per line (utterances and replies alternating):
    "is it big ?\nyes , it is big .\nis it red ?\nno , it is not red ."   ("" at reset)
An agent utterance is shown normalised (`normalize_utterance`): lower-cased words and punctuation, a word the
answerer does not know shown as "*" (so "is it purple ?" appears as "is it * ?"). Inside Python the history is a
list of (utterance, reply) pairs (`parse_history` / `dialogue_to_text` convert), which is what the scripts use.
Token layout (`tokenize_dialogue`), where <bos>, <sep>, <eos> are the MODEL tokenizer's own special tokens (the
built-in word-level tokenizer has all three; a script using a GPT-2 / Llama / GPT-NeoX checkpoint adds a separator
token and resizes the embeddings): <bos> a1 <sep> r1 <sep> a2 <sep> r2 ... aT <sep> rT <eos>; the <sep> right after
an agent utterance is written by the agent (it ends its turn), everything else after <bos> is written by the
answerer. The prompt from which the agent writes turn k+1 is `tokenize_prompt(turns[:k])`, a prefix of it.

Offline data: `make_dataset` / `write_dataset` roll out a mixture of scripted behavior policies (`POLICIES`)
with a plain-Python simulator (no gym overhead; 20k dialogues take about a second). The default mixture pairs a
good questioner that guesses prematurely ("hasty") with a careful guesser that asks redundant questions
("thorough"), plus a noisy optimal questioner and a random babbler, so that no behavior is both efficient and
reliable and cloning the whole dataset is far below the optimal questioner. `make_dataset(20000, seed=1)`:

    behavior   share  mean return  success  mean length
    hasty       0.40     0.396      0.565      4.36      (efficient questions, guesses with <= 2-3 objects left)
    thorough    0.40     0.571      0.853      6.50      (30% redundant questions, guesses only when sure)
    noisy       0.10     0.211      0.334      3.47      (optimal, but 30% random utterances)
    random      0.10     0.024      0.047      1.45
    all         1.00     0.412      0.607      4.85      (the BC proxy)   optimal questioner: 0.783, 1.000, 5.33

The best dialogues by return are mostly hasty's lucky guesses (74% of the top 10%), so filtered BC is pulled
towards premature guessing; doing better needs stitching hasty's questions with thorough's patience. Note that
any order of informative questions is optimal here (13/3 expected questions), so "efficient" means "never ask
a question whose answer is already implied" (e.g. "is it blue ?" after "red? no, green? no").
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import gymnasium as gym
import numpy as np
from gymnasium import spaces

# ---------------------------------------------------------------------------------------------------------------
# The task: objects, utterances, replies
# ---------------------------------------------------------------------------------------------------------------
SIZES = ("big", "small")
COLORS = ("red", "green", "blue")
SHAPES = ("circle", "square", "triangle")
ATTRIBUTES = (("size", SIZES), ("color", COLORS), ("shape", SHAPES))  # guess word order: size color shape
OBJECTS = tuple(itertools.product(SIZES, COLORS, SHAPES))  # (size, color, shape) triples, index = secret id
N_OBJECTS = len(OBJECTS)  # 18 candidates: blind guessing succeeds with probability 1/18
ALL_MASK = (1 << N_OBJECTS) - 1  # sets of candidate objects are bitmasks over OBJECTS

QUESTION_COST = 0.05  # reward of every non-guess turn (small enough that identifying the object always pays)
MAX_TURNS = 8  # agent turns per episode; the optimal questioner needs at most 5 questions + 1 guess
YES, NO = "yes", "no"  # first word of every answer to a question
CORRECT, WRONG = "correct .", "wrong ."
NOT_UNDERSTOOD = "i do not understand ."
TURN_SEPARATOR = "\n"  # the observation text shows one utterance or reply per line (plain text, no tokenizer markup)
UNKNOWN_WORD = "*"  # how the history shows a word the answerer does not know (the built-in tokenizer reads <unk>)
MAX_UTTERANCE_WORDS = 12  # a malformed utterance is shown in the history cut to this many words

WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        ("is", "it", "a", "the", *SIZES, *COLORS, *SHAPES, "yes", "no", "correct", "wrong", "i", "do", "not")
        + ("understand",)
    )
)  # every word of the task; "?" "." "," are split off by the tokenizer and are in its vocabulary already
_PUNCT = ("?", ".", ",")
_SHOWN_TOKENS = frozenset(WORDS) | frozenset(_PUNCT)  # tokens kept verbatim when a malformed utterance is shown
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def _question_text(attribute: str, value: str) -> str:
    return f"is it a {value} ?" if attribute == "shape" else f"is it {value} ?"


def _guess_text(obj: tuple[str, str, str]) -> str:
    return f"it is the {' '.join(obj)} ."


# questions: (text, bitmask of the objects for which the answer is "yes")
QUESTIONS: tuple[tuple[str, int], ...] = tuple(
    (
        _question_text(attr, value),
        sum(1 << i for i, obj in enumerate(OBJECTS) if obj[a] == value),
    )
    for a, (attr, values) in enumerate(ATTRIBUTES)
    for value in values
)
GUESSES: tuple[str, ...] = tuple(_guess_text(obj) for obj in OBJECTS)  # GUESSES[i] names OBJECTS[i]
N_QUESTIONS = len(QUESTIONS)  # 8
# canonical utterance -> action id: 0..7 are questions, 8..25 guesses (object id = action id - N_QUESTIONS)
UTTERANCE_IDS: dict[str, int] = {text: i for i, text in enumerate([q for q, _ in QUESTIONS] + list(GUESSES))}


def answer_text(question: int, yes: bool) -> str:
    """The answerer's full-sentence reply to question id `question`: "yes , it is red ." / "no , it is not a circle ."

    Restating the attribute puts the fact right next to yes/no, as a person would say it; a small language model
    then reads the answer off local context instead of binding "yes" to a question several tokens back.
    """
    claim = QUESTIONS[question][0].removeprefix("is it ").removesuffix(" ?")  # "red", "a circle"
    return f"yes , it is {claim} ." if yes else f"no , it is not {claim} ."


ANSWERS = tuple(answer_text(q, yes) for q in range(N_QUESTIONS) for yes in (True, False))
REPLIES = (*ANSWERS, CORRECT, WRONG, NOT_UNDERSTOOD)


def all_questions() -> list[str]:
    """The 8 valid questions, e.g. "is it red ?", "is it a circle ?", "is it big ?"."""
    return [q for q, _ in QUESTIONS]


def all_guesses() -> list[str]:
    """The 18 valid guesses, e.g. "it is the big red circle ." (GUESSES[i] names OBJECTS[i])."""
    return list(GUESSES)


def all_utterances() -> list[str]:
    """Every valid agent utterance: questions then guesses (index = action id of `UTTERANCE_IDS`)."""
    return all_questions() + all_guesses()


def describe(secret: int) -> str:
    """'big red circle' for an object id."""
    return " ".join(OBJECTS[secret])


def normalize_utterance(text) -> str:
    """What the history shows for an agent utterance: lower-cased words and punctuation joined by single spaces
    (one line); words and symbols outside the task's vocabulary become UNKNOWN_WORD ("*"), at most
    MAX_UTTERANCE_WORDS of them, "*" if nothing is left."""
    if not isinstance(text, str):
        return UNKNOWN_WORD
    tokens = _TOKEN_RE.findall(text[: 16 * MAX_UTTERANCE_WORDS].lower())[:MAX_UTTERANCE_WORDS]
    tokens = [t if t in _SHOWN_TOKENS else UNKNOWN_WORD for t in tokens]
    return " ".join(tokens) if tokens else UNKNOWN_WORD


def respond(secret: int, utterance, question_cost: float = QUESTION_COST, flip: bool = False):
    """The scripted answerer, shared by the gym env and the fast simulator.

    Returns (shown_utterance, reply, reward, guessed, success); `flip` inverts a yes/no answer (answer noise).
    """
    shown = normalize_utterance(utterance)
    action = UTTERANCE_IDS.get(shown)
    if action is None:
        return shown, NOT_UNDERSTOOD, -question_cost, False, False
    if action < N_QUESTIONS:
        yes = bool(QUESTIONS[action][1] >> secret & 1) != flip
        return shown, answer_text(action, yes), -question_cost, False, False
    success = action - N_QUESTIONS == secret
    return shown, CORRECT if success else WRONG, 1.0 if success else 0.0, True, success


# ---------------------------------------------------------------------------------------------------------------
# History text and tokens
# ---------------------------------------------------------------------------------------------------------------
def _pairs(turns) -> list[tuple[str, str]]:
    """Accept a history as text, a list of (agent, reply) pairs, a list of turn dicts, or a dialogue dict."""
    if isinstance(turns, dict):
        turns = turns["turns"]
    if isinstance(turns, str):
        return parse_history(turns)
    return [(t["agent"], t["reply"]) if isinstance(t, dict) else (t[0], t[1]) for t in turns]


def dialogue_to_text(turns) -> str:
    """The exact observation text of the env: "a1\nr1\na2\nr2", one utterance or reply per line ("" for no turns)."""
    return TURN_SEPARATOR.join(s for pair in _pairs(turns) for s in pair)


def parse_history(text: str) -> list[tuple[str, str]]:
    """Inverse of `dialogue_to_text`: the (agent utterance, reply) pairs of an observation text."""
    parts = [p.strip() for p in text.split(TURN_SEPARATOR)] if text.strip() else []
    return list(zip(parts[0::2], parts[1::2], strict=False))


def _layout_ids(tokenizer) -> tuple[int, int, int]:
    """The model tokenizer's <bos>, <sep>, <eos> ids that frame the task's turns (a clear error if one is missing)."""
    ids = (tokenizer.bos_token_id, tokenizer.sep_token_id, tokenizer.eos_token_id)
    if None in ids:
        missing = [n for n, i in zip(("bos_token", "sep_token", "eos_token"), ids, strict=True) if i is None]
        raise ValueError(
            f"the tokenizer lacks {missing}: the dialogue layout needs a BOS, a turn separator and an EOS token "
            "(add them with tokenizer.add_special_tokens(...) and resize the model's embeddings)"
        )
    return ids


def _cached_ids(text: str, tokenizer, cache: dict) -> list[int]:
    if text not in cache:
        cache[text] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return cache[text]


def tokenize_prompt(turns, tokenizer, cache: dict | None = None) -> list[int]:
    """Token ids of the state from which the agent writes its next utterance: <bos> a1 <sep> r1 <sep> ... rk <sep>
    (just <bos> at the start). Exactly the prefix of `tokenize_dialogue` before the next agent token."""
    cache = {} if cache is None else cache
    bos, sep, _ = _layout_ids(tokenizer)
    ids = [bos]
    for agent, reply in _pairs(turns):
        ids += _cached_ids(agent, tokenizer, cache) + [sep]
        ids += _cached_ids(reply, tokenizer, cache) + [sep]
    return ids


def tokenize_dialogue(turns, tokenizer, cache: dict | None = None) -> dict:
    """Per-token arrays of one finished dialogue (a dialogue dict or its list of turn dicts with "reward").

    Layout: <bos> a1 <sep> r1 <sep> a2 <sep> r2 ... aT <sep> rT <eos>. Returns numpy arrays of length L:
      input_ids  int64  token ids
      agent_mask bool   True where the agent wrote the token (utterance words + the <sep> ending its utterance)
      rewards    float32 the reward of turn k sits on the agent's <sep> that ends utterance k (its last token)
      dones      bool   True on that token of the final turn (the episode ends after it: no bootstrap)
    and turn_ends (T,) int64: index of the agent's <sep> of every turn; turn_starts (T,): first token of each
    agent utterance. For a next-token model the action of position i is input_ids[i+1], predicted from the state
    at i: use agent_mask[1:] / rewards[1:] / dones[1:] as the per-action masks. A per-token Bellman backup from an
    agent token jumps over answerer tokens to the next agent token (the next turn_starts), whose state includes
    the reply. Cache: pass one dict across calls to tokenize each distinct string only once (fast).
    """
    cache = {} if cache is None else cache
    turns = turns["turns"] if isinstance(turns, dict) else turns
    bos, sep, eos = _layout_ids(tokenizer)
    ids, agent, rewards, dones = [bos], [False], [0.0], [False]
    turn_starts, turn_ends = [], []
    for k, turn in enumerate(turns):
        last = k == len(turns) - 1
        a_ids = _cached_ids(turn["agent"], tokenizer, cache)
        turn_starts.append(len(ids))
        ids += a_ids + [sep]
        agent += [True] * (len(a_ids) + 1)
        rewards += [0.0] * len(a_ids) + [float(turn["reward"])]
        dones += [False] * len(a_ids) + [last]
        turn_ends.append(len(ids) - 1)
        r_ids = _cached_ids(turn["reply"], tokenizer, cache)
        ids += r_ids + [eos if last else sep]
        agent += [False] * (len(r_ids) + 1)
        rewards += [0.0] * (len(r_ids) + 1)
        dones += [False] * (len(r_ids) + 1)
    return {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "agent_mask": np.asarray(agent, dtype=bool),
        "rewards": np.asarray(rewards, dtype=np.float32),
        "dones": np.asarray(dones, dtype=bool),
        "turn_starts": np.asarray(turn_starts, dtype=np.int64),
        "turn_ends": np.asarray(turn_ends, dtype=np.int64),
    }


def tokenize_dialogues(dialogues: Sequence, tokenizer) -> list[dict]:
    """`tokenize_dialogue` of many dialogues with one shared string cache (20k dialogues in about a second)."""
    cache: dict = {}
    return [tokenize_dialogue(d, tokenizer, cache) for d in dialogues]


def max_dialogue_tokens(max_turns: int = MAX_TURNS) -> int:
    """Upper bound on len(tokenize_dialogue(...)["input_ids"]) for dialogues of valid utterances."""
    longest_utterance = max(len(_TOKEN_RE.findall(u)) for u in all_utterances())
    longest_reply = max(len(_TOKEN_RE.findall(r)) for r in REPLIES)
    return 1 + max_turns * (longest_utterance + 1 + longest_reply + 1)


# ---------------------------------------------------------------------------------------------------------------
# Belief tracking and reference policies
# ---------------------------------------------------------------------------------------------------------------
def consistent_mask(history) -> int:
    """Bitmask of the objects consistent with every yes/no answer of the history. With answer noise the answers
    can contradict each other; then the objects with the fewest contradicted answers are returned."""
    mask, answers = ALL_MASK, []
    for agent, reply in _pairs(history):
        action = UTTERANCE_IDS.get(agent)
        if action is not None and action < N_QUESTIONS and reply.split(" ")[0] in (YES, NO):
            q, yes = QUESTIONS[action][1], reply.startswith(YES)
            answers.append((q, yes))
            mask &= q if yes else ALL_MASK ^ q
    if mask:
        return mask
    mismatches = [sum((q >> i & 1) != yes for q, yes in answers) for i in range(N_OBJECTS)]
    best = min(mismatches)
    return sum(1 << i for i in range(N_OBJECTS) if mismatches[i] == best)


def _members(mask: int) -> list[int]:
    return [i for i in range(N_OBJECTS) if mask >> i & 1]


def _informative(mask: int) -> list[int]:
    """Questions whose answer is not yet determined by the consistent set."""
    return [k for k, (_, q) in enumerate(QUESTIONS) if 0 < (mask & q).bit_count() < mask.bit_count()]


class Policy:
    """A scripted questioner: `act(history, rng) -> utterance`, history as (agent, reply) pairs or observation text,
    rng a `random.Random`. Stateless: everything is recomputed from the history."""

    name = "policy"

    def act(self, history, rng: random.Random) -> str:
        raise NotImplementedError

    def act_batch(self, histories: Sequence, rng: random.Random) -> list[str]:
        return [self.act(h, rng) for h in histories]

    def __call__(self, history, rng: random.Random | None = None) -> str:
        return self.act(history, rng if rng is not None else random.Random(0))


class RandomPolicy(Policy):
    """Uniform over the 26 valid utterances (8 questions, 18 guesses): mostly guesses at random early."""

    name = "random"

    def act(self, history, rng):
        return rng.choice(all_utterances())


class OptimalPolicy(Policy):
    """The optimal questioner (for answer_noise=0): track the consistent candidates, ask the most splitting
    question (ties broken at random, or by question order when `random_ties=False`), guess when one is left."""

    name = "optimal"

    def __init__(self, random_ties: bool = True):
        self.random_ties = random_ties

    def act(self, history, rng):
        mask = consistent_mask(history)
        if mask.bit_count() == 1:
            return GUESSES[mask.bit_length() - 1]
        return QUESTIONS[self._split_question(mask, rng)][0]

    def _split_question(self, mask: int, rng) -> int:
        n = mask.bit_count()
        split = [min((mask & q).bit_count(), n - (mask & q).bit_count()) for _, q in QUESTIONS]
        best = [k for k, s in enumerate(split) if s == max(split)]
        return rng.choice(best) if self.random_ties else best[0]


class HastyPolicy(OptimalPolicy):
    """Efficient questioner, premature guesser: asks the optimal questions but guesses a random consistent object
    as soon as at most `guess_at` are left (and with probability `p_early` already at guess_at + 1)."""

    name = "hasty"

    def __init__(self, guess_at: int = 2, p_early: float = 0.3):
        super().__init__(random_ties=True)
        self.guess_at, self.p_early = guess_at, p_early

    def act(self, history, rng):
        mask = consistent_mask(history)
        n = mask.bit_count()
        if n <= self.guess_at or (n == self.guess_at + 1 and rng.random() < self.p_early):
            return GUESSES[rng.choice(_members(mask))]
        return QUESTIONS[self._split_question(mask, rng)][0]


class ThoroughPolicy(Policy):
    """Careful guesser, redundant questioner: guesses only when one object is left (always right without noise),
    but with probability `p_redundant` asks a question whose answer it already knows; otherwise a random
    informative question. It often spends many turns and sometimes runs into the turn limit."""

    name = "thorough"

    def __init__(self, p_redundant: float = 0.3):
        self.p_redundant = p_redundant

    def act(self, history, rng):
        mask = consistent_mask(history)
        if mask.bit_count() == 1:
            return GUESSES[mask.bit_length() - 1]
        informative = _informative(mask)
        redundant = [k for k in range(N_QUESTIONS) if k not in informative]
        if redundant and rng.random() < self.p_redundant:
            return QUESTIONS[rng.choice(redundant)][0]
        return QUESTIONS[rng.choice(informative)][0]


class NoisyOptimalPolicy(OptimalPolicy):
    """A good questioner with noise: the optimal questioner, but each turn with probability `epsilon` a uniformly
    random valid utterance (often a random guess that ends the dialogue)."""

    name = "noisy"

    def __init__(self, epsilon: float = 0.3):
        super().__init__(random_ties=True)
        self.epsilon = epsilon

    def act(self, history, rng):
        if rng.random() < self.epsilon:
            return rng.choice(all_utterances())
        return super().act(history, rng)


POLICIES: dict[str, Callable[[], Policy]] = {
    "random": RandomPolicy,
    "optimal": OptimalPolicy,
    "hasty": HastyPolicy,
    "thorough": ThoroughPolicy,
    "noisy": NoisyOptimalPolicy,
}  # name -> constructor with the default parameters: POLICIES["hasty"]().act(history, rng)

# The default behavior mixture of the offline dataset (see the module docstring for why).
DEFAULT_MIXTURE: dict[str, float] = {"hasty": 0.4, "thorough": 0.4, "noisy": 0.1, "random": 0.1}


# ---------------------------------------------------------------------------------------------------------------
# Exact optimal value
# ---------------------------------------------------------------------------------------------------------------
@cache
def belief_value(mask: int, turns_left: int, question_cost: float = QUESTION_COST) -> float:
    """Bayes-optimal expected return from a belief state (answer_noise=0): with a uniform prior and truthful answers
    the belief is uniform over the consistent set S (bitmask `mask`, `consistent_mask(history)`), so
    V(S, t) = max(1/|S| [best guess], max_q -c + P(yes) V(S & q, t-1) + P(no) V(S - q, t-1)), V(S, 0) = 0."""
    if turns_left == 0:
        return 0.0
    n = mask.bit_count()
    best = 1.0 / n  # guess any consistent object
    for k in _informative(mask):
        q = QUESTIONS[k][1]
        n_yes = (mask & q).bit_count()
        yes = belief_value(mask & q, turns_left - 1, question_cost)
        no = belief_value(mask & ~q, turns_left - 1, question_cost)
        best = max(best, -question_cost + (n_yes * yes + (n - n_yes) * no) / n)
    return best


def optimal_value(max_turns: int = MAX_TURNS, question_cost: float = QUESTION_COST) -> float:
    """The optimal questioner's expected return from the start: `belief_value(ALL_MASK, max_turns)`."""
    return belief_value(ALL_MASK, max_turns, question_cost)


OPTIMAL_MEAN_QUESTIONS = 1 + 5 / 3 + 5 / 3  # size: 1 question; each 3-valued attribute: 1/3 * 1 + 2/3 * 2
OPTIMAL_SUCCESS_RATE = 1.0  # the optimal questioner always identifies the object before guessing (noise 0)
OPTIMAL_MEAN_RETURN = OPTIMAL_SUCCESS_RATE - QUESTION_COST * OPTIMAL_MEAN_QUESTIONS  # = 0.78333 (= optimal_value())
OPTIMAL_MEAN_LENGTH = OPTIMAL_MEAN_QUESTIONS + 1  # 5.333 agent turns
RANDOM_GUESS_SUCCESS = 1 / N_OBJECTS  # guessing blind


def random_policy_value(max_turns: int = MAX_TURNS, question_cost: float = QUESTION_COST) -> float:
    """Exact expected return of `RandomPolicy` (uniform over the 26 valid utterances, answer_noise=0): each turn it
    guesses right w.p. 1/26 (+1, ends), wrong w.p. 17/26 (0, ends) or asks w.p. 8/26 (-c, continues)."""
    n_utterances = N_QUESTIONS + N_OBJECTS
    value = 0.0
    for _ in range(max_turns):  # V_t = 1/26 + 8/26 (-c + V_{t-1}), V_0 = 0
        value = 1 / n_utterances + N_QUESTIONS / n_utterances * (-question_cost + value)
    return value


RANDOM_MEAN_RETURN = random_policy_value()  # 0.0312: the "random" anchor of the normalized score


def normalized_score(mean_return: float, max_turns: int = MAX_TURNS, question_cost: float = QUESTION_COST) -> float:
    """LMRL-Gym-style normalized score: 0 = random policy, 100 = optimal questioner (exact values, noise 0)."""
    low, high = random_policy_value(max_turns, question_cost), optimal_value(max_turns, question_cost)
    return 100.0 * (mean_return - low) / (high - low)


# ---------------------------------------------------------------------------------------------------------------
# Fast simulation, datasets, evaluation
# ---------------------------------------------------------------------------------------------------------------
def simulate_dialogue(
    policy: Policy,
    secret: int,
    rng: random.Random,
    max_turns: int = MAX_TURNS,
    question_cost: float = QUESTION_COST,
    answer_noise: float = 0.0,
) -> dict:
    """One dialogue of a scripted policy against the answerer (plain Python, no gym): the dataset's dict."""
    turns, history = [], []
    ret, success = 0.0, False
    for _ in range(max_turns):
        utterance = policy.act(history, rng)
        flip = answer_noise > 0 and rng.random() < answer_noise
        shown, reply, reward, guessed, success = respond(secret, utterance, question_cost, flip)
        turns.append({"agent": shown, "reply": reply, "reward": reward})
        history.append((shown, reply))
        ret += reward
        if guessed:
            break
    return {
        "policy": getattr(policy, "name", "policy"),
        "secret": describe(secret),
        "secret_id": secret,
        "turns": turns,
        "return": ret,
        "success": success,
        "length": len(turns),
    }


def _normalized_mixture(mixture: dict[str, float] | None) -> tuple[list[str], list[float]]:
    mixture = DEFAULT_MIXTURE if mixture is None else mixture
    unknown = sorted(set(mixture) - set(POLICIES))
    if unknown or not mixture:
        raise ValueError(f"unknown behavior policies {unknown}; known: {sorted(POLICIES)}")
    if any(w < 0 for w in mixture.values()) or sum(mixture.values()) <= 0:
        raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {mixture}")
    total = sum(mixture.values())
    names = list(mixture)
    return names, [mixture[n] / total for n in names]


def make_dataset(
    n: int,
    seed: int,
    mixture: dict[str, float] | None = None,
    max_turns: int = MAX_TURNS,
    question_cost: float = QUESTION_COST,
    answer_noise: float = 0.0,
) -> list[dict]:
    """`n` dialogues; each picks a behavior from `mixture` (name -> weight; DEFAULT_MIXTURE if None) and a uniform
    secret. Deterministic given `seed`. Each dialogue: {"policy", "secret", "secret_id", "turns": [{"agent",
    "reply", "reward"}, ...], "return", "success", "length"}."""
    names, weights = _normalized_mixture(mixture)
    policies = {name: POLICIES[name]() for name in names}
    rng = random.Random(seed)
    dialogues = []
    for _ in range(n):
        name = rng.choices(names, weights)[0]
        secret = rng.randrange(N_OBJECTS)
        dialogues.append(simulate_dialogue(policies[name], secret, rng, max_turns, question_cost, answer_noise))
    return dialogues


def dataset_stats(dialogues: Sequence[dict]) -> dict:
    """Mean return, success rate and length, overall and per behavior policy (with its share of the data)."""

    def summarize(ds):
        return {
            "n": len(ds),
            "share": len(ds) / max(len(dialogues), 1),
            "mean_return": float(np.mean([d["return"] for d in ds])) if ds else 0.0,
            "success_rate": float(np.mean([d["success"] for d in ds])) if ds else 0.0,
            "mean_length": float(np.mean([len(d["turns"]) for d in ds])) if ds else 0.0,
        }

    by_policy: dict[str, list[dict]] = {}
    for d in dialogues:
        by_policy.setdefault(d["policy"], []).append(d)
    return {**summarize(list(dialogues)), "per_policy": {k: summarize(v) for k, v in sorted(by_policy.items())}}


def failure_kinds(dialogues: Sequence[dict]) -> dict:
    """Where the points go: each dialogue's outcome, and per-dialogue counts of wasted turns (answer noise 0).

    Outcomes (fractions summing to 1): `success`; `wrong_excluded` (guessed an object the answers had ruled out);
    `wrong_k_left` for k = 2, 3 (k >= 3), a consistent but premature guess with k objects left; `out_of_turns`.
    Turns: `redundant` (a valid question whose answer the history already implied), `malformed` (an utterance the
    answerer did not understand) and `informative` questions per dialogue. The optimal questioner has success 1,
    0 redundant, 0 malformed and 13/3 informative questions."""
    outcomes = ("success", "wrong_excluded", "wrong_2_left", "wrong_3_left", "out_of_turns")
    counts = dict.fromkeys((*outcomes, "redundant", "malformed", "informative"), 0)
    for d in dialogues:
        history, outcome = [], "out_of_turns"
        for turn in _pairs(d):
            mask, action = consistent_mask(history), UTTERANCE_IDS.get(turn[0])
            if action is None:
                counts["malformed"] += 1
            elif action < N_QUESTIONS:
                counts["informative" if action in _informative(mask) else "redundant"] += 1
            elif turn[1] == CORRECT:
                outcome = "success"
            elif mask >> (action - N_QUESTIONS) & 1:
                outcome = f"wrong_{min(mask.bit_count(), 3)}_left"
            else:
                outcome = "wrong_excluded"
            history.append(turn)
        counts[outcome] += 1
    return {k: v / max(len(dialogues), 1) for k, v in counts.items()}


def write_dataset(
    path: str | Path,
    n: int,
    seed: int,
    mixture: dict[str, float] | None = None,
    **env_kwargs,
) -> dict:
    """Write `make_dataset(n, seed, mixture, **env_kwargs)` as JSONL (one dialogue per line); return its stats."""
    dialogues = make_dataset(n, seed, mixture, **env_kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for d in dialogues:
            f.write(json.dumps(d) + "\n")
    return dataset_stats(dialogues)


def read_dataset(path: str | Path) -> list[dict]:
    """The dialogues of a JSONL file written by `write_dataset`."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def evaluate_policy(
    policy,
    n_episodes: int = 500,
    seed: int = 0,
    max_turns: int = MAX_TURNS,
    question_cost: float = QUESTION_COST,
    answer_noise: float = 0.0,
    return_dialogues: bool = False,
) -> dict:
    """Online evaluation against the scripted answerer, all episodes in lockstep (one batched call per turn).

    `policy` is a `Policy` (uses its own `act_batch` with a seeded rng), an object with
    `act_batch(histories) -> list[str]` (e.g. a learned model: one forward pass per turn), or a plain callable
    `act(history) -> str`; a history is a list of (agent utterance, reply) pairs (`dialogue_to_text` /
    `tokenize_prompt` turn it into text / token ids). Secrets cycle through all objects (stratified) in a seeded
    random order. Returns {"success_rate", "mean_return", "mean_length", "return_std"} (+ "dialogues").
    """
    rng = random.Random(seed)
    secrets = [i % N_OBJECTS for i in range(n_episodes)]
    rng.shuffle(secrets)
    if isinstance(policy, Policy):
        act_batch = lambda hs: policy.act_batch(hs, rng)  # noqa: E731
    elif hasattr(policy, "act_batch"):
        act_batch = policy.act_batch
    elif callable(policy):
        act_batch = lambda hs: [policy(h) for h in hs]  # noqa: E731
    else:
        raise TypeError("policy must be a Policy, have act_batch(histories), or be a callable act(history)")
    dialogues = [
        {"policy": getattr(policy, "name", "evaluated"), "secret": describe(s), "secret_id": s, "turns": []}
        for s in secrets
    ]
    for d in dialogues:
        d.update({"return": 0.0, "success": False, "done": False})
    for _ in range(max_turns):
        active = [d for d in dialogues if not d["done"]]
        if not active:
            break
        utterances = act_batch([[(t["agent"], t["reply"]) for t in d["turns"]] for d in active])
        if len(utterances) != len(active):
            raise ValueError(f"act_batch returned {len(utterances)} utterances for {len(active)} histories")
        for d, utterance in zip(active, utterances, strict=True):
            flip = answer_noise > 0 and rng.random() < answer_noise
            shown, reply, reward, guessed, success = respond(d["secret_id"], utterance, question_cost, flip)
            d["turns"].append({"agent": shown, "reply": reply, "reward": reward})
            d["return"] += reward
            d["success"], d["done"] = success, guessed
    for d in dialogues:
        d["length"] = len(d["turns"])
        del d["done"]
    returns = np.array([d["return"] for d in dialogues])
    result = {
        "success_rate": float(np.mean([d["success"] for d in dialogues])),
        "mean_return": float(returns.mean()),
        "return_std": float(returns.std()),
        "mean_length": float(np.mean([d["length"] for d in dialogues])),
    }
    if return_dialogues:
        result["dialogues"] = dialogues
    return result


def exact_policy_stats(policy: Policy, max_turns: int = MAX_TURNS, question_cost: float = QUESTION_COST) -> dict:
    """Exact success rate / mean return / mean length of a deterministic policy (no rng use), averaged over all
    secrets (uniform prior, answer_noise=0)."""
    dialogues = [simulate_dialogue(policy, s, random.Random(0), max_turns, question_cost) for s in range(N_OBJECTS)]
    stats = dataset_stats(dialogues)
    return {k: stats[k] for k in ("success_rate", "mean_return", "mean_length")}


# ---------------------------------------------------------------------------------------------------------------
# The gymnasium env
# ---------------------------------------------------------------------------------------------------------------
CHARSET = frozenset("abcdefghijklmnopqrstuvwxyz0123456789 ?.,!'*\n")  # characters of observations and actions
MAX_UTTERANCE_CHARS = 256  # action space bound (longer strings are still accepted by step and shown truncated)


class GuessTheImageEnv(gym.Env):
    """Text-in, text-out dialogue POMDP. Observation: the history text (`dialogue_to_text`); action: one utterance.

    reset(seed) -> ("", info) with info {"secret", "secret_id", "n_candidates"}; step(utterance) ->
    (history, reward, terminated, truncated, info) with info {"reply", "utterance" (as shown), "valid", "turn",
    "success"}. terminated on a guess; truncated after `max_turns` agent turns without one (the history shows the
    turn count, so history-based agents may treat it as terminal: nothing follows).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        render_mode: str | None = None,
        max_turns: int = MAX_TURNS,
        question_cost: float = QUESTION_COST,
        answer_noise: float = 0.0,
    ):
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0.0 <= answer_noise <= 1.0:
            raise ValueError(f"answer_noise must be in [0, 1], got {answer_noise}")
        self.render_mode, self.max_turns = render_mode, max_turns
        self.question_cost, self.answer_noise = question_cost, answer_noise
        shown_max = MAX_UTTERANCE_WORDS * (max(len(w) for w in _SHOWN_TOKENS | {UNKNOWN_WORD}) + 1)
        reply_max = max(len(r) for r in REPLIES)
        self.observation_space = spaces.Text(
            max_length=max_turns * (shown_max + reply_max + 2 * len(TURN_SEPARATOR)), min_length=0, charset=CHARSET
        )
        self.action_space = spaces.Text(max_length=MAX_UTTERANCE_CHARS, min_length=0, charset=CHARSET)
        self._history: list[tuple[str, str]] = []
        self._secret, self._done = 0, True

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._secret = int(self.np_random.integers(N_OBJECTS))
        self._history, self._done = [], False
        return "", {"secret": describe(self._secret), "secret_id": self._secret, "n_candidates": N_OBJECTS}

    def step(self, action):
        if self._done:
            raise RuntimeError("GuessTheImageEnv: the episode is over, call reset()")
        flip = self.answer_noise > 0 and self.np_random.random() < self.answer_noise
        shown, reply, reward, guessed, success = respond(self._secret, action, self.question_cost, flip)
        self._history.append((shown, reply))
        truncated = not guessed and len(self._history) >= self.max_turns
        self._done = guessed or truncated
        info = {
            "reply": reply,
            "utterance": shown,
            "valid": reply != NOT_UNDERSTOOD,
            "turn": len(self._history),
            "success": success,
            "secret": describe(self._secret),
        }
        return dialogue_to_text(self._history), float(reward), guessed, truncated, info

    def render(self):
        if self.render_mode == "ansi":
            lines = [f"[secret: {describe(self._secret)}]"]
            lines += [f"Q: {a}\nA: {r}" for a, r in self._history]
            return "\n".join(lines) + "\n"
        return None
