"""Tests of algos/ilql_per_token.py: the ILQL math against hand computations (expectile, per-token CQL = cross-entropy,
the token-level backup that skips the answerer's tokens and stops at the dialogue's end, Polyak), decoding (β = 0
is BC, KV-cached left-padded generation = a plain loop), subprocess smoke runs, bad input, and a slow learning test."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import load_script, parse_error, run_in_process, run_script

import envs.guess_image as G
from envs.tokenizer import build_tokenizer

M = load_script("ilql_per_token")
TINY = (  # 300 dialogues, 1-layer 32-wide model, 16 dialogues a step, 36 + 18 episodes per β; test_scale_* too
    "--dataset-size",
    "300",
    "--log-every",
    "10",
    "--batch-size",
    "16",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--eval-episodes",
    "36",
    "--val-episodes",
    "18",
    "--betas",
    "0",
    "4",
)
SMOKE = (*TINY, "--num-steps", "20")  # a few seconds


def run_main(*argv: str, runs_dir: Path) -> dict:
    """The script's main() in this process (conftest.run_in_process): for tests not about the command line."""
    return run_in_process(M, runs_dir, *argv)


def hand_dialogue():
    """2 turns: a question (reward -0.05) and a correct guess (reward 1, done)."""
    return {
        "turns": [
            {"agent": "is it big ?", "reply": "yes .", "reward": -0.05},
            {"agent": "it is the big red circle .", "reply": "correct .", "reward": 1.0},
        ]
    }


def tiny_model(seed=0, d=16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    tok = build_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=M.N_POSITIONS,
        n_embd=d,
        n_layer=2,
        n_head=2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    lm = GPT2LMHeadModel(config).eval()
    heads = M.ILQLHeads(d, len(tok))
    for p in heads.parameters():  # make the Q/V heads non-trivial (and different from the online heads)
        torch.nn.init.normal_(p, std=0.5)
    return lm, heads, tok


def test_expectile_loss_matches_hand_computation():
    diff = torch.tensor([2.0, -1.0, 0.5, 0.0])  # u = Q - V
    expected = [0.7 * 4.0, 0.3 * 1.0, 0.7 * 0.25, 0.0]  # |κ - 1(u<0)| u^2 with κ = 0.7
    assert M.expectile_loss(diff, 0.7).tolist() == pytest.approx(expected)
    assert M.expectile_loss(diff, 0.5).tolist() == pytest.approx((0.5 * diff**2).tolist())  # κ = 0.5: half MSE


def test_expectile_minimizer_is_above_the_mean_for_expectile_above_half():
    q = torch.tensor([0.0, 0.0, 0.0, 1.0])  # mean 0.25; the 0.9-expectile solves 0.9*(1-v) = 0.1*3v -> v = 0.75
    v = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([v], lr=0.1)
    for _ in range(2000):
        opt.zero_grad()
        M.expectile_loss(q - v, 0.9).mean().backward()
        opt.step()
    assert v.item() == pytest.approx(0.75, abs=1e-3)


def test_cql_penalty_is_cross_entropy_of_q_as_logits():
    q = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]])
    actions = torch.tensor([0, 2])
    hand = [math.log(math.e + math.e**2 + math.e**3) - 1.0, math.log(math.exp(0.5) + math.exp(-1) + 1.0) - 0.0]
    assert M.token_cql_penalty(q, actions).tolist() == pytest.approx(hand)
    big = torch.randn(4, 7, 136)  # (B, L, V), the training shapes
    acts = torch.randint(0, 136, (4, 7))
    ce = F.cross_entropy(big.transpose(1, 2), acts, reduction="none")
    assert torch.allclose(M.token_cql_penalty(big, acts), ce, atol=1e-5)


