"""Tests of `seqrl/GuessTheImage-v0` (envs/guess_image.py): env API, answerer, optimal value, data, tokens."""

import json
import random

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers the env ids)
import envs.guess_image as G
from envs.tokenizer import PUNCTUATION, build_tokenizer

ENV_ID = "seqrl/GuessTheImage-v0"
C = G.QUESTION_COST


@pytest.fixture(scope="module")
def tokenizer():
    # the task's own words + punctuation (the full shared vocabulary also holds the preference task's words)
    return build_tokenizer(words=[*G.WORDS, *PUNCTUATION])


def env_with_secret(secret: int, **kwargs):
    """A reset env whose secret is `secret` (found by trying seeds; the secret is drawn from the seeded rng)."""
    env = gym.make(ENV_ID, **kwargs)
    for seed in range(1000):
        obs, info = env.reset(seed=seed)
        if info["secret_id"] == secret:
            return env, obs, info
    raise AssertionError("no seed gives this secret")


# ----------------------------------------------------------------------------------------------------- env API
def test_check_env_and_render():
    env = gym.make(ENV_ID, render_mode="ansi")
    check_env(env.unwrapped, skip_render_check=False)
    obs, info = env.reset(seed=0)
    assert obs == "" and info["n_candidates"] == G.N_OBJECTS == 18
    env.step("is it big ?")
    text = env.render()
    assert "Q: is it big ?" in text and info["secret"] in text


def test_scripted_episode_rewards_and_text():
    secret = G.OBJECTS.index(("small", "green", "triangle"))
    env, obs, info = env_with_secret(secret)
    assert info["secret"] == "small green triangle"
    script = [
        ("is it big ?", "no , it is not big ."),
        ("Is it GREEN?", "yes , it is green ."),
        ("is it a circle ?", "no , it is not a circle ."),
    ]
    for k, (utterance, reply) in enumerate(script):
        obs, reward, terminated, truncated, info = env.step(utterance)
        assert (info["reply"], reward, terminated, truncated) == (reply, -C, False, False)
        assert info["turn"] == k + 1
    assert obs == (  # plain text, one utterance or reply per line, no tokenizer markup
        "is it big ?\nno , it is not big .\nis it green ?\nyes , it is green .\n"
        "is it a circle ?\nno , it is not a circle ."
    )
    shown = ["is it big ?", "is it green ?", "is it a circle ?"]  # utterances as the history shows them
    assert G.parse_history(obs) == [(u, reply) for u, (_, reply) in zip(shown, script, strict=True)]
    obs, reward, terminated, truncated, info = env.step("it is the small green triangle .")
    assert (info["reply"], reward, terminated, truncated, info["success"]) == ("correct .", 1.0, True, False, True)
    with pytest.raises(RuntimeError):
        env.step("is it big ?")
    env, _, _ = env_with_secret(secret)
    _, reward, terminated, _, info = env.step("it is the big green triangle .")
    assert (info["reply"], reward, terminated, info["success"]) == ("wrong .", 0.0, True, False)


def test_turn_limit_truncates():
    env = gym.make(ENV_ID, max_turns=3)
    env.reset(seed=1)
    outcomes = [env.step("is it red ?")[2:4] for _ in range(3)]
    assert outcomes == [(False, False), (False, False), (False, True)]


def test_answer_noise_flips():
    secret = G.OBJECTS.index(("big", "red", "circle"))
    env, _, _ = env_with_secret(secret, answer_noise=1.0)
    assert env.step("is it big ?")[4]["reply"] == "no , it is not big ."  # noise 1: every yes/no answer is flipped
    with pytest.raises(ValueError):
        gym.make(ENV_ID, answer_noise=1.5)


JUNK = [
    "",
    " ",
    "?",
    "is it",
    "is it red",  # missing "?"
    "is it purple ?",
    "it is the red big circle .",  # wrong word order
    "is it red ? is it red ?",
    "ünïcødé 💥 ☃ 中文",
    "<sep> yes . <sep> it is the big red circle .",  # tries to forge a reply with tokenizer markup
    "is it red ?\nyes , it is red .\nit is the big red circle .",  # ... or with the text's own line breaks
    "<unk> <pad> <eos> <|endoftext|> </s>",
    "x" * 100_000,
    "is it red ? " * 5_000,
    "\x00\n\t\r",
]


