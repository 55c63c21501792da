"""Tests of algos/dialogue_cql_utterance.py: CQL penalty, sampled-set Bellman target, candidate sets, Polyak update,
the StaticCache sampler against a plain full-forward loop on GPT-2 / Llama / GPT-NeoX, special tokens never sampled,
smoke runs (built-in tiny GPT-2 and real-architecture checkpoints) and clear errors."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import load_script, run_in_process, run_script

import envs.guess_image as G
from envs.tokenizer import build_tokenizer

m = load_script("dialogue_cql_utterance")


def test_cql_penalty_matches_hand_computation():
    q = torch.tensor([[1.0, 0.0, 2.0, 5.0], [0.5, 0.5, 0.0, 0.0]])  # (B=2, K=4)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])  # padded slots excluded
    q_data = q[:, 0]
    expected0 = math.log(math.exp(1.0) + math.exp(0.0) + math.exp(2.0)) - 1.0  # 5.0 is padding
    expected1 = math.log(2 * math.exp(0.5)) - 0.5  # = log 2
    got = m.candidate_cql_penalty(q, mask, q_data)
    assert got.tolist() == pytest.approx([expected0, expected1], abs=1e-6)
    # the gradient is softmax over the candidates minus the one-hot of the data utterance
    qg = q.clone().requires_grad_(True)
    m.candidate_cql_penalty(qg, mask, qg[:, 0]).sum().backward()
    p = torch.tensor([math.exp(1.0), 1.0, math.exp(2.0)]) / (math.exp(1.0) + 1.0 + math.exp(2.0))
    assert qg.grad[0, :3].tolist() == pytest.approx((p - torch.tensor([1.0, 0.0, 0.0])).tolist(), abs=1e-6)
    assert qg.grad[0, 3].item() == 0.0


def test_td_target_max_over_sampled_set_min_over_twins_zero_at_done():
    # next_q (B=3, K=3, 2): twin target Q of the sampled next candidates
    next_q = torch.tensor(
        [
            [[0.9, 0.2], [0.5, 0.6], [9.0, 9.0]],  # min over twins: 0.2, 0.5, (9.0 is a padded slot)
            [[0.3, 0.4], [0.1, 0.0], [0.7, 0.8]],  # min: 0.3, 0.0, 0.7 -> max 0.7
            [[5.0, 5.0], [5.0, 5.0], [5.0, 5.0]],  # done: ignored
        ]
    )
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    rewards = torch.tensor([-0.05, -0.05, 1.0])
    dones = torch.tensor([False, False, True])
    y = m.candidate_td_target(rewards, dones, next_q, mask, gamma=0.9)
    assert y.tolist() == pytest.approx([-0.05 + 0.9 * 0.5, -0.05 + 0.9 * 0.7, 1.0], abs=1e-6)
    # a done row without candidates is fine too (no -inf leaks)
    y2 = m.candidate_td_target(rewards[2:], dones[2:], next_q[2:], torch.zeros(1, 3, dtype=torch.bool), gamma=0.9)
    assert y2.tolist() == pytest.approx([1.0])


def test_training_target_uses_sampled_candidates_not_data_utterance():
    """The CQL set of a transition is C(s) u {a}; the target of the previous transition reads C(s) only."""
    sampled = torch.tensor([[3, 5, -1], [2, 3, 7]])  # C(s) for two states (utterance ids, -1 padding)
    data = torch.tensor([5, 9])
    cql_set = m.with_data_first(sampled, data)
    assert cql_set.tolist() == [[5, 3, -1, -1], [9, 2, 3, 7]]  # data first, its duplicate removed
    # the target over the sampled set: give the data-only utterance 9 a huge Q; it must not enter the max
    u_q = {2: 0.1, 3: 0.4, 5: 0.2, 7: 0.3, 9: 100.0}
    q_of = torch.tensor([[[u_q.get(int(i), 0.0)] * 2 for i in row] for row in sampled])  # (2, 3, 2)
    y = m.candidate_td_target(torch.zeros(2), torch.zeros(2, dtype=torch.bool), q_of, sampled >= 0, gamma=1.0)
    assert y.tolist() == pytest.approx([0.4, 0.4])


def test_dedupe_utterances_normalises_and_includes_data_first():
    samples = ["is it red ?", "Is it  RED?", "it is the big red circle .", "is it red ?", "blah"]
    assert m.dedupe_utterances(samples) == ["is it red ?", "it is the big red circle .", "*"]
    assert m.dedupe_utterances(samples, data_utterance="is it big ?") == [
        "is it big ?",
        "is it red ?",
        "it is the big red circle .",
        "*",
    ]
    assert m.dedupe_utterances(["is it red ?"], data_utterance="is it red ?") == ["is it red ?"]


def test_polyak_update():
    online, target = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        online.weight.fill_(1.0), online.bias.fill_(2.0), target.weight.fill_(0.0), target.bias.fill_(0.0)
    m.polyak_update(target, online, tau=0.25)
    assert target.weight.tolist() == [[0.25, 0.25]] and target.bias.item() == pytest.approx(0.5)
    m.polyak_update(target, online, tau=1.0)  # hard copy
    assert target.bias.item() == pytest.approx(2.0)


def plain_greedy(lm, tok, prompt, banned, budget):
    """Reference sampler at temperature 0: a full forward pass of the unpadded context for every token (no cache),
    argmax over the tokens that are not banned, until the separator; decoded as the script decodes."""
    ids, out = list(prompt), []
    for _ in range(budget):
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1]
        token = int(logits.masked_fill(banned, float("-inf")).argmax())
        if token == tok.sep_token_id:
            break
        out.append(token)
        ids.append(token)
    return G.normalize_utterance(tok.decode(out, skip_special_tokens=True))


def sampler_case(arch, tmp_path):
    """(lm, tokenizer) of the built-in tiny GPT-2 or a real-architecture checkpoint, as the script prepares them."""
    from hf_tiny import save_tiny_checkpoint

    torch.manual_seed(0)
    if arch == "builtin":
        return m.build_proposer(m.Args(n_embd=32, n_head=4))
    return m.build_proposer(m.Args(model_name_or_path=str(save_tiny_checkpoint(arch, tmp_path / arch))))


@pytest.mark.parametrize("arch", ["builtin", "gpt2", "llama", "gpt_neox"])
def test_static_cache_sampler_matches_a_plain_loop(arch, tmp_path):
    """The sampler (left-padded prompts encoded once into a transformers StaticCache, rows repeated n times, one
    token per forward) at temperature 0 writes what a cache-free full-forward loop writes, for every prompt and each
    of its n rows; the budget holds the longest valid utterance of this tokenizer."""
    lm, tok = sampler_case(arch, tmp_path)
    lm.eval()
    histories = [[], [("is it big ?", "yes , it is big .")], [("is it red ?", "no , it is not red ."), ("a", "b")]]
    prompts = [G.tokenize_prompt(h, tok) for h in histories]  # different lengths: left padding is exercised
    banned, budget = m.banned_token_mask(tok, m.n_logits(lm)), m.utterance_budget(tok)
    got = m.sample_utterances(lm, tok, prompts, 2, 0.0, "cpu", torch.Generator().manual_seed(0), batch_size=2)
    expected = [plain_greedy(lm, tok, p, banned, budget) for p in prompts]
    assert got == [[e, e] for e in expected]
    longest = max(len(tok(u, add_special_tokens=False)["input_ids"]) for u in G.all_utterances())
    assert budget >= longest + 1 and (arch != "builtin" or budget == G.MAX_UTTERANCE_WORDS + 1)


@pytest.mark.parametrize("arch", ["builtin", "llama"])
def test_special_tokens_are_never_sampled(arch, tmp_path):
    """Make every non-text special token the model's favourite (+50 on its logit): sampled utterances still never
    contain one, the separator still ends them, and the decoded text holds no tokenizer markup."""
    lm, tok = sampler_case(arch, tmp_path)
    lm.eval()
    banned = m.banned_token_mask(tok, m.n_logits(lm))
    special = [i for i in tok.all_special_ids if i != tok.sep_token_id]
    assert banned[special].all() and not banned[tok.sep_token_id] and banned.sum() == len(special)
    bonus = torch.zeros(m.n_logits(lm))
    bonus[special] = 50.0
    lm.get_output_embeddings().register_forward_hook(lambda mod, inp, out: out + bonus)
    prompts = [G.tokenize_prompt([], tok), G.tokenize_prompt([("is it big ?", "no , it is not big .")], tok)]
    samples = m.sample_utterances(lm, tok, prompts, 8, 1.0, "cpu", torch.Generator().manual_seed(0), batch_size=2)
    texts = [t for s in samples for t in s]
    assert len(texts) == 16 and not any("<" in t or "endoftext" in t for t in texts)


def test_build_transitions_states_and_dones():
    tok = build_tokenizer()
    table = m.UtteranceTable(tok)
    dialogues = G.make_dataset(50, seed=3)
    states, prompts, tr = m.build_transitions(dialogues, tok, table)
    assert len(tr["s"]) == sum(len(d["turns"]) for d in dialogues)
    assert states[0] == [] and prompts[0] == [tok.bos_token_id]  # every dialogue starts at the empty history
    assert int(tr["done"].sum()) == len(dialogues)  # exactly one terminal turn per dialogue
    k = 0  # first dialogue: s' of turn t is s of turn t + 1
    n = len(dialogues[0]["turns"])
    assert tr["s2"][k : k + n - 1].tolist() == tr["s"][k + 1 : k + n].tolist()
    assert tr["r"][k : k + n].tolist() == pytest.approx([t["reward"] for t in dialogues[0]["turns"]])


def test_dedupe_dialogues_weighted_bc_loss_equals_full_loss():
    tok = build_tokenizer()
    tokenized = G.tokenize_dialogues(G.make_dataset(300, seed=2), tok)
    distinct, counts, secrets = m.dedupe_dialogues(tokenized)
    assert len(distinct) < len(tokenized) and counts.sum() == len(tokenized) and (secrets == -1).all()
    torch.manual_seed(0)

    def batch(ds):
        ids, _ = m.pad_rows([d["input_ids"].tolist() for d in ds], tok.pad_token_id)
        agent = torch.zeros_like(ids, dtype=torch.bool)
        for i, d in enumerate(ds):
            agent[i, : len(d["agent_mask"])] = torch.from_numpy(d["agent_mask"])
        return ids, agent

    vocab = len(tok)
    table = torch.randn(vocab, vocab)  # a fixed "model": logits depend on the current token only
    full_ids, full_agent = batch(tokenized)
    dd_ids, dd_agent = batch(distinct)
    full = m.bc_loss(table[full_ids], full_ids, full_agent, torch.ones(len(tokenized)))
    weighted = m.bc_loss(table[dd_ids], dd_ids, dd_agent, torch.from_numpy(counts))
    assert weighted.item() == pytest.approx(full.item(), rel=1e-5)
    # hand check of one term: the NLL of the first agent token of the first dialogue
    ids0, agent0 = full_ids[:1], full_agent[:1]
    i = int(agent0[0, 1:].nonzero()[0, 0])  # position whose action (token i + 1) is an agent token
    only = torch.zeros_like(agent0)
    only[0, i + 1] = True
    nll = -torch.log_softmax(table[ids0[0, i]], -1)[ids0[0, i + 1]]
    assert m.bc_loss(table[ids0], ids0, only, torch.ones(1)).item() == pytest.approx(nll.item(), rel=1e-5)


def test_dedupe_keeps_dialogues_with_different_secrets_apart():
    tok = build_tokenizer()
    dialogues = G.make_dataset(300, seed=2)
    tokenized = G.tokenize_dialogues(dialogues, tok)
    secrets = [d["secret_id"] for d in dialogues]
    distinct, counts, dd_secrets = m.dedupe_dialogues(tokenized, secrets)
    pairs = {(d["input_ids"].tobytes(), s) for d, s in zip(tokenized, secrets, strict=True)}
    assert len(distinct) == len(pairs) and counts.sum() == len(tokenized)
    assert {(d["input_ids"].tobytes(), int(s)) for d, s in zip(distinct, dd_secrets, strict=True)} == pairs
    # the same words with another secret (a wrong guess does not reveal it) stay two weighted examples
    twin = [tokenized[0], tokenized[0]]
    assert len(m.dedupe_dialogues(twin, [3, 4])[0]) == 2 and len(m.dedupe_dialogues(twin, [3, 3])[0]) == 1


def test_belief_loss_matches_hand_computation():
    logits = torch.randn(2, 3, G.N_OBJECTS)
    secret = torch.tensor([4, 17])
    real = torch.tensor([[True, True, False], [True, False, False]])
    weights = torch.tensor([1.0, 2.0])
    nll = lambda b, t: -torch.log_softmax(logits[b, t], -1)[secret[b]]  # noqa: E731
    expected = (nll(0, 0) + nll(0, 1) + 2.0 * nll(1, 0)) / 4.0
    assert m.weighted_belief_loss(logits, secret, real, weights).item() == pytest.approx(expected.item(), rel=1e-5)


def test_critic_history_turns_bind_question_and_answer():
    tok = build_tokenizer()
    turns = m.UtteranceTable(tok)
    hist = [[], [("is it big ?", "yes .")], [("Is it BIG?", "yes ."), ("is it red ?", "no .")]]
    idx, n = m.history_turn_ids(hist, turns)
    assert n.tolist() == [0, 1, 2] and idx.tolist() == [[-1, -1], [0, -1], [0, 1]]  # normalised, shared turn id
    assert turns.tokens[0] == tok("is it big ? yes .", add_special_tokens=False)["input_ids"]
    critic = m.UtteranceCritic(len(tok), 8, 16, tok.pad_token_id)
    t_ids, t_len = turns.tensors("cpu")
    h = critic.encode_histories(critic.encode_turns(t_ids, t_len), idx, n)  # (3, 8)
    u_ids, u_len = m.pad_rows([tok("is it red ?", add_special_tokens=False)["input_ids"]] * 2, tok.pad_token_id)
    q = critic.q_values(h, critic.encode_utterances(u_ids, u_len)[None].expand(3, 2, 8))
    assert h.shape == (3, 8) and q.shape == (3, 2, 2) and torch.isfinite(q).all()
    # padding beyond n_turns is ignored: the same history with a longer padded row gives the same encoding
    idx2 = torch.cat([idx, torch.full((3, 3), -1)], dim=1)
    h2 = critic.encode_histories(critic.encode_turns(t_ids, t_len), idx2, n)
    assert torch.allclose(h, h2, atol=1e-6)


def check_evaluation_bookkeeping(mt: dict) -> None:
    """What a summary must satisfy whatever was learned: each mean return is consistent with its success rate and
    length (a question or malformed turn costs QUESTION_COST, a guess costs nothing and ends the episode:
    return = success - c (length - guessed), guessed in [0, 1]) and the normalized score is that of the return."""
    for prefix in ("eval/", "eval/bc_proposer_"):
        ret, success, length = (mt[prefix + k] for k in ("episodic_return", "success_rate", "episodic_length"))
        assert success - G.QUESTION_COST * length - 1e-9 <= ret <= success - G.QUESTION_COST * (length - 1) + 1e-9
        assert mt[prefix + "normalized_score"] == pytest.approx(G.normalized_score(ret))


TINY = [  # a few seconds: 200 dialogues, 1 BC epoch, 4 critic steps, 2 candidates, 18 + 18 episodes
    "--dataset-size",
    "200",
    "--bc-epochs",
    "1",
    "--critic-steps",
    "4",
    "--batch-size",
    "16",
    "--eval-episodes",
    "18",
    "--n-candidates",
    "2",
    "--n-embd",
    "16",
    "--critic-dim",
    "16",
    "--critic-hidden",
    "16",
    "--log-every",
    "2",
    "--val-episodes",
    "18",
    "--act-temperatures",
    "1.0",
    "0.5",
]


def run_main(*argv: str, runs_dir: Path) -> dict:
    """The script's main() in this process (conftest.run_in_process): for tests not about the command line."""
    return run_in_process(m, runs_dir, *argv)