def test_backup_skips_answerer_tokens_and_stops_at_dialogue_end():
    tok = build_tokenizer()
    t = G.tokenize_dialogue(hand_dialogue(), tok)
    # 0 <bos> | 1 is 2 it 3 big 4 ? 5 <sep> | 6 yes 7 . 8 <sep> | 9 it 10 is 11 the 12 big 13 red 14 circle 15 .
    # 16 <sep> | 17 correct 18 . 19 <eos>
    assert len(t["input_ids"]) == 20
    action_mask, next_idx = M.next_state_indices(t["agent_mask"])
    assert np.flatnonzero(action_mask).tolist() == [0, 1, 2, 3, 4, *range(8, 16)]
    expected = {0: 1, 1: 2, 2: 3, 3: 4, 4: 8, **{i: i + 1 for i in range(8, 15)}, 15: -1}
    assert {i: int(next_idx[i]) for i in np.flatnonzero(action_mask)} == expected
    assert all(next_idx[i] == -1 for i in np.flatnonzero(~action_mask))
    # targets y = r + γ V(s'): the question's <sep> (action of position 4) bootstraps from position 8 (the state
    # that has seen "yes ."), the final <sep> (action of position 15) gets its reward only
    data = M.build_tensors([hand_dialogue()], tok)
    v = torch.arange(20, dtype=torch.float32)[None] / 10.0 + 1.0  # (1, L): V(position j) = 1 + j/10, all non-zero
    y = M.q_targets(data["rewards"], data["dones"], v, data["next_idx"], gamma=0.9)[0]
    assert y[4].item() == pytest.approx(-0.05 + 0.9 * 1.8)
    assert y[15].item() == pytest.approx(1.0)
    assert y[1].item() == pytest.approx(0.9 * 1.2)
    assert y[9].item() == pytest.approx(0.9 * 2.0)
    assert data["dones"][0].nonzero().flatten().tolist() == [15]


def test_build_tensors_pads_and_keeps_per_dialogue_layout():
    tok = build_tokenizer()
    dialogues = G.make_dataset(5, seed=3)
    data = M.build_tensors(dialogues, tok)
    for k, d in enumerate(dialogues):
        t = G.tokenize_dialogue(d, tok)
        n = len(t["input_ids"])
        assert data["lengths"][k] == n
        assert data["input_ids"][k, :n].tolist() == t["input_ids"].tolist()
        assert data["rewards"][k].sum().item() == pytest.approx(d["return"], abs=1e-5)
        assert int(data["dones"][k].sum()) == 1 and not data["action_mask"][k, n - 1 :].any()
        assert data["secret"][k] == d["secret_id"]  # the logged secret, target of the belief auxiliary


def test_belief_loss_matches_hand_computation_and_enters_the_total():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, G.N_OBJECTS)
    secret = torch.tensor([4, 17])
    real = torch.tensor([[1, 1, 0], [1, 0, 0]])
    nll = lambda b, t: -torch.log_softmax(logits[b, t], -1)[secret[b]]  # noqa: E731
    expected = (nll(0, 0) + nll(0, 1) + nll(1, 0)) / 3.0
    assert M.belief_loss(logits, secret, real).item() == pytest.approx(expected.item(), rel=1e-5)
    # its minimizer is the posterior: for one prefix seen with secrets {4, 4, 17}, logits log(2/3), log(1/3)
    posterior = torch.full((3, 1, G.N_OBJECTS), -1e4)
    posterior[:, 0, 4], posterior[:, 0, 17] = math.log(2 / 3), math.log(1 / 3)
    grad_logits = posterior.clone().requires_grad_(True)
    M.belief_loss(grad_logits, torch.tensor([4, 4, 17]), torch.ones(3, 1)).backward()
    assert grad_logits.grad.sum(0).abs().max().item() < 1e-6  # stationary at the posterior


