"""Tests of the single-turn preference task: gold utility, labeler, data generators (envs/preference.py)."""

import math

import numpy as np
import pytest

from envs import preference as P
from envs.preference import Completion
from envs.tokenizer import build_tokenizer

PARIS = "what is the capital of france ?"


def ended(text: str) -> Completion:
    return Completion(text, ended=True)


def test_gold_utility_orders_lecture_examples_with_lecture_numbers():
    prompt, completions = P.LECTURE_EXAMPLES
    assert prompt == PARIS
    u = [P.gold_utility(prompt, c) for c in completions]
    assert u == pytest.approx([1.0, 0.9, -0.1, -1.0, -10.0])  # the lecture's numbers, best first
    assert all(a > b for a, b in zip(u, u[1:], strict=False))
    # the same answers, phrased the way a decoded word-level tokenizer output looks, score the same
    assert P.gold_utility(prompt, ended("it ' s a city called paris")) == pytest.approx(0.9)
    assert P.gold_utility(prompt, ended("i don ' t know")) == pytest.approx(-0.1)
    # and the way a real model writes: capitals, glued punctuation
    assert P.gold_utility(prompt, ended("It's a city called Paris.")) == pytest.approx(0.9)


def test_a_properly_ended_answer_carries_no_penalty_and_the_task_text_has_no_markup():
    # the task speaks words: the end of an answer is a flag, never a token in the text
    assert P.gold_utility(PARIS, Completion("paris", ended=True)) == P.EXACT_UTILITY
    assert P.gold_utility(PARIS, Completion("paris", ended=False)) == P.EXACT_UTILITY - P.MISSING_EOS_PENALTY
    for text in P.WORDS:
        assert "<" not in text and ">" not in text and "eos" not in text
    samples = P.sample_completions(P.train_prompts() * 10, np.random.default_rng(0), n=2)
    for c in samples:
        assert "<" not in c.text and c.text == c.text.strip()
    with pytest.raises(TypeError, match="Completion"):
        P.gold_utility(PARIS, "paris")  # a bare string does not say whether the answer ended


def test_gold_utility_penalizes_degenerate_text():
    good = P.gold_utility(PARIS, ended("paris"))
    repeated = P.gold_utility(PARIS, ended("paris paris paris paris"))
    assert repeated == pytest.approx(0.9 - 3 * P.REPEAT_PENALTY)  # 3 repeated words
    assert repeated < good
    # repeating the right answer many times is worse than an honest "i don't know"
    assert P.gold_utility(PARIS, ended("paris " * 8)) < P.gold_utility(PARIS, ended("i don't know"))
    # an answer that never ended (cut off) costs MISSING_EOS_PENALTY
    assert P.gold_utility(PARIS, Completion("paris", ended=False)) == pytest.approx(1.0 - P.MISSING_EOS_PENALTY)
    # length past MAX_FREE_WORDS costs LENGTH_PENALTY per word (14 distinct words -> 4 over)
    long = "the capital of france is paris , a city that people there speak french in"
    n_words = len([w for w in P.words_of(long) if w not in P.PUNCTUATION])
    assert n_words == 14
    expected = P.VERBOSE_UTILITY - P.LENGTH_PENALTY * (n_words - P.MAX_FREE_WORDS)
    assert P.gold_utility(PARIS, ended(long)) == pytest.approx(expected)
    # hedging between the right and a wrong city; rude beats everything
    assert P.gold_utility(PARIS, ended("paris or berlin")) == pytest.approx(P.HEDGE_UTILITY - 0.0)
    assert P.gold_utility(PARIS, ended("paris , idiot")) == pytest.approx(P.RUDE_UTILITY)


def test_unknown_prompt_is_a_clear_error():
    with pytest.raises(ValueError, match="not a prompt"):
        P.gold_utility("what is the meaning of life ?", ended("42"))


def test_gold_utility_batch_matches_scalar():
    ds = P.make_sft_dataset(300, seed=3)
    prompts, completions = zip(*ds, strict=True)
    batch = P.gold_utility_batch(prompts, completions)
    assert batch.shape == (300,)
    np.testing.assert_allclose(batch, [P.gold_utility(p, c) for p, c in ds])