@pytest.mark.parametrize("junk", JUNK, ids=range(len(JUNK)))
def test_junk_never_crashes(junk):
    env = gym.make(ENV_ID)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(junk)
    assert info["reply"] == G.NOT_UNDERSTOOD and not info["valid"]
    assert (reward, terminated, truncated) == (-C, False, False)
    assert env.observation_space.contains(obs)
    assert obs.endswith(f"\n{G.NOT_UNDERSTOOD}") and obs.count("\n") == 1  # no forged turn
    assert G.parse_history(obs) == [(info["utterance"], G.NOT_UNDERSTOOD)]
    assert "<" not in obs and ">" not in obs  # no tokenizer markup reaches the task text


@pytest.mark.parametrize("junk", [None, 123, b"is it red ?", ["is it red ?"]])
def test_non_string_actions_are_not_understood(junk):
    env = gym.make(ENV_ID, disable_env_checker=True)
    env.reset(seed=0)
    assert env.step(junk)[4]["reply"] == G.NOT_UNDERSTOOD


def test_random_text_actions_fill_an_episode():
    env = gym.make(ENV_ID)
    env.reset(seed=0)
    env.action_space.seed(0)
    for _ in range(G.MAX_TURNS):
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        assert env.observation_space.contains(obs)
    assert truncated and not terminated


def test_utterance_sets():
    assert len(G.all_questions()) == 8 and len(G.all_guesses()) == 18
    assert len(set(G.all_utterances())) == 26
    assert "is it red ?" in G.all_questions() and "is it a circle ?" in G.all_questions()
    assert G.all_guesses()[G.OBJECTS.index(("big", "red", "circle"))] == "it is the big red circle ."
    for u in G.all_utterances():  # every valid utterance is understood, and shown as written
        shown, reply, *_ = G.respond(0, u)
        assert shown == u and reply != G.NOT_UNDERSTOOD


# ----------------------------------------------------------------------------------------------- optimal value
def test_optimal_value_exact():
    assert G.OPTIMAL_MEAN_QUESTIONS == pytest.approx(13 / 3)
    assert G.OPTIMAL_MEAN_RETURN == pytest.approx(1 - 0.05 * 13 / 3)
    assert G.optimal_value() == pytest.approx(G.OPTIMAL_MEAN_RETURN, abs=1e-12)  # DP over beliefs
    exact = G.exact_policy_stats(G.OptimalPolicy(random_ties=False))  # enumeration over all 18 secrets
    assert exact["success_rate"] == G.OPTIMAL_SUCCESS_RATE == 1.0
    assert exact["mean_return"] == pytest.approx(G.OPTIMAL_MEAN_RETURN, abs=1e-12)
    assert exact["mean_length"] == pytest.approx(G.OPTIMAL_MEAN_LENGTH)
    # short turn limits by hand: k questions split the 18 objects into at most 2^k classes and the final guess is
    # right with probability (#classes)/18, so V = max_k (2^k / 18 - c k) over k <= max_turns - 1 questions
    assert G.optimal_value(max_turns=1) == pytest.approx(1 / 18)  # one turn: guess blind
    assert G.optimal_value(max_turns=2) == pytest.approx(2 / 18 - C)
    assert G.optimal_value(max_turns=3) == pytest.approx(4 / 18 - 2 * C)
    # from a belief state: one object left -> guess it; two left -> ask once if a turn is left for the guess
    two_left = 0b11  # OBJECTS[0], OBJECTS[1] differ in shape only
    assert G.belief_value(0b1, 1) == 1.0 and G.belief_value(two_left, 1) == 0.5
    assert G.belief_value(two_left, 2) == pytest.approx(1 - C)


def test_optimal_policy_measured_matches_stated_value():
    result = G.evaluate_policy(G.OptimalPolicy(), n_episodes=3000, seed=0)
    assert result["success_rate"] == 1.0
    stderr = result["return_std"] / np.sqrt(3000)
    assert abs(result["mean_return"] - G.OPTIMAL_MEAN_RETURN) < 4 * stderr + 1e-9