def test_lm_loss_covers_answerer_tokens_and_bc_only_agent_tokens():
    torch.manual_seed(0)
    b, length, vocab = 2, 6, 5
    out = {"logits": torch.randn(b, length, vocab), "v": torch.randn(b, length)}
    out |= {k: torch.randn(5, vocab) for k in ("q1", "q2", "tq1", "tq2")}  # at the 5 action positions
    batch = {
        "input_ids": torch.randint(0, vocab, (b, length)),
        "action_mask": torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0]], dtype=torch.bool),  # agent tokens
        "lm_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.float32),  # real tokens (1 pad)
        "rewards": torch.zeros(b, length - 1),
        "dones": torch.zeros(b, length - 1, dtype=torch.bool),
        "next_idx": torch.full((b, length - 1), -1),
    }
    ce = F.cross_entropy(out["logits"][:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    args = type(
        "A",
        (),
        dict(gamma=1.0, expectile=0.7, cql_alpha=0.1, bc_weight=1.0, bc_only=True, lm_all_tokens=True, belief_coef=0.0),
    )
    losses = M.ilql_losses(out, batch, args)
    assert losses["bc"].item() == pytest.approx(ce[batch["action_mask"]].mean().item(), rel=1e-5)
    assert losses["lm"].item() == pytest.approx(ce[batch["lm_mask"].bool()].mean().item(), rel=1e-5)
    assert losses["loss"].item() == pytest.approx(losses["lm"].item(), rel=1e-6)  # BC-only: the LM loss alone
    args.lm_all_tokens = False
    assert M.ilql_losses(out, batch, args)["loss"].item() == pytest.approx(losses["bc"].item(), rel=1e-6)


def test_polyak_update():
    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    torch.nn.init.constant_(source.weight, 1.0), torch.nn.init.constant_(source.bias, 1.0)
    torch.nn.init.constant_(target.weight, 0.0), torch.nn.init.constant_(target.bias, 0.0)
    M.polyak_update(target, source, 0.1)
    assert torch.allclose(target.weight, torch.full((2, 3), 0.1))
    M.polyak_update(target, source, 0.1)
    assert torch.allclose(target.bias, torch.full((2,), 0.19))  # 0.1 + 0.9 * 0.1
    heads = M.ILQLHeads(4, 5)
    assert all(torch.equal(a, b) for a, b in zip(heads.q1.parameters(), heads.target_q1.parameters(), strict=True))
    assert not any(p.requires_grad for p in heads.target_q2.parameters())


def test_filter_top_fraction_keeps_highest_returns():
    dialogues = [{"return": r} for r in (0.1, 0.9, -0.2, 0.5, 0.7)]
    kept = M.filter_top(dialogues, 0.4)
    assert [d["return"] for d in kept] == [0.9, 0.7]
    assert len(M.filter_top(dialogues, 1.0)) == 5


def plain_greedy(lm, heads, prompt, beta, sep_id, banned, budget):
    """Reference decoder: full re-forward of the unpadded context per token, argmax of log π + β A over the
    tokens that are not banned."""
    ids, out_ids = list(prompt), []
    for _ in range(budget):
        with torch.no_grad():
            x = torch.tensor([ids])
            out = M.forward_all(lm, heads, x, torch.ones_like(x))
        scores = M.decoding_scores(out["logits"][0, -1], out["tq1"][0, -1], out["tq2"][0, -1], out["v"][0, -1], beta)
        token = int(scores.masked_fill(banned, float("-inf")).argmax())
        if token == sep_id:
            break
        out_ids.append(token)
        ids.append(token)
    return out_ids


@pytest.mark.parametrize("beta", [0.0, 3.0])
def test_batched_cached_decoding_matches_plain_loop(beta):
    lm, heads, tok = tiny_model()
    histories = [[], [("is it big ?", "yes .")], [("is it red ?", "no ."), ("is it a circle ?", "yes .")]]
    prompts = [G.tokenize_prompt(h, tok) for h in histories]  # different lengths: left padding is exercised
    banned, budget = M.banned_token_mask(tok, len(tok)), M.utterance_budget(tok)
    got = M.generate_utterances(
        lm,
        heads,
        prompts,
        tok.pad_token_id,
        tok.sep_token_id,
        beta,
        top_k=0,
        greedy=True,
        generator=torch.Generator().manual_seed(0),
        device=torch.device("cpu"),
        banned=banned,
        max_new_tokens=budget,
    )
    assert got == [plain_greedy(lm, heads, p, beta, tok.sep_token_id, banned, budget) for p in prompts]
    assert budget == G.MAX_UTTERANCE_WORDS + 1  # the built-in tokenizer: every word the env reads, then <sep>


def test_banned_tokens_are_the_non_text_specials_and_padded_rows():
    tok = build_tokenizer()
    banned = M.banned_token_mask(tok, len(tok) + 3)  # + 3 rows beyond the tokenizer, as Pythia pads its table
    assert banned.nonzero().flatten().tolist() == sorted(
        [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, *range(len(tok), len(tok) + 3)]
    )
    assert not banned[tok.sep_token_id]  # the agent ends its turn with the separator


def test_special_tokens_are_never_written_even_when_the_model_prefers_them():
    """Give every non-text special token a huge LM logit and Q-value: decoding (sampled, greedy, any β) never
    writes one, and the agent's text holds no tokenizer markup."""
    lm, heads, tok = tiny_model(seed=2)
    special = [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id]
    bonus = torch.zeros(len(tok))
    bonus[special] = 50.0
    lm.get_output_embeddings().register_forward_hook(lambda mod, inp, out: out + bonus)
    heads.target_q1.register_forward_hook(lambda mod, inp, out: out + bonus)
    heads.target_q2.register_forward_hook(lambda mod, inp, out: out + bonus)
    histories = [[], [("is it big ?", "yes , it is big .")]] * 8
    for beta, greedy in ((0.0, False), (4.0, False), (256.0, True)):
        agent = M.ILQLAgent(lm, heads, tok, beta, top_k=20, greedy=greedy, seed=0, device=torch.device("cpu"))
        prompts = [G.tokenize_prompt(h, tok) for h in histories]
        ids = M.generate_utterances(
            lm,
            heads,
            prompts,
            tok.pad_token_id,
            tok.sep_token_id,
            beta,
            20,
            greedy,
            torch.Generator().manual_seed(0),
            torch.device("cpu"),
            agent.banned,
            agent.max_new_tokens,
        )
        assert not any(t in special for u in ids for t in u)
        assert all("<" not in text for text in agent.act_batch(histories))


def test_top_k_ranks_the_combined_score_not_the_bc_policy():
    """Detail 13 (trlx's order): top-k keeps the k best of log π_BC + β A. A token outside BC's top 2 but with the
    highest advantage is dropped at β = 0 and kept (and is the argmax) at large β; a BC-first filter (Snell's order)
    would drop it at every β."""
    logits = torch.tensor([4.0, 3.0, 2.0, -1.0, -2.0])  # BC prefers tokens 0, 1, 2; token 3 is BC's 4th choice
    q = torch.tensor([0.0, 0.1, 0.0, 1.0, -0.5])  # ... but has the highest advantage
    v = torch.tensor(0.0)
    for beta, kept in ((0.0, {0, 1}), (1.0, {0, 1}), (16.0, {1, 3}), (256.0, {1, 3})):
        scores = M.top_k_filter(M.decoding_scores(logits, q, q, v, beta)[None], 2)[0]
        assert set(torch.isfinite(scores).nonzero().flatten().tolist()) == kept, beta
    assert int(M.top_k_filter(M.decoding_scores(logits, q, q, v, 256.0)[None], 2)[0].argmax()) == 3


def test_beta_zero_decoding_is_bc_and_top1_sampling_is_argmax():
    lm, heads, tok = tiny_model(seed=1)
    x = torch.tensor([G.tokenize_prompt([("is it big ?", "no .")], tok)])
    with torch.no_grad():
        out = M.forward_all(lm, heads, x, torch.ones_like(x))
    logits, tq1, tq2, v = out["logits"][0, -1], out["tq1"][0, -1], out["tq2"][0, -1], out["v"][0, -1]
    scores0 = M.decoding_scores(logits, tq1, tq2, v, 0.0)
    assert torch.allclose(scores0, F.log_softmax(logits, -1))  # β = 0: exactly the BC policy
    scores_big = M.decoding_scores(logits, tq1, tq2, v, 1e6)  # β -> ∞: the argmax of the advantage
    assert int(scores_big.argmax()) == int(torch.minimum(tq1, tq2).argmax())
    kept = M.top_k_filter(scores0[None], 3)[0]
    assert torch.isfinite(kept).sum() == 3 and set(kept.topk(3).indices.tolist()) == set(
        scores0.topk(3).indices.tolist()
    )
    prompts = [x[0].tolist()] * 4
    sampled = M.generate_utterances(
        lm,
        heads,
        prompts,
        tok.pad_token_id,
        tok.sep_token_id,
        0.0,
        top_k=1,
        greedy=False,
        generator=torch.Generator().manual_seed(0),
        device=torch.device("cpu"),
    )
    greedy = M.generate_utterances(
        lm,
        heads,
        prompts,
        tok.pad_token_id,
        tok.sep_token_id,
        0.0,
        top_k=0,
        greedy=True,
        generator=torch.Generator().manual_seed(0),
        device=torch.device("cpu"),
    )
    assert sampled == greedy


def test_smoke_run_writes_summary_and_checkpoint_reloads(runs_dir):
    summary = run_script("ilql_per_token", *SMOKE, runs_dir=runs_dir, timeout=300)
    m = summary["metrics"]
    for key in (
        "eval/episodic_return",
        "eval/success_rate",
        "eval/episodic_length",
        "eval/normalized_score",
        "eval/bc_episodic_return",
        "eval/beta_4/episodic_return",
        "eval/val_beta_4/episodic_return",
        "dataset/mean_return",
        "ref/optimal_episodic_return",
        "eval/best_beta",
    ):
        assert key in m and math.isfinite(m[key]), key
    check_evaluation_bookkeeping(m, betas=(0.0, 4.0))
    assert m["ref/optimal_episodic_return"] == pytest.approx(G.OPTIMAL_MEAN_RETURN, abs=0.02)
    # lecture Problem 21.4, per token: the horizon is the agent's tokens (its words + the <sep> ending each turn)
    tok = build_tokenizer()
    agent_tokens = [sum(len(tok(t["agent"])["input_ids"]) + 1 for t in d["turns"]) for d in G.make_dataset(300, seed=1)]
    assert m["timestep/rl_steps_per_dialogue"] == pytest.approx(np.mean(agent_tokens))
    assert m["timestep/rl_steps_per_dialogue_max"] == max(agent_tokens)
    assert m["timestep/vocab_size"] == len(tok) and m["timestep/actions_per_step"] == len(tok) - 4  # 4 specials
    run_dir = summary["run_dir"]
    again = run_main(  # in this process: the command line ran above
        "--eval-only",
        "--checkpoint",
        run_dir,
        "--dataset-size",
        "50",
        "--eval-episodes",
        "36",
        "--val-episodes",
        "18",
        "--betas",
        "0",
        "4",
        runs_dir=runs_dir,
    )
    assert again["run_dir"] != run_dir
    for key in ("eval/beta_0/episodic_return", "eval/beta_4/episodic_return"):  # same weights, seeds, episodes
        assert again["metrics"][key] == pytest.approx(m[key])


def check_evaluation_bookkeeping(m: dict, betas) -> None:
    """What a summary must satisfy whatever the policy learned: the headline is the test result of the β that is
    best on validation (ties -> smaller β), the BC row is β = 0, and each mean return is consistent with its success
    rate and length (a question or malformed turn costs QUESTION_COST, a guess costs nothing and ends the episode:
    return = success - c (length - guessed), guessed in [0, 1])."""
    best = max(betas, key=lambda b: (m[f"eval/val_beta_{b:g}/episodic_return"], -b))
    assert m["eval/best_beta"] == best
    for key in ("episodic_return", "success_rate", "episodic_length", "valid_utterance_rate"):
        assert m[f"eval/{key}"] == m[f"eval/beta_{best:g}/{key}"]
        if 0.0 in betas:
            assert m[f"eval/bc_{key}"] == m[f"eval/beta_0/{key}"]
    assert m["eval/normalized_score"] == pytest.approx(G.normalized_score(m["eval/episodic_return"]))
    for b in betas:
        keys = ("episodic_return", "success_rate", "episodic_length")
        ret, success, length = (m[f"eval/beta_{b:g}/{k}"] for k in keys)
        assert success - G.QUESTION_COST * length - 1e-9 <= ret <= success - G.QUESTION_COST * (length - 1) + 1e-9


def test_bc_only_filtered_mode_runs(runs_dir):
    summary = run_main(*SMOKE, "--bc-only", "--filter-top-frac", "0.2", runs_dir=runs_dir)  # in this process
    assert summary["args"]["n_train_dialogues"] == 60 and summary["args"]["betas"] == [0.0]
    assert summary["metrics"]["eval/best_beta"] == 0.0


def test_bad_input_gives_one_line_errors(runs_dir, tmp_path, monkeypatch):
    """The command line prints the one-line error of a bad --dataset-path, no traceback; the other bad inputs fail in
    the same parse_args, checked in this process."""
    proc = run_script(
        "ilql_per_token", "--dataset-path", str(tmp_path / "nope.jsonl"), runs_dir=runs_dir, expect_fail=True
    )
    assert "error: --dataset-path" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"turns": [{"agent": "is it big ?"}]}) + "\n")
    assert "is not a GuessTheImage JSONL dataset" in parse_error(monkeypatch, M, "--dataset-path", str(bad))
    assert "error: --checkpoint" in parse_error(monkeypatch, M, "--eval-only", "--checkpoint", str(tmp_path))
    assert "error: --filter-top-frac" in parse_error(monkeypatch, M, "--filter-top-frac", "0")
    no_secret = tmp_path / "no_secret.jsonl"
    no_secret.write_text(json.dumps({"turns": [{"agent": "is it big ?", "reply": "yes , it is big .", "reward": 0}]}))
    message = parse_error(monkeypatch, M, "--dataset-path", str(no_secret))
    assert "--belief-coef > 0 needs the logged secret_id" in message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--expectile", "1"], "--expectile must be in (0, 1)"),
        (["--tau", "0"], "0 < --tau <= 1"),
        (["--tau", "1.5"], "0 < --tau <= 1"),
        (["--cql-alpha", "-0.1"], "--cql-alpha"),
        (["--bc-weight", "-1"], "--bc-weight"),
        (["--belief-coef", "-1"], "--belief-coef"),
        (["--decay-frac", "1.5"], "--decay-frac must be in [0, 1]"),
        (["--betas"], "--betas must be a non-empty list"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--dataset-size", "0"], "--dataset-size"),
        (["--log-every", "0"], "--log-every"),
        (["--n-head", "0"], "--n-head"),
        (["--n-layer", "0"], "--n-layer"),
        (["--learning-rate", "-1e-3"], "--learning-rate"),
        (["--warmup-steps", "-1"], "--warmup-steps"),
        (["--weight-decay", "-0.1"], "--weight-decay"),
        (["--max-grad-norm", "0"], "--max-grad-norm > 0"),
    ],
)
def test_parse_args_rejects_bad_values(argv, message, monkeypatch, tmp_path):
    """Every bad value is a one-line error before any work (the CLI path of these checks is the one above)."""
    assert message in parse_error(monkeypatch, M, "--runs-dir", str(tmp_path), *argv)


