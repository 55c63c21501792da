"""Single-turn preference task (lecture part 2, RLHF as a one-step bandit) with a hidden human.

Prompt = state, completion = action. Prompts are short questions from a few templates over a fixed fact table
(capital city and main language of 10 countries; the lecture's running example is
"what is the capital of france ?"). The hidden **gold utility** u(prompt, completion) plays the human; it
reproduces the lecture's numbers for its example completions

    "paris" +1.0 > "it's a city called paris" +0.9 > "i don't know" -0.1 > "london" -1.0
    > "why are you asking such a stupid question" -10.0

and penalizes degenerate text (each repeated word, every word past `MAX_FREE_WORDS`, an answer that never ended).
The **labeler** samples pairwise preferences from Bradley-Terry on the gold utility, p(a > b) = σ((u_a - u_b)/T),
optionally flipped with `flip_prob`, and K-wise rankings from Plackett-Luce (Gumbel-perturbed utilities, whose
pairwise marginals are exactly the Bradley-Terry probabilities).

The task speaks words, a model's tokenizer speaks tokens. A completion is a `Completion(text, ended)`: plain text
("paris", "it's a city called paris"; no tokenizer markup such as "<eos>") and whether the answer ended properly
(`ended=True`) or was cut off at the length limit (`ended=False`, which the gold utility charges
`MISSING_EOS_PENALTY`). A script maps `ended` to its model tokenizer's own end-of-sequence token when it encodes a
completion, and back (did the model emit its EOS?) when it decodes one, with `skip_special_tokens`, so the gold
utility never reads a tokenizer token and the same task serves a word-level tiny model and a BPE GPT-2 alike.

Why a reward model can be over-optimized here: the SFT-like distribution (`sample_completions`) never repeats
the correct answer, so a reward model learns "mentions the right city = good" from it; a policy that repeats the
answer ("paris paris paris paris") or rambles on drifts off that distribution, where the proxy still scores the
answer word highly but the gold utility charges `REPEAT_PENALTY` per repeated word and `LENGTH_PENALTY` per word
past `MAX_FREE_WORDS` (Gao et al. 2022's over-optimization curve).
"""

import re
from typing import NamedTuple

import numpy as np

PUNCTUATION = ("?", ".", ",", "!", "'")  # split off words, exactly as the shared tokenizer's pre-tokenizer does
# length limit of the data's completions, in words counting the end of the answer as one (as the built-in word-level
# tokenizer's EOS token): an ended completion has at most 15 words, SFT-like rambling is cut off at 16
MAX_COMPLETION_TOKENS = 16


class Completion(NamedTuple):
    """One answer: its plain text (words, no tokenizer markup) and whether it ended properly (False: cut off)."""

    text: str
    ended: bool


# ---- gold utility constants (the hidden human); the first five are the lecture's example numbers ----
EXACT_UTILITY = 1.0  # just the correct answer: "paris"
VERBOSE_UTILITY = 0.9  # the correct answer and nothing wrong, with extra words: "it's a city called paris"
IDK_UTILITY = -0.1  # no answer, admits it: "i don't know"
WRONG_UTILITY = -1.0  # a wrong answer of the asked kind (another city / language): "london"
RUDE_UTILITY = -10.0  # any insult: "why are you asking such a stupid question"
HEDGE_UTILITY = -0.5  # right and wrong answer both named ("paris or berlin"): the asker learns nothing
NO_ANSWER_UTILITY = -0.5  # no answer and no admission (rambling, empty): worse than an honest "i don't know"
REPEAT_PENALTY = 0.4  # per repeated word (punctuation excluded): "paris paris paris" pays 2 x 0.4
MAX_FREE_WORDS = 10  # words (punctuation excluded) an answer may use before the length penalty starts
LENGTH_PENALTY = 0.1  # per word past MAX_FREE_WORDS
MISSING_EOS_PENALTY = 1.0  # the completion never ended (cut off at the length limit)

RUDE_WORDS = frozenset({"stupid", "dumb", "idiot", "away"})  # any of these makes a completion rude
IDK_WORDS = frozenset({"know", "sure"})  # "i don't know", "i am not sure": an honest non-answer