def test_optimal_policy_through_gym_env():
    env = gym.make(ENV_ID)
    policy, rng, returns, successes = G.OptimalPolicy(), random.Random(0), [], []
    for episode in range(300):
        obs, _ = env.reset(seed=episode)
        done, ret = False, 0.0
        while not done:  # the policy reads the observation text
            obs, reward, terminated, truncated, info = env.step(policy.act(obs, rng))
            ret, done = ret + reward, terminated or truncated
        returns.append(ret)
        successes.append(info["success"])
    assert np.mean(successes) == 1.0
    assert abs(np.mean(returns) - G.OPTIMAL_MEAN_RETURN) < 4 * np.std(returns) / np.sqrt(300)


def test_random_policy_value_and_normalized_score():
    result = G.evaluate_policy(G.RandomPolicy(), n_episodes=20_000, seed=1)
    assert abs(result["mean_return"] - G.RANDOM_MEAN_RETURN) < 4 * result["return_std"] / np.sqrt(20_000)
    assert G.random_policy_value(max_turns=1) == pytest.approx(1 / 26 - 8 / 26 * C)  # right guess or a question
    assert G.normalized_score(G.RANDOM_MEAN_RETURN) == pytest.approx(0.0)
    assert G.normalized_score(G.OPTIMAL_MEAN_RETURN) == pytest.approx(100.0)


def test_answer_noise_policies_do_not_break():
    # contradicting answers make the consistent set empty; tracking falls back to the fewest-mismatch objects
    history = [("is it big ?", "yes , it is big ."), ("is it small ?", "yes , it is small .")]
    assert G.consistent_mask(history) == G.ALL_MASK
    noisy = G.evaluate_policy(G.OptimalPolicy(), n_episodes=2000, seed=0, answer_noise=0.2)
    assert 0.3 < noisy["success_rate"] < 0.9  # noise hurts the noiseless-optimal questioner
    assert len(G.make_dataset(200, seed=0, answer_noise=0.2)) == 200


def test_blind_guess_succeeds_one_in_eighteen():
    # secrets are stratified, so a constant guess over 18k episodes is right exactly 1000 times
    result = G.evaluate_policy(lambda history: "it is the big red circle .", n_episodes=18 * 1000, seed=3)
    assert result["success_rate"] == pytest.approx(1 / 18)
    assert result["mean_length"] == 1.0


def test_evaluate_policy_batched_callable():
    class Batched:
        calls = 0

        def act_batch(self, histories):
            self.calls += 1  # one call per turn for all active dialogues
            policy = G.OptimalPolicy(random_ties=False)
            return [policy.act(h, None) for h in histories]

    batched = Batched()
    result = G.evaluate_policy(batched, n_episodes=180, seed=0)
    assert result["success_rate"] == 1.0
    assert result["mean_return"] == pytest.approx(G.OPTIMAL_MEAN_RETURN)  # stratified secrets: exact
    assert batched.calls == 6  # at most 5 questions + 1 guess