@pytest.mark.parametrize("u1,u2,temperature,flip", [(2.0, 0.0, 1.0, 0.0), (1.0, -0.1, 0.5, 0.0), (1.0, -1.0, 1.0, 0.2)])
def test_labeler_frequencies_match_bradley_terry(u1, u2, temperature, flip):
    # build two completions with the wanted utilities: u("paris")=1, u("i don't know")=-0.1, u("london")=-1
    # and Problem 21.3's 2.0 vs 0.0 as a utility difference of 2 at T=1 (paris vs london)
    by_u = {1.0: ended("paris"), -0.1: ended("i don't know"), -1.0: ended("london"), 0.9: ended("that would be paris")}
    if (u1, u2) == (2.0, 0.0):
        a, b, diff = by_u[1.0], by_u[-1.0], 2.0  # difference 2.0, as in Problem 21.3
    else:
        a, b, diff = by_u[u1], by_u[u2], u1 - u2
    n = 40_000
    labeler = P.Labeler(temperature=temperature, flip_prob=flip, seed=1)
    labels = labeler.prefer([PARIS] * n, [a] * n, [b] * n)
    p_bt = 1.0 / (1.0 + math.exp(-diff / temperature))
    p = (1 - flip) * p_bt + flip * (1 - p_bt)
    se = math.sqrt(p * (1 - p) / n)
    assert abs(labels.mean() - p) < 4 * se
    if (u1, u2, temperature, flip) == (2.0, 0.0, 1.0, 0.0):
        assert p == pytest.approx(0.8808, abs=1e-4)  # the lecture's "≈ 0.88"
        assert labels.mean() == pytest.approx(0.88, abs=0.01)


def test_rankings_have_bradley_terry_pairwise_marginals():
    # Plackett-Luce with K=3: P(i ranked above j) must be σ(u_i - u_j) for every pair, with flips as in prefer()
    completions = [ended("paris"), ended("i don't know"), ended("london")]  # u = 1.0, -0.1, -1.0
    u = np.array([1.0, -0.1, -1.0])
    n = 30_000
    for flip in (0.0, 0.25):
        labeler = P.Labeler(temperature=1.0, flip_prob=flip, seed=2)
        ranks = labeler.rank_batch([PARIS] * n, [completions] * n)  # (n, 3)
        position = np.argsort(ranks, axis=1)  # position[n, i] = place of completion i
        for i, j in [(0, 1), (0, 2), (1, 2)]:
            p_bt = 1 / (1 + np.exp(-(u[i] - u[j])))
            p = (1 - flip) * p_bt + flip * (1 - p_bt)
            freq = np.mean(position[:, i] < position[:, j])
            assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert sorted(P.Labeler(seed=0).rank(PARIS, completions)) == [0, 1, 2]


def test_bayes_accuracy_hand_case():
    prompts = [PARIS] * 3
    a = [ended("paris"), ended("paris"), ended("london")]
    b = [ended("london"), ended("paris"), ended("i don't know")]
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # diffs 2.0, 0.0, -0.9 at T=1 -> max(p, 1-p) = σ(2), 0.5, σ(0.9)
    expected = (s(2.0) + 0.5 + s(0.9)) / 3
    assert P.Labeler(temperature=1.0).bayes_accuracy(prompts, a, b) == pytest.approx(expected)
    # with flip noise 0.1: p' = 0.9 p + 0.1 (1 - p)
    f = lambda p: max(0.9 * p + 0.1 * (1 - p), 1 - (0.9 * p + 0.1 * (1 - p)))  # noqa: E731
    expected = (f(s(2.0)) + 0.5 + f(s(-0.9))) / 3
    assert P.Labeler(flip_prob=0.1).bayes_accuracy(prompts, a, b) == pytest.approx(expected)
    # a flip probability of 0.5 makes labels pure noise: ceiling 0.5
    assert P.Labeler(flip_prob=0.5).bayes_accuracy(prompts, a, b) == pytest.approx(0.5)