@pytest.mark.slow
def test_ilql_value_backup_carries_the_final_reward_to_the_start(runs_dir):
    """~2 min. The behavioral claim (ILQL > BC) needs the full run (benchmark.sh): at this budget the tiny model
    does not yet read the answers. What must already work: the token-level backup carries the final reward ~40
    tokens back over the answerer's tokens, so V(<bos>) approaches the data's return (0 without bootstrapping, as
    the first tokens' reward is 0), and the Q regression fits."""
    summary = run_script("ilql_per_token", *SLOW, runs_dir=runs_dir, timeout=600)
    m = summary["metrics"]
    assert 0.2 < m["model/v_start"] < 1.0, m  # dataset mean return 0.41; the κ = 0.7 expectile sits above it
    assert m["model/final_q_loss"] < 0.1 and m["model/final_lm_loss"] < 0.5, m
    check_evaluation_bookkeeping(m, betas=(0.0, 4.0))
    assert m["eval/bc_valid_utterance_rate"] > 0.9, m  # the BC head already speaks the task's language


SLOW = (
    "--dataset-size",
    "3000",
    "--num-steps",
    "500",
    "--log-every",
    "50",
    "--batch-size",
    "32",
    "--eval-episodes",
    "90",
    "--val-episodes",
    "36",
    "--betas",
    "0",
    "4",
)