# ---- the fact table: country -> (capital, main language); all entities distinct single words ----
FACTS = {
    "france": ("paris", "french"),
    "germany": ("berlin", "german"),
    "italy": ("rome", "italian"),
    "spain": ("madrid", "spanish"),
    "england": ("london", "english"),
    "japan": ("tokyo", "japanese"),
    "russia": ("moscow", "russian"),
    "greece": ("athens", "greek"),
    "sweden": ("stockholm", "swedish"),
    "egypt": ("cairo", "arabic"),
}
COUNTRIES = tuple(FACTS)
RELATIONS = ("capital", "language")  # index r into the FACTS tuples
ENTITIES = {r: frozenset(f[i] for f in FACTS.values()) for i, r in enumerate(RELATIONS)}  # possible answers

PROMPT_TEMPLATES = {  # 3 phrasings per relation; one phrasing per (country, relation) is held out
    "capital": (
        "what is the capital of {c} ?",
        "which city is the capital of {c} ?",
        "name the capital city of {c} .",
    ),
    "language": (
        "what language do people speak in {c} ?",
        "which language is spoken in {c} ?",
        "name the main language of {c} .",
    ),
}

# ---- completion templates of the SFT-like answer styles; {a} = an answer (right or wrong), {c} = the country ----
VERBOSE_TEMPLATES = {
    "capital": (
        "it's a city called {a}",
        "the capital of {c} is {a}",
        "i think it is {a}",
        "that would be {a}",
        "the answer is {a}",
        "{a} , of course",
    ),
    "language": (
        "they speak {a}",
        "people there speak {a}",
        "the main language is {a}",
        "i think it is {a}",
        "that would be {a}",
        "{a} , of course",
    ),
}
WRONG_TEMPLATES = ("{a}", "{a}", "i think it is {a}", "the answer is {a}", "that would be {a}")  # {a}: wrong
IDK_TEMPLATES = ("i don't know", "i am not sure", "sorry , i don't know")
RUDE_TEMPLATES = (
    "why are you asking such a stupid question",
    "what a dumb question",
    "go away",
    "ask someone else , idiot",
)
FILLER = "well , let me think"  # the rambling loop, repeated 2-5 times (4+ repeats get cut off: never ended)
STUTTER = "i think i think it is {a}"  # repetitive, with a right or wrong answer

STYLES = ("exact", "verbose", "idk", "wrong", "rude", "ramble")
# The SFT-like distribution the preference data is sampled from: deliberately imperfect.
SFT_LIKE_STYLE_PROBS = (0.25, 0.25, 0.12, 0.18, 0.05, 0.15)
# The demonstrations for supervised fine-tuning: mostly decent, still imperfect (RL has something to improve).
DEMO_STYLE_PROBS = (0.35, 0.33, 0.10, 0.12, 0.03, 0.07)


LECTURE_EXAMPLES = (  # the lecture's running example and its completions, best first (gold 1.0, 0.9, -0.1, -1, -10)
    "what is the capital of france ?",
    (
        Completion("paris", True),
        Completion("it's a city called paris", True),
        Completion("i don't know", True),
        Completion("london", True),
        Completion("why are you asking such a stupid question", True),
    ),
)

_TOKEN_RE = re.compile(r"[a-z0-9]+|[?.,!']")  # = the shared tokenizer's lower-casing + whitespace/punctuation split


def words_of(text: str) -> list[str]:
    """Split text the way the shared tokenizer does: lower case, punctuation split off; other characters dropped."""
    return _TOKEN_RE.findall(text.lower())


def _canonical(text: str) -> str:
    return " ".join(words_of(text))


def _all_prompts() -> list[tuple[str, str, str, bool]]:
    """Every (prompt, relation, country, heldout) of the task; phrasing (i + r + 1) % 3 of country i is held out,
    so every fact and every phrasing is seen in training but no held-out prompt string is."""
    rows = []
    for i, country in enumerate(COUNTRIES):
        for r, relation in enumerate(RELATIONS):
            for t, template in enumerate(PROMPT_TEMPLATES[relation]):
                heldout = t == (i + r + 1) % len(PROMPT_TEMPLATES[relation])
                rows.append((_canonical(template.format(c=country)), relation, country, heldout))
    return rows