def test_smoke_run_and_eval_only(runs_dir):
    tiny = TINY
    summary = run_script("dialogue_cql_utterance", *tiny, runs_dir=runs_dir, timeout=300)
    mt = summary["metrics"]
    # the headline is the test result at the acting temperature chosen on validation episodes
    best = max((1.0, 0.5), key=lambda t: (mt[f"eval/val_act_temperature_{t:g}_episodic_return"], t))
    assert mt["eval/act_temperature"] == best
    assert mt["eval/episodic_return"] == mt[f"eval/act_temperature_{best:g}_episodic_return"]
    for key in (
        "eval/success_rate",
        "eval/episodic_return",
        "eval/episodic_length",
        "eval/normalized_score",
        "eval/bc_proposer_episodic_return",
        "eval/bc_proposer_success_rate",
        "dataset/mean_return",
    ):
        assert isinstance(mt[key], float), key
    check_evaluation_bookkeeping(mt)
    dialogues = G.make_dataset(200, seed=1)
    assert mt["dataset/mean_return"] == pytest.approx(G.dataset_stats(dialogues)["mean_return"])
    # lecture Problem 21.4, per utterance: the horizon is the agent's turns; the max runs over <= N candidates out of
    # every sequence of up to 12 words of the 111 writable tokens (115 - pad/bos/eos/unk)
    turns = [len(d["turns"]) for d in dialogues]
    assert mt["timestep/rl_steps_per_dialogue"] == pytest.approx(sum(turns) / len(turns))
    assert mt["timestep/rl_steps_per_dialogue_max"] == max(turns)
    assert mt["timestep/distinct_data_utterances"] == len({t["agent"] for d in dialogues for t in d["turns"]})
    assert 1.0 <= mt["timestep/actions_per_step"] <= 2  # --n-candidates 2, deduplicated
    assert mt["timestep/action_space_log10"] == pytest.approx(12 * math.log10(111))
    run_dir = runs_dir / summary["run_name"]
    assert (run_dir / "critic.safetensors").exists() and (run_dir / "bc_lm" / "config.json").exists()
    again = run_main(*tiny, "--eval-only", "--checkpoint", str(run_dir), runs_dir=runs_dir)  # the CLI ran above
    assert again["run_name"] != summary["run_name"]
    # same weights, same eval seed, same sampling seed -> the same evaluation
    assert again["metrics"]["eval/episodic_return"] == pytest.approx(mt["eval/episodic_return"])


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"n_candidates": 0}, "--n-candidates"),
        ({"tau": 0.0}, "--tau"),
        ({"act_temperatures": (1.0, 0.0)}, "--act-temperatures"),
        ({"act_temperatures": ()}, "--act-temperatures"),
        ({"cql_alpha": -1.0}, "--cql-alpha"),
        ({"n_embd": 30, "n_head": 4}, "not divisible"),
        ({"n_head": 0}, "--n-head must be >= 1"),
        ({"n_layer": 0}, "--n-layer"),
        ({"seed": -1}, "--seed must be >= 0"),
        ({"critic_dim": 0}, "--critic-dim"),
        ({"critic_hidden": -4}, "--critic-hidden"),
        ({"bc_lr": -1e-3}, "--bc-lr"),
        ({"critic_lr": -1e-3}, "--critic-lr"),
        ({"max_grad_norm": 0.0}, "--max-grad-norm"),
        ({"log_every": 0}, "--log-every"),
        ({"gamma": 1.5}, "--gamma"),
        ({"temperature": 0.0}, "--temperature"),
        ({"dataset_size": 0}, "--dataset-size"),
        ({"eval_only": True, "checkpoint": "/nonexistent_run"}, "--eval-only needs"),
    ],
)
def test_parse_args_rejects_bad_args(bad, message, monkeypatch):
    monkeypatch.setattr(m.tyro, "cli", lambda _: m.Args(**bad))  # the command line that gives these Args
    with pytest.raises(SystemExit, match=message):
        m.parse_args()