# ----------------------------------------------------------------------------------------------------- real models
HF_RUN = (  # ~10 s per architecture: 300 dialogues, 60 steps, 18 + 18 episodes per β
    "--dataset-size",
    "300",
    "--num-steps",
    "60",
    "--log-every",
    "20",
    "--batch-size",
    "16",
    "--eval-episodes",
    "18",
    "--val-episodes",
    "18",
    "--betas",
    "0",
    "4",
)


def test_real_checkpoint_keeps_its_weights_and_tokenizer(hf_checkpoint):
    """A save_pretrained GPT-2 / Llama / GPT-NeoX without separator and pad token: the script keeps the pretrained
    weights and the checkpoint's own tokenizer, adds "<sep>" and "<pad>" as new special tokens and grows the
    embeddings by exactly those rows; BOS / EOS stay the model's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original_tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    original = AutoModelForCausalLM.from_pretrained(hf_checkpoint)
    args = M.Args(model_name_or_path=str(hf_checkpoint))
    lm, heads, tok = M.build_model(args, torch.device("cpu"))
    n = len(original_tok)
    assert (tok.bos_token_id, tok.eos_token_id) == (original_tok.bos_token_id, original_tok.eos_token_id)
    assert sorted([tok.sep_token_id, tok.pad_token_id]) == [n, n + 1] and len(tok) == n + 2
    assert tok.convert_ids_to_tokens([tok.sep_token_id, tok.pad_token_id]) == [M.SEP_TOKEN, M.PAD_TOKEN]
    emb, emb0 = lm.get_input_embeddings().weight, original.get_input_embeddings().weight
    assert emb.shape[0] == n + 2 and torch.equal(emb[:n], emb0[:n])  # the pretrained token meanings are kept
    kept = dict(original.named_parameters())
    for name, p in lm.named_parameters():
        if p.shape == kept[name].shape:
            assert torch.equal(p, kept[name]), name
    assert heads.q1[-1].out_features == n + 2  # one Q-value per token of the grown vocabulary
    assert G.tokenize_prompt([], tok) == [original_tok.bos_token_id]


def test_real_checkpoint_end_to_end(hf_checkpoint, runs_dir):
    """Train and act with a real architecture: the LM loss falls, the evaluation runs with the model's own special
    tokens, the saved checkpoint reloads, and the trained agent never writes a special token."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original_tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    summary = run_main(*HF_RUN, "--model-name-or-path", str(hf_checkpoint), runs_dir=runs_dir)  # in this process
    m = summary["metrics"]
    assert m["model/final_lm_loss"] < m["model/first_lm_loss"] - 1.0, m  # it trains (from ~ln 400 = 6)
    check_evaluation_bookkeeping(m, betas=(0.0, 4.0))
    assert m["timestep/vocab_size"] == len(original_tok) + 2
    model_dir = Path(summary["run_dir"]) / "model"  # what --eval-only loads: save_pretrained + the ILQL heads
    tok, lm = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    heads = M.ILQLHeads(lm.config.hidden_size, M.n_logits(lm))
    heads.load_state_dict(load_file(model_dir / M.HEADS_FILE))
    assert tok.eos_token_id == original_tok.eos_token_id and tok.sep_token_id == len(original_tok)
    histories = [[], [("is it big ?", "yes , it is big .")], [("is it red ?", "no , it is not red .")]] * 4
    agent = M.ILQLAgent(lm, heads, tok, 4.0, top_k=20, greedy=False, seed=0, device=torch.device("cpu"))
    ids = M.generate_utterances(
        lm,
        heads,
        [G.tokenize_prompt(h, tok) for h in histories],
        tok.pad_token_id,
        tok.sep_token_id,
        4.0,
        20,
        False,
        torch.Generator().manual_seed(0),
        torch.device("cpu"),
        agent.banned,
        agent.max_new_tokens,
    )
    assert not set(tok.all_special_ids) & {t for u in ids for t in u}
    assert all("<" not in text and "endoftext" not in text for text in agent.act_batch(histories))


def test_missing_model_is_a_one_line_error(runs_dir, monkeypatch, tmp_path):
    """A hub id that is not in the local cache (offline), on the command line: a one-line error, no run dir (the model
    is loaded before the run starts; --dataset-size 1: the data comes first). A missing local dir fails in the same
    build_model, checked in this process."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: a hub id that is not in the local cache
    args = ("--model-name-or-path", "seqrl-tests/no-such-model", "--dataset-size", "1")
    proc = run_script("ilql_per_token", *args, runs_dir=runs_dir, expect_fail=True)
    assert "error: could not load --model-name-or-path" in proc.stderr and "Traceback" not in proc.stderr
    assert not runs_dir.exists() or not any(runs_dir.iterdir())  # no run dir for a run that never started
    with pytest.raises(SystemExit, match="error: could not load --model-name-or-path"):
        M.build_model(M.Args(model_name_or_path=str(tmp_path / "no_such_dir")), torch.device("cpu"))