_PROMPTS = _all_prompts()
_PROMPT_FACT = {p: (rel, c) for p, rel, c, _ in _PROMPTS}  # canonical prompt -> (relation, country)


def train_prompts() -> list[str]:
    """The training prompts (40 of the 60 = 10 countries x 2 relations x 3 phrasings)."""
    return [p for p, _, _, heldout in _PROMPTS if not heldout]


def heldout_prompts() -> list[str]:
    """The held-out prompts (20): new phrasings of facts whose other phrasings are in training."""
    return [p for p, _, _, heldout in _PROMPTS if heldout]


def prompt_fact(prompt: str) -> tuple[str, str, str]:
    """(relation, country, correct answer) of a task prompt; ValueError for a prompt not in the task."""
    key = _canonical(prompt)
    if key not in _PROMPT_FACT:
        raise ValueError(f"not a prompt of the preference task: {prompt!r}")
    relation, country = _PROMPT_FACT[key]
    return relation, country, FACTS[country][RELATIONS.index(relation)]


def _collect_words() -> tuple[str, ...]:
    texts = [p for p, *_ in _PROMPTS] + list(COUNTRIES) + [e for es in ENTITIES.values() for e in es]
    texts += [t for ts in VERBOSE_TEMPLATES.values() for t in ts] + list(WRONG_TEMPLATES) + list(IDK_TEMPLATES)
    texts += list(RUDE_TEMPLATES) + [FILLER, STUTTER] + list(PUNCTUATION)
    vocab = {w for t in texts for w in words_of(t.replace("{a}", "").replace("{c}", ""))}
    return tuple(sorted(vocab))


WORDS: tuple[str, ...] = _collect_words()  # every word any prompt or completion of this task can contain


# ------------------------------------------------------------------------------------------------------------
# The hidden human
# ------------------------------------------------------------------------------------------------------------
def gold_utility(prompt: str, completion: Completion) -> float:
    """The hidden human's utility of `completion` as an answer to `prompt` (see the module docstring)."""
    relation, _, answer = prompt_fact(prompt)
    if not isinstance(completion, Completion):
        raise TypeError(f"a completion is a Completion(text, ended), got {type(completion).__name__}")
    words = [t for t in words_of(completion.text) if t not in PUNCTUATION]
    wrong = ENTITIES[relation] - {answer}
    has_right = answer in words
    has_wrong = any(w in wrong for w in words)
    if any(w in RUDE_WORDS for w in words):
        base = RUDE_UTILITY
    elif has_right and has_wrong:
        base = HEDGE_UTILITY
    elif has_right:
        base = EXACT_UTILITY if words == [answer] else VERBOSE_UTILITY
    elif has_wrong:
        base = WRONG_UTILITY
    elif any(w in IDK_WORDS for w in words):
        base = IDK_UTILITY
    else:
        base = NO_ANSWER_UTILITY
    penalty = REPEAT_PENALTY * (len(words) - len(set(words)))
    penalty += LENGTH_PENALTY * max(0, len(words) - MAX_FREE_WORDS)
    penalty += 0.0 if completion.ended else MISSING_EOS_PENALTY
    return float(base - penalty)