def test_bad_input_clear_error_cli(runs_dir):
    """The CLI path prints the one-line error, no traceback (the other cases are checked in-process above)."""
    proc = run_script(
        "dialogue_cql_utterance", "--dataset-path", "/nonexistent/data.jsonl", runs_dir=runs_dir, expect_fail=True
    )
    assert "does not exist" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_corrupt_dataset_clear_error(tmp_path, monkeypatch):
    """A --dataset-path that is not JSONL fails in the parse_args of the command line above, here in this process."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"turns": [{"agent": "is it red ?"}]}) + "\n{not json\n")
    monkeypatch.setattr("sys.argv", ["dialogue_cql_utterance.py", "--dataset-path", str(path)])
    with pytest.raises(SystemExit) as err:
        m.parse_args()
    message = str(err.value.code)  # what the command line prints: SystemExit(str) prints its message, no traceback
    assert message.startswith("error: ") and "not a GuessTheImage JSONL dataset" in message and "\n" not in message


# ----------------------------------------------------------------------------------------------------- real models
def test_real_checkpoint_keeps_its_weights_and_tokenizer(hf_checkpoint):
    """The proposer is the checkpoint itself with its own tokenizer (not the seqrl word vocabulary): "<sep>" and
    "<pad>" are added as new special tokens, the embeddings grow by exactly those rows, the rest is untouched."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original_tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    original = AutoModelForCausalLM.from_pretrained(hf_checkpoint)
    lm, tok = m.build_proposer(m.Args(model_name_or_path=str(hf_checkpoint)))
    n = len(original_tok)
    assert type(lm) is type(original) and tok.get_vocab().items() >= original_tok.get_vocab().items()
    assert (tok.bos_token_id, tok.eos_token_id) == (original_tok.bos_token_id, original_tok.eos_token_id)
    assert sorted([tok.sep_token_id, tok.pad_token_id]) == [n, n + 1] and m.n_logits(lm) == n + 2
    emb, emb0 = lm.get_input_embeddings().weight, original.get_input_embeddings().weight
    assert torch.equal(emb[:n], emb0[:n])  # the pretrained token meanings are kept
    kept = dict(original.named_parameters())
    for name, p in lm.named_parameters():
        if p.shape == kept[name].shape:
            assert torch.equal(p, kept[name]), name