# ------------------------------------------------------------------------------------------------------- data
def test_dataset_deterministic_and_stats_match_recount(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    stats = G.write_dataset(a, 2000, seed=7)
    G.write_dataset(b, 2000, seed=7)
    assert a.read_bytes() == b.read_bytes()
    assert G.make_dataset(50, seed=8) != G.make_dataset(50, seed=7)
    lines = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(lines) == 2000 and lines == G.read_dataset(a)
    recount: dict[str, list] = {}
    for d in lines:  # recount by hand from the raw turns
        ret = sum(t["reward"] for t in d["turns"])
        assert d["return"] == pytest.approx(ret)
        assert d["success"] == (d["turns"][-1]["reply"] == G.CORRECT)
        assert len(d["turns"]) <= G.MAX_TURNS
        assert all(t["reply"] != G.NOT_UNDERSTOOD for t in d["turns"])  # behaviors only say valid things
        recount.setdefault(d["policy"], []).append((ret, d["success"]))
    assert set(recount) == set(G.DEFAULT_MIXTURE)
    for name, rows in recount.items():
        per = stats["per_policy"][name]
        assert per["n"] == len(rows)
        assert per["mean_return"] == pytest.approx(sum(r for r, _ in rows) / len(rows))
        assert per["success_rate"] == pytest.approx(sum(s for _, s in rows) / len(rows))
    assert stats["mean_return"] == pytest.approx(np.mean([d["return"] for d in lines]))


def test_dataset_replays_in_gym_env():
    for d in G.make_dataset(20, seed=3):
        env, obs, _ = env_with_secret(d["secret_id"])
        for k, turn in enumerate(d["turns"]):
            obs, reward, *_ = env.step(turn["agent"])
            assert obs == G.dialogue_to_text(d["turns"][: k + 1])
            assert reward == turn["reward"]


def test_default_mixture_makes_offline_rl_worth_it():
    stats = G.dataset_stats(G.make_dataset(10_000, seed=0))
    per = stats["per_policy"]
    best = max(p["mean_return"] for p in per.values())
    assert stats["mean_return"] < best - 0.1  # cloning everything is clearly worse than the best behavior
    assert best < G.OPTIMAL_MEAN_RETURN - 0.15  # ... which is clearly worse than the optimal questioner
    assert per["hasty"]["mean_length"] < per["thorough"]["mean_length"] - 2  # hasty asks few questions
    assert per["hasty"]["success_rate"] < 0.65 and per["thorough"]["success_rate"] > 0.8  # ... thorough guesses right


def test_bad_mixture_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown behavior"):
        G.make_dataset(10, seed=0, mixture={"oracle": 1.0})


# ----------------------------------------------------------------------------------------------------- tokens
def test_tokenize_dialogue_hand_example(tokenizer):
    turns = [
        {"agent": "is it red ?", "reply": "no .", "reward": -C},
        {"agent": "it is the big green circle .", "reply": "correct .", "reward": 1.0},
    ]
    out = G.tokenize_dialogue(turns, tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(out["input_ids"].tolist())
    # fmt: off
    assert tokens == ["<bos>", "is", "it", "red", "?", "<sep>", "no", ".", "<sep>",
                      "it", "is", "the", "big", "green", "circle", ".", "<sep>", "correct", ".", "<eos>"]
    assert out["agent_mask"].astype(int).tolist() == [0, 1, 1, 1, 1, 1, 0, 0, 0,
                                                      1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    # fmt: on
    expected_rewards = np.zeros(20, dtype=np.float32)
    expected_rewards[5], expected_rewards[16] = -C, 1.0  # on the agent's <sep> closing each utterance
    np.testing.assert_array_equal(out["rewards"], expected_rewards)
    assert np.flatnonzero(out["dones"]).tolist() == [16]
    assert out["turn_starts"].tolist() == [1, 9] and out["turn_ends"].tolist() == [5, 16]
    # the agent's prompt for turn 2 is exactly the prefix of the dialogue before its first token
    assert G.tokenize_prompt(turns[:1], tokenizer) == out["input_ids"][:9].tolist()
    assert G.tokenize_prompt([], tokenizer) == [tokenizer.bos_token_id]
    assert G.tokenize_prompt(G.dialogue_to_text(turns[:1]), tokenizer) == out["input_ids"][:9].tolist()


def test_tokenized_dataset_consistent(tokenizer):
    dialogues = G.make_dataset(300, seed=1)
    for d, out in zip(dialogues, G.tokenize_dialogues(dialogues, tokenizer), strict=True):
        assert out["rewards"].sum() == pytest.approx(d["return"], abs=1e-5)
        assert out["dones"].sum() == 1 and out["agent_mask"][out["dones"]].all()
        assert len(out["input_ids"]) <= G.max_dialogue_tokens()
        assert out["input_ids"][-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("vocabulary", ["task", "shared"])
def test_no_unk_in_any_utterance_or_reply(tokenizer, vocabulary):
    tokenizer = tokenizer if vocabulary == "task" else build_tokenizer()  # "shared": every language task's words
    for text in [*G.all_utterances(), *G.REPLIES]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text
        assert tokenizer.decode(ids) == text  # round trip


def test_unknown_words_are_shown_as_plain_text():
    """The task text holds no tokenizer markup: an unknown word is "*", which the built-in word-level tokenizer
    reads as its <unk> id (so models trained before this change see the same ids)."""
    assert G.normalize_utterance("Is it PURPLE?") == "is it * ?"
    assert G.normalize_utterance("") == G.normalize_utterance(None) == G.UNKNOWN_WORD == "*"
    assert G.normalize_utterance("<sep> <unk>") == "* * * * * *"
    tok = build_tokenizer()
    assert tok("is it * ?", add_special_tokens=False)["input_ids"] == tok.convert_tokens_to_ids(
        ["is", "it", "<unk>", "?"]
    )


def test_token_layout_uses_the_model_tokenizers_own_special_tokens():
    """A byte-level BPE tokenizer without a separator (as GPT-2 / Llama ship) is a clear error; once the script
    added one, the layout frames the turns with that tokenizer's own BOS / separator / EOS ids."""
    from hf_tiny import build_tokenizer as bpe_tokenizer

    tok = bpe_tokenizer("llama")  # <s> / </s>, no separator, no pad
    turns = [
        {"agent": "is it red ?", "reply": "no , it is not red .", "reward": -C},
        {"agent": "it is the big green circle .", "reply": "correct .", "reward": 1.0},
    ]
    with pytest.raises(ValueError, match="sep_token"):
        G.tokenize_dialogue(turns, tok)
    tok.add_special_tokens({"sep_token": "<sep>"})
    out = G.tokenize_dialogue(turns, tok)
    ids = out["input_ids"].tolist()
    assert ids[0] == tok.bos_token_id == tok.convert_tokens_to_ids("<s>") and ids[-1] == tok.eos_token_id
    assert [ids[i] for i in out["turn_ends"]] == [tok.sep_token_id] * 2 and ids.count(tok.bos_token_id) == 1
    for k, turn in enumerate(turns):  # the agent's tokens decode back to its words
        agent_ids = ids[out["turn_starts"][k] : out["turn_ends"][k]]
        assert tok.decode(agent_ids, skip_special_tokens=True) == turn["agent"]
    assert G.tokenize_prompt(turns[:1], tok) == ids[: out["turn_starts"][1]]


def test_failure_kinds_sorts_every_dialogue_and_counts_wasted_turns():
    def dialogue(secret, utterances):
        turns = []
        for u in utterances:
            shown, reply, reward, _, _ = G.respond(secret, u)
            turns.append({"agent": shown, "reply": reply, "reward": reward})
        return {"turns": turns}

    red_circle = G.OBJECTS.index(("big", "red", "circle"))
    dialogues = [
        dialogue(
            red_circle,
            ["is it big ?", "is it big ?", "hello", "is it red ?", "is it a circle ?", "it is the big red circle ."],
        ),  # success; 1 redundant, 1 malformed, 3 informative
        dialogue(red_circle, ["is it small ?", "it is the small red circle ."]),  # guessed an excluded object
        dialogue(red_circle, ["is it big ?", "is it red ?", "is it a square ?", "it is the big red triangle ."]),
        dialogue(red_circle, ["it is the big blue square ."]),  # 18 left
        dialogue(red_circle, ["is it big ?"] * G.MAX_TURNS),  # out of turns, 7 redundant
    ]
    kinds = G.failure_kinds(dialogues)
    for k in ("success", "wrong_excluded", "wrong_2_left", "wrong_3_left", "out_of_turns"):
        assert kinds[k] == pytest.approx(0.2), k
    assert kinds["redundant"] == pytest.approx(8 / 5) and kinds["malformed"] == pytest.approx(1 / 5)
    assert kinds["informative"] == pytest.approx((3 + 1 + 3 + 0 + 1) / 5)
    optimal = G.evaluate_policy(G.OptimalPolicy(), n_episodes=180, return_dialogues=True)["dialogues"]
    assert G.failure_kinds(optimal) | {"informative": 0} == dict.fromkeys(kinds, 0.0) | {"success": 1.0}
    hasty = G.evaluate_policy(G.HastyPolicy(), n_episodes=180, return_dialogues=True)["dialogues"]
    assert G.failure_kinds(hasty)["wrong_2_left"] > 0.1 and G.failure_kinds(hasty)["redundant"] == 0.0