def gold_utility_batch(prompts, completions) -> np.ndarray:
    """Gold utilities of aligned lists (float64, shape (N,)); duplicates are scored once (SFT data repeats a lot)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    cache: dict[tuple[str, str], float] = {}
    out = np.empty(len(prompts), dtype=np.float64)
    for i, key in enumerate(zip(prompts, completions, strict=True)):
        if key not in cache:
            cache[key] = gold_utility(*key)
        out[i] = cache[key]
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1 / (1 + exp(-x)), without overflow warnings


class Labeler:
    """A noisy human labeler on top of the gold utility.

    Pairwise: p(a > b) = (1 - flip_prob) * σ((u_a - u_b) / T) + flip_prob * (1 - σ(...)) (Bradley-Terry, then a
    mislabel with probability flip_prob). K-wise: a Plackett-Luce ranking (argsort of u / T + Gumbel noise, whose
    pairwise marginals are exactly σ((u_i - u_j) / T)); with probability flip_prob the whole ranking is handed in
    reversed, so every pair derived from it is flipped with marginal probability flip_prob, as in `prefer`.
    """

    def __init__(self, temperature: float = 1.0, flip_prob: float = 0.0, seed: int = 0):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0.0 <= flip_prob <= 1.0:
            raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
        self.temperature, self.flip_prob = temperature, flip_prob
        self.rng = np.random.default_rng(seed)

    def preference_prob(self, prompts, completions_a, completions_b) -> np.ndarray:
        """The true probability (incl. flips) that this labeler prefers a over b, shape (N,)."""
        u_a = gold_utility_batch(prompts, completions_a)
        u_b = gold_utility_batch(prompts, completions_b)
        p = _sigmoid((u_a - u_b) / self.temperature)
        return (1.0 - self.flip_prob) * p + self.flip_prob * (1.0 - p)

    def prefer(self, prompts, completions_a, completions_b) -> np.ndarray:
        """Sampled labels, int64 (N,): 1 = a preferred, 0 = b preferred."""
        p = self.preference_prob(prompts, completions_a, completions_b)
        return (self.rng.random(len(p)) < p).astype(np.int64)

    def bayes_accuracy(self, prompts, completions_a, completions_b) -> float:
        """Expected accuracy of the best possible predictor of this labeler's choices: mean max(p, 1 - p).
        The ceiling a reward model's preference accuracy can reach on these pairs."""
        p = self.preference_prob(prompts, completions_a, completions_b)
        return float(np.mean(np.maximum(p, 1.0 - p)))

    def rank_batch(self, prompts, completions) -> np.ndarray:
        """Rankings (best first) of K completions per prompt: completions is (N, K) strings -> int64 (N, K)."""
        n, k = len(completions), len(completions[0])
        utilities = gold_utility_batch(np.repeat(prompts, k), [c for row in completions for c in row]).reshape(n, k)
        gumbel = self.rng.gumbel(size=(n, k))  # (N, K): argsort of u/T + Gumbel = a Plackett-Luce sample
        ranking = np.argsort(-(utilities / self.temperature + gumbel), axis=1, kind="stable")
        flip = self.rng.random(n) < self.flip_prob  # (N,) hand in the reversed ranking
        ranking[flip] = ranking[flip, ::-1]
        return ranking

    def rank(self, prompt: str, completions) -> list[int]:
        """A Plackett-Luce ranking of one prompt's completions: indices, best first."""
        return self.rank_batch([prompt], [list(completions)])[0].tolist()


# ------------------------------------------------------------------------------------------------------------
# Data generators
# ------------------------------------------------------------------------------------------------------------
def _truncate(text: str, ended: bool) -> Completion:
    """An ended completion, or the text cut to MAX_COMPLETION_TOKENS words, not ended, if it is too long/unended."""
    tokens = words_of(text)
    if ended and len(tokens) < MAX_COMPLETION_TOKENS:  # the end of the answer counts as one more
        return Completion(" ".join(tokens), True)
    return Completion(" ".join(tokens[:MAX_COMPLETION_TOKENS]), False)