def test_real_checkpoint_end_to_end(hf_checkpoint, runs_dir):
    """Train and act with a real architecture: the proposer's BC loss falls, candidates are sampled through the
    StaticCache, the critic is trained on the model's own token ids, and the run dir reloads for --eval-only."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    original_tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    # one acting temperature: the choice among several on validation episodes is the smoke test's (model-agnostic)
    args = [*TINY, "--bc-epochs", "8", "--act-temperatures", "1.0", "--model-name-or-path", str(hf_checkpoint)]
    summary = run_main(*args, runs_dir=runs_dir)  # in this process (the smoke test runs the command line)
    mt = summary["metrics"]
    assert mt["model/bc_nll_end"] < mt["model/bc_nll_start"] - 1.0, mt  # it trains (from ~ln 400 = 6)
    check_evaluation_bookkeeping(mt)
    assert mt["timestep/vocab_size"] == len(original_tok) + 2 and mt["timestep/actions_per_step"] >= 1.0
    run_dir = runs_dir / summary["run_name"]
    tok = AutoTokenizer.from_pretrained(run_dir / "bc_lm")  # what --eval-only loads: bc_lm/ and the critic
    critic = m.UtteranceCritic(
        len(tok), summary["args"]["critic_dim"], summary["args"]["critic_hidden"], tok.pad_token_id
    )
    critic.load_state_dict(load_file(run_dir / "critic.safetensors"))
    assert tok.eos_token_id == original_tok.eos_token_id and tok.sep_token_id == len(original_tok)
    assert critic.embed.num_embeddings == len(tok) and critic.embed.padding_idx == tok.pad_token_id
    again = run_main(*args, "--eval-only", "--checkpoint", str(run_dir), runs_dir=runs_dir)
    assert again["metrics"]["eval/episodic_return"] == pytest.approx(mt["eval/episodic_return"])


def test_missing_model_is_a_one_line_error(runs_dir, monkeypatch, tmp_path):
    """A hub id that is not in the local cache (offline), on the command line: a one-line error (--dataset-size 1: the
    data comes first). A missing local dir fails in the same build_proposer, checked in this process."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: a hub id that is not in the local cache
    args = ("--model-name-or-path", "seqrl-tests/no-such-model", "--dataset-size", "1")
    proc = run_script("dialogue_cql_utterance", *args, runs_dir=runs_dir, expect_fail=True)
    assert "error: could not load --model-name-or-path" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(SystemExit, match="error: could not load --model-name-or-path"):
        m.build_proposer(m.Args(model_name_or_path=str(tmp_path / "no_such_dir")))