def test_generators_are_deterministic_given_seed():
    assert P.make_sft_dataset(200, seed=5) == P.make_sft_dataset(200, seed=5)
    assert P.make_sft_dataset(200, seed=5) != P.make_sft_dataset(200, seed=6)
    d1 = P.make_preference_dataset(100, k=4, seed=7, flip_prob=0.1)
    assert d1 == P.make_preference_dataset(100, k=4, seed=7, flip_prob=0.1)
    assert d1 != P.make_preference_dataset(100, k=4, seed=8, flip_prob=0.1)
    r1 = P.sample_completions([PARIS] * 50, np.random.default_rng(0), n=3)
    assert r1 == P.sample_completions([PARIS] * 50, np.random.default_rng(0), n=3) and len(r1) == 150


def test_train_and_heldout_prompts_are_disjoint_and_cover_every_fact():
    train, heldout = P.train_prompts(), P.heldout_prompts()
    assert len(train) == 40 and len(heldout) == 20 and not set(train) & set(heldout)
    assert P.LECTURE_EXAMPLES[0] in train
    facts = lambda ps: {P.prompt_fact(p) for p in ps}  # noqa: E731
    assert facts(heldout) <= facts(train)  # every held-out fact is taught in training, in other words
    assert {p for d in P.make_preference_dataset(200, seed=1, split="heldout") for p in [d["prompt"]]} <= set(heldout)
    with pytest.raises(ValueError, match="split"):
        P.make_preference_dataset(5, split="test")


def test_preference_dataset_shapes_and_pairs():
    data = P.make_preference_dataset(50, k=4, seed=0)
    assert len(data) == 50
    for item in data:
        assert len(item["completions"]) == 4 and sorted(item["ranking"]) == [0, 1, 2, 3]
    prompts, chosen, rejected = P.to_pairs(data)
    assert len(prompts) == len(chosen) == len(rejected) == 50 * 6  # C(4, 2) pairs per prompt
    first = data[0]
    assert chosen[0] == first["completions"][first["ranking"][0]]
    assert rejected[5] == first["completions"][first["ranking"][3]]
    # with a near-deterministic labeler chosen is never worse than rejected by the gold utility
    sharp = P.to_pairs(P.make_preference_dataset(200, k=3, seed=0, temperature=1e-3))
    assert np.all(P.gold_utility_batch(sharp[0], sharp[1]) >= P.gold_utility_batch(sharp[0], sharp[2]))


def test_sft_like_samples_mix_all_styles_and_end_properly_or_are_cut():
    rng = np.random.default_rng(0)
    samples = P.sample_completions(P.train_prompts() * 30, rng, n=1)
    prompts = P.train_prompts() * 30
    u = P.gold_utility_batch(prompts, samples)
    for value in (1.0, 0.9, -0.1, -1.0, -10.0):
        assert np.mean(np.isclose(u, value)) > 0.02, value  # every lecture style is present
    assert -2.0 < np.mean(u) < 0.0  # imperfect (5% rude at -10): room for RL to improve
    for s in samples:
        n_words = len(P.words_of(s.text))
        assert (s.ended and n_words < P.MAX_COMPLETION_TOKENS) or (not s.ended and n_words == P.MAX_COMPLETION_TOKENS)
    assert any(not s.ended for s in samples)  # some rambling is cut off
    demos = P.make_sft_dataset(2000, seed=0)
    assert np.mean(P.gold_utility_batch(*zip(*demos, strict=True))) > np.mean(u)  # demos are better on average


def test_tokenizer_covers_every_word_of_the_task():
    tok = build_tokenizer(words=list(P.WORDS))
    texts = P.train_prompts() + P.heldout_prompts() + [c.text for c in P.LECTURE_EXAMPLES[1]]
    samples = P.sample_completions(P.train_prompts() * 20 + P.heldout_prompts() * 20, np.random.default_rng(0), n=3)
    texts += [c.text for c in samples]
    ids = tok(texts).input_ids
    assert all(tok.unk_token_id not in row for row in ids)
    # decoding reproduces the canonical word sequence the gold utility parses
    assert tok.decode(tok("it's a city called paris").input_ids) == "it ' s a city called paris"
    assert P.words_of(tok.decode(ids[-1])) == P.words_of(texts[-1])