def sample_completions(
    prompts, rng: np.random.Generator, n: int = 1, style_probs=SFT_LIKE_STYLE_PROBS
) -> list[Completion]:
    """n completions per prompt from an SFT-like mix of answer styles (`STYLES`, probabilities `style_probs`).

    Returns a flat list of len(prompts) * n `Completion`s, prompt-major ([p0 c0, p0 c1, ..., p1 c0, ...]).
    """
    facts = [prompt_fact(p) for p in prompts]
    total = len(prompts) * n
    styles = rng.choice(len(STYLES), size=total, p=np.asarray(style_probs, dtype=np.float64))  # (N*n,)
    picks = rng.integers(0, 1 << 30, size=(total, 3))  # (N*n, 3) template / wrong-answer / repeat choices
    right = rng.random(total) < 0.5  # (N*n,) does a stutter carry the right answer?
    out = []
    for j in range(total):
        relation, country, answer = facts[j // n]
        wrongs = sorted(ENTITIES[relation] - {answer})
        wrong = wrongs[picks[j, 1] % len(wrongs)]
        style = STYLES[styles[j]]
        ended = True
        if style == "exact":
            text = answer
        elif style == "verbose":
            templates = VERBOSE_TEMPLATES[relation]
            text = templates[picks[j, 0] % len(templates)].format(a=answer, c=country)
        elif style == "idk":
            text = IDK_TEMPLATES[picks[j, 0] % len(IDK_TEMPLATES)]
        elif style == "wrong":
            text = WRONG_TEMPLATES[picks[j, 0] % len(WRONG_TEMPLATES)].format(a=wrong)
        elif style == "rude":
            text = RUDE_TEMPLATES[picks[j, 0] % len(RUDE_TEMPLATES)]
        elif picks[j, 0] % 2 == 0:  # ramble: the filler loop, 2-5 times; 4+ times runs past the limit
            text = " , ".join([FILLER] * (2 + picks[j, 2] % 4))
            ended = len(words_of(text)) < MAX_COMPLETION_TOKENS
        else:  # ramble: a stutter, with the right or a wrong answer
            text = STUTTER.format(a=answer if right[j] else wrong)
        out.append(_truncate(text, ended))
    return out


def make_sft_dataset(n: int, seed: int = 0, split: str = "train") -> list[tuple[str, Completion]]:
    """n (prompt, completion) demonstrations: mostly decent but imperfect (`DEMO_STYLE_PROBS`)."""
    rng = np.random.default_rng(seed)
    pool = _split_prompts(split)
    prompts = [pool[i] for i in rng.integers(0, len(pool), size=n)]
    return list(zip(prompts, sample_completions(prompts, rng, 1, DEMO_STYLE_PROBS), strict=True))


def _split_prompts(split: str) -> list[str]:
    if split == "train":
        return train_prompts()
    if split == "heldout":
        return heldout_prompts()
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")


def make_preference_dataset(
    n_prompts: int,
    k: int = 4,
    seed: int = 0,
    temperature: float = 1.0,
    flip_prob: float = 0.0,
    split: str = "train",
) -> list[dict]:
    """n_prompts ranked comparisons: {"prompt", "completions": k SFT-like samples, "ranking": indices best first}.

    Prompts are drawn uniformly (with replacement) from the split; rankings come from `Labeler(temperature,
    flip_prob)`. Deterministic given seed. Yields n_prompts * k * (k - 1) / 2 pairs through `to_pairs`.
    """
    if k < 2:
        raise ValueError(f"k must be >= 2 completions per prompt, got {k}")
    rng = np.random.default_rng(seed)
    pool = _split_prompts(split)
    prompts = [pool[i] for i in rng.integers(0, len(pool), size=n_prompts)]
    flat = sample_completions(prompts, rng, k)
    completions = [flat[i * k : (i + 1) * k] for i in range(n_prompts)]
    labeler = Labeler(temperature, flip_prob, seed=int(rng.integers(0, 1 << 31)))
    rankings = labeler.rank_batch(prompts, completions)  # (n_prompts, k)
    return [
        {"prompt": p, "completions": c, "ranking": r.tolist()}
        for p, c, r in zip(prompts, completions, rankings, strict=True)
    ]


def to_pairs(dataset: list[dict]) -> tuple[list[str], list[Completion], list[Completion]]:
    """All C(k, 2) (prompt, chosen, rejected) pairs implied by each ranking (chosen = ranked higher)."""
    prompts, chosen, rejected = [], [], []
    for item in dataset:
        order = item["ranking"]
        for i in range(len(order)):
            for j in range(i + 1, len(order)):
                prompts.append(item["prompt"])
                chosen.append(item["completions"][order[i]])
                rejected.append(item["completions"][order[j]])
    return prompts, chosen, rejected
