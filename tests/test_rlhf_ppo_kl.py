"""Tests of algos/rlhf_ppo_kl.py: the PPO-with-KL math against hand computations, the model plumbing (left padding,
temperature, EOS masking, non-text tokens) against plain loops, and subprocess smoke runs (GPT-2 default, tiny real
GPT-2 / Llama / GPT-NeoX checkpoints, loading saved SFT / reward models, bad input)."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import load_script, run_in_process, run_script

from envs import preference
from envs.preference import Completion

M = load_script("rlhf_ppo_kl")
PARIS = "what is the capital of france ?"
SMOKE = (  # a few seconds: tiny data, tiny model, two PPO updates
    "--sft-examples",
    "128",
    "--sft-epochs",
    "1",
    "--pref-prompts",
    "8",
    "--rm-epochs",
    "1",
    "--num-updates",
    "2",
    "--batch-size",
    "8",
    "--num-minibatches",
    "2",
    "--update-epochs",
    "1",
    "--eval-every",
    "1",
    "--eval-episodes",
    "8",
    "--bon-max-n",
    "4",
    "--n-embd",
    "16",
    "--n-layer",
    "1",
    "--n-head",
    "2",
)


# SFT long enough that a tiny BPE model learns to end its answers: EOS rate 0.97-1.00 over 200 samples (2-3 s of SFT)
# for each architecture and seeds 1, 2 (also 1000 x 4 epochs of 16 and 2000 x 2 of 16); 60 evaluation samples
REAL_SMOKE = (
    *SMOKE[: SMOKE.index("--sft-examples")],
    "--sft-examples",
    "1000",
    "--sft-epochs",
    "3",
    "--sft-lr",
    "3e-3",
    "--sft-batch-size",
    "32",
    *SMOKE[SMOKE.index("--sft-epochs") + 2 : SMOKE.index("--eval-episodes")],
    "--eval-episodes",
    "60",
    *SMOKE[SMOKE.index("--eval-episodes") + 2 :],
)


def tiny_lm(vocab_size=12, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    return GPT2LMHeadModel(config).eval()


def no_mask(vocab_size=12):
    return torch.zeros(vocab_size, dtype=torch.bool)


def test_response_logprobs_match_manual_product_of_softmaxes_with_left_padding_and_temperature():
    lm, temperature, pad = tiny_lm(), 0.7, 0
    queries = [[1, 5, 6, 7], [1, 8]]  # different lengths: the second is left-padded
    responses = [[9, 3, 2], [4, 2, pad]]  # the second ends earlier (right padding after EOS)
    query_ids = torch.tensor([queries[0], [pad, pad] + queries[1]])  # (2, 4), left-padded
    response_ids = torch.tensor(responses)  # (2, 3)
    with torch.no_grad():
        logp = M.response_logprobs(M.lm_forward(lm, query_ids, response_ids, pad, no_mask()), response_ids, temperature)
    for i in range(2):
        n = 3 if i == 0 else 2
        manual = 0.0
        for t in range(n):  # plain loop: unpadded prefix, softmax(logits / T), probability of the next token
            prefix = torch.tensor([queries[i] + responses[i][:t]])
            with torch.no_grad():
                logits = lm(input_ids=prefix).logits[0, -1]
            manual += math.log(torch.softmax(logits / temperature, dim=-1)[responses[i][t]].item())
        assert logp[i, :n].sum().item() == pytest.approx(manual, abs=1e-4)


def test_generate_pads_after_eos_and_matches_sampling_distribution_shape():
    lm = tiny_lm()
    query_ids = torch.tensor([[0, 1, 5], [1, 6, 7]])
    out = M.generate(
        lm, query_ids, 0, 2, no_mask(), max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert out.shape == (2, 6)
    mask, has_eos = M.completion_mask(out, eos_id=2)
    for row, m, e in zip(out.tolist(), mask, has_eos, strict=False):
        if 2 in row:
            k = row.index(2)
            assert e and m.sum() == k + 1 and all(tok == 0 for tok in row[k + 1 :])
        else:
            assert not e and m.all()


def test_non_text_tokens_are_never_sampled_and_log_probs_see_the_same_distribution():
    lm, pad, eos = tiny_lm(), 0, 2
    not_text = no_mask()
    not_text[[0, 1, 3]] = True  # pad, bos, unk of the tiny vocabulary
    query_ids = torch.tensor([[1, 5, 6]] * 300)

    def sample(mask):
        gen = torch.Generator().manual_seed(0)
        return M.generate(lm, query_ids, pad, eos, mask, 6, 1.0, gen, return_logits=True)

    free, _ = sample(no_mask())  # a random tiny model: every token is likely somewhere in 300 x 6 samples
    free_mask, _ = M.completion_mask(free, eos)
    assert set(free[free_mask].tolist()) & {1, 3}  # without the mask bos / unk get sampled
    out, logits = sample(not_text)
    mask, _ = M.completion_mask(out, eos)
    assert not set(out[mask].tolist()) & {0, 1, 3}
    assert (logits[..., not_text] == M.NOT_TEXT_LOGIT).all()
    with torch.no_grad():
        fwd = M.lm_forward(lm, query_ids, out, pad, not_text)
    torch.testing.assert_close(fwd[mask], logits[mask], atol=1e-4, rtol=1e-4)
    logp = M.response_logprobs(fwd, out, 1.0)
    assert torch.isfinite(logp).all()  # also at the padding after EOS: the masked losses never see inf - inf
    probs = torch.softmax(fwd / 0.5, dim=-1)
    assert (probs[..., not_text] == 0).all()  # probability exactly 0, at any temperature


def test_generation_logits_equal_lm_forward_logits_on_real_architectures(hf_checkpoint):
    # what PPO samples from is exactly what its log-probs, ratios and KL are computed on (left padding, KV cache,
    # a BPE tokenizer given a pad token, special tokens masked)
    lm, tok = M.with_pad_token(*M.load_pretrained(str(hf_checkpoint), "causal", "ckpt"), "ckpt")
    lm = M.disable_dropout(lm).eval()
    not_text = M.not_text_mask(tok, lm.get_output_embeddings().weight.shape[0], "cpu")
    assert not_text[tok.pad_token_id] and not not_text[tok.eos_token_id]
    assert not_text[tok.bos_token_id] == (tok.bos_token_id != tok.eos_token_id)  # Llama's <s>; GPT-2's BOS is its EOS
    prompts = [PARIS, "name the main language of egypt .", "which language is spoken in sweden ?"] * 4
    query_ids = M.encode_prompts(tok, prompts, "cpu")  # left-padded: the prompts have different lengths
    assert (query_ids[:, 0] == tok.pad_token_id).any()
    out, gen_logits = M.generate(
        lm,
        query_ids,
        tok.pad_token_id,
        tok.eos_token_id,
        not_text,
        12,
        0.8,
        torch.Generator().manual_seed(0),
        return_logits=True,
    )
    mask, _ = M.completion_mask(out, tok.eos_token_id)
    with torch.no_grad():
        fwd_logits = M.lm_forward(lm, query_ids, out, tok.pad_token_id, not_text)
    T = gen_logits.shape[1]
    torch.testing.assert_close(fwd_logits[:, :T][mask[:, :T]], gen_logits[mask[:, :T]], atol=1e-4, rtol=1e-4)
    assert not not_text[out[mask]].any()


def test_decoded_completion_is_the_tasks_words_and_the_models_eos(hf_checkpoint):
    lm, tok = M.with_pad_token(*M.load_pretrained(str(hf_checkpoint), "causal", "ckpt"), "ckpt")
    answers = [Completion("it's a city called paris", True), Completion("paris paris", False)]
    rows = [M.completion_ids(tok, PARIS, c) for c in answers]
    assert rows[0][-1] == tok.eos_token_id and tok.eos_token_id not in rows[1]
    width = max(len(r) for r in rows) + 2
    response_ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask, has_eos = M.completion_mask(response_ids, tok.eos_token_id)
    decoded = M.decode_completions(tok, response_ids, mask, has_eos)
    assert decoded == answers  # no "</s>" / "<|endoftext|>" in the text, the end is the flag
    # a properly ended answer carries no missing-EOS penalty; one that never ended does
    gold = preference.gold_utility_batch([PARIS, PARIS], decoded)
    cut_off = preference.VERBOSE_UTILITY - preference.REPEAT_PENALTY - preference.MISSING_EOS_PENALTY
    assert gold.tolist() == pytest.approx([preference.VERBOSE_UTILITY, cut_off])
    # the completion is spelled as it follows the prompt (" paris" with its space), as SFT teaches it
    q = tok(PARIS, add_special_tokens=False)["input_ids"]
    full = tok(f"{PARIS} {answers[0].text}", add_special_tokens=False)["input_ids"]
    assert q + rows[0] == full + [tok.eos_token_id]
    assert tok.decode(M.prompt_ids(tok, PARIS) + rows[0], skip_special_tokens=True) == f"{PARIS} {answers[0].text}"


def test_completion_mask_includes_first_eos_only():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    mask, has_eos = M.completion_mask(ids, eos_id=2)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert has_eos.tolist() == [True, False, True]


def test_kl_penalty_sign_placement_and_sum_equals_lecture_reward():
    logprobs = torch.tensor([[-1.0, -0.5, -0.2, -3.0], [-2.0, -1.0, -4.0, -4.0]])
    ref_logprobs = torch.tensor([[-1.5, -0.5, -1.2, -0.1], [-1.0, -1.0, -0.3, -0.3]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    scores, beta = torch.tensor([2.0, -1.0]), 0.5
    rewards, kl = M.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, beta, "k1")
    # per token: -beta (log pi - log pi_ref); outside the completion exactly 0; the score at the last token
    expected = torch.tensor([[-0.25, 0.0, -0.5 + 2.0, 0.0], [0.5, 0.0 - 1.0, 0.0, 0.0]])
    assert torch.allclose(rewards, expected, atol=1e-6)
    assert kl[0, 0] > 0 and rewards[0, 0] < 0  # pi above pi_SFT on the sampled token: penalized
    assert kl[1, 0] < 0 and rewards[1, 0] > 0
    # sum_t r~_t = r_psi + beta (log pi_SFT(a|s) - log pi(a|s)): the lecture's r~
    seq = ((ref_logprobs - logprobs) * mask).sum(1)
    assert rewards.sum(1).tolist() == pytest.approx((scores + beta * seq).tolist())
    # k3 is non-negative and matches (rho - 1) - log rho
    _, kl3 = M.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, beta, "k3")
    rho = math.exp(-1.5 - (-1.0))
    assert kl3[0, 0].item() == pytest.approx(rho - 1 - math.log(rho)) and (kl3 >= 0).all()


def test_clipped_surrogate_against_hand_computation():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 3.0]]))  # ratios 1.5, 0.5, 1.1, 3.0 (last one masked)
    adv = torch.tensor([[1.0, -2.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = M.clipped_surrogate_loss(new, old, adv, mask, cliprange=0.2)
    # token 1: A>0, ratio 1.5 -> min(1.5, 1.2) * 1 = 1.2; token 2: A<0, ratio 0.5 -> max(-2*0.5, -2*0.8)... loss
    # = max(-A r, -A clip(r)): t1 max(-1.5, -1.2) = -1.2; t2 max(1.0, 1.6) = 1.6; t3 max(1.1, 1.1) = 1.1
    assert loss.item() == pytest.approx((-1.2 + 1.6 + 1.1) / 3, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(2 / 3)  # tokens 1 and 2 hit the clip
    assert stats["ratio"] == pytest.approx((1.5 + 0.5 + 1.1) / 3, abs=1e-6)
    logr = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    assert stats["approxkl"] == pytest.approx(0.5 * (logr**2).mean().item(), abs=1e-6)


def test_clipped_value_loss_against_hand_computation():
    vpred, old, ret = torch.tensor([[1.0, -0.5]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[2.0, 0.0]])
    loss, clipfrac = M.clipped_value_loss(vpred, old, ret, torch.ones(1, 2), cliprange_value=0.2)
    # t1: unclipped (1-2)^2 = 1, clipped 0.7 -> (0.7-2)^2 = 1.69 -> 1.69; t2: 0.25 vs (-0.2)^2 = 0.04 -> 0.25
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.25) / 2, abs=1e-6)
    assert clipfrac == pytest.approx(0.5)


def test_gae_gamma_one_against_plain_loop():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    rewards = rewards * mask
    gamma, lam = 1.0, 0.9
    adv, ret = M.gae(rewards, values, mask, gamma, lam)
    for i in range(3):
        n = int(mask[i].sum())
        for t in range(n):  # plain loop: A_t = sum_l (gamma lam)^l delta_{t+l}, V after the end = 0
            a = 0.0
            for k in range(t, n):
                v_next = values[i, k + 1].item() if k + 1 < n else 0.0
                a += (gamma * lam) ** (k - t) * (rewards[i, k].item() + gamma * v_next - values[i, k].item())
            assert adv[i, t].item() == pytest.approx(a, abs=1e-5)
            assert ret[i, t].item() == pytest.approx(a + values[i, t].item(), abs=1e-5)
        assert (adv[i, n:] == 0).all()
    # lam = 1, gamma = 1: the advantage is the sum of future rewards minus V_t (Monte Carlo)
    adv1, _ = M.gae(rewards, values, mask, 1.0, 1.0)
    mc = torch.flip(torch.cumsum(torch.flip(rewards, [1]), 1), [1])
    assert torch.allclose(adv1, (mc - values) * mask, atol=1e-5)


def test_bandit_advantage_is_sequence_return_minus_batch_mean_on_every_token():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = M.bandit_advantages(rewards, mask)  # returns 1.0 and 3.0, mean 2.0
    assert torch.allclose(adv, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]]))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = M.masked_whiten(x, mask)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert w[mask.bool()].tolist() == pytest.approx(((vals - 2.5) / vals.std()).tolist(), abs=1e-5)
    assert (w[~mask.bool()] == 0).all()
    kept = M.masked_whiten(x, mask, shift_mean=False)
    assert kept[mask.bool()].mean().item() == pytest.approx(2.5, abs=1e-5)


def test_bradley_terry_problem_21_3_and_bon_kl_and_adaptive_kl():
    loss = M.bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.0]))
    assert math.exp(-loss.item()) == pytest.approx(0.88, abs=0.005)  # lecture Problem 21.3
    assert M.bon_kl(1) == 0.0 and M.bon_kl(2) == pytest.approx(math.log(2) - 0.5)
    # the matched n: bon_kl(12) = 1.568, bon_kl(13) = 1.642 -> KL 1.56 gives 12, 1.62 gives 13; capped; KL < 0 -> 1
    assert [M.matched_bon_n(k, 64) for k in (1.56, 1.62, -0.3)] == [12, 13, 1] and M.matched_bon_n(50.0, 4) == 4
    assert M.adaptive_kl_update(0.1, kl=10.0, target=5.0, n_steps=100, horizon=1000) == pytest.approx(0.1 * 1.02)
    assert M.adaptive_kl_update(0.1, kl=4.0, target=5.0, n_steps=100, horizon=1000) == pytest.approx(0.1 * 0.98)


def test_gae_value_baseline_absorbs_a_per_prompt_constant():
    # Problem 21.3(c): a constant c(s) added to the final reward; a value head that has learned it (V + c) leaves the
    # GAE advantages exactly as they were (gamma = 1): the value baseline is what absorbs the constant
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    rewards = rewards * mask
    c = torch.tensor([2.0, -1.5, 0.7])  # one constant per prompt
    last = mask.long().sum(1) - 1
    shifted = rewards.clone()
    shifted[torch.arange(3), last] += c
    adv, _ = M.gae(rewards, values, mask, 1.0, 0.95)
    adv_c, _ = M.gae(shifted, values + c[:, None], mask, 1.0, 0.95)
    torch.testing.assert_close(adv_c, adv)
    adv_stale, _ = M.gae(shifted, values, mask, 1.0, 0.95)  # a baseline that has not learned c(s) does not
    assert not torch.allclose(adv_stale, adv)
    # the offsets themselves: seeded, in range, all zero when off
    prompts = preference.train_prompts()
    offsets = M.prompt_offsets(prompts, 2.0, seed=3)
    assert offsets == M.prompt_offsets(prompts, 2.0, seed=3) != M.prompt_offsets(prompts, 2.0, seed=4)
    assert all(-2.0 <= v <= 2.0 for v in offsets.values()) and np.std(list(offsets.values())) > 0.5
    assert set(M.prompt_offsets(prompts, 0.0, seed=3).values()) == {0.0}


def test_objective_and_best_of_n_use_the_missing_eos_penalty_and_offset(monkeypatch):
    # best-of-n picks by the objective PPO maximizes (normalized r_psi + c(s) - penalty * [no EOS]), not by raw r_psi
    prompts = [PARIS, "what is the capital of germany ?"]
    cut = Completion("paris", False)  # the right answer, cut off: gold 1 - 1 = 0
    idk = Completion("i don't know", True)  # gold -0.1
    right = Completion("berlin", True)  # gold 1
    samples = [cut, idk, right, idk]  # prompt-major, n = 2
    raw = {cut: 3.0, idk: 1.5, right: 2.0}  # the reward model likes the cut-off "paris" best

    monkeypatch.setattr(M, "sample_completions", lambda *a, **k: list(samples))
    monkeypatch.setattr(M, "rm_scores", lambda rm, tok, ps, cs, device: torch.tensor([raw[c] for c in cs]))
    norm, offsets = (1.0, 2.0), {PARIS: 5.0, prompts[1]: -5.0}
    scores = M.objective_scores(None, None, norm, offsets, [PARIS, PARIS], [cut, idk], 1.0, "cpu")
    assert scores.tolist() == pytest.approx([(3.0 - 1.0) / 2 + 5.0 - 1.0, (1.5 - 1.0) / 2 + 5.0])
    args = M.Args(missing_eos_penalty=1.0)
    gold = M.best_of_n(None, None, None, norm, offsets, None, None, prompts, 2, args, "cpu", seed=0)
    assert gold == pytest.approx((-0.1 + 1.0) / 2)  # idk over the cut-off paris, berlin over idk
    args = M.Args(missing_eos_penalty=0.0)  # what the old raw-score selection did: the cut-off answer wins
    gold = M.best_of_n(None, None, None, norm, offsets, None, None, prompts, 2, args, "cpu", seed=0)
    assert gold == pytest.approx((0.0 + 1.0) / 2)


def test_smoke_run_writes_summary_curve_and_models(runs_dir):
    summary = run_script("rlhf_ppo_kl", *SMOKE, runs_dir=runs_dir, timeout=300)
    m = summary["metrics"]
    run_dir = Path(summary["run_dir"])
    curve = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [0, 1, 2] and set(curve[0]) == {"step", "kl", "proxy_reward", "gold_reward"}
    assert curve[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as pi_SFT
    # the summary reports what the curve measured: SFT at step 0, the final policy last, the peak, the matched n
    assert m["eval/sft_gold_reward"] == curve[0]["gold_reward"] and m["eval/gold_reward"] == curve[-1]["gold_reward"]
    assert m["eval/episodic_return"] == m["eval/gold_reward"] and m["eval/kl"] == curve[-1]["kl"]
    assert m["eval/max_gold_reward"] == max(c["gold_reward"] for c in curve)
    assert m["eval/late_gold_reward"] == curve[-1]["gold_reward"]  # the last 20% of 2 updates: update 2
    assert m["eval/bon_n"] == M.matched_bon_n(m["eval/kl"], 4) and m["eval/bon_kl"] == M.bon_kl(int(m["eval/bon_n"]))
    assert math.isfinite(m["eval/bon_gold_reward"])
    assert summary["args"]["max_new_tokens"] == M.longest_demonstration(M.build_tokenizer(), M.Args(sft_examples=128))
    for sub in ("policy", "sft_model", "reward_model"):
        assert (run_dir / sub / "config.json").exists() and (run_dir / sub / "tokenizer.json").exists()
    # STEPS 1-3 skipped: load the saved SFT policy and reward model (as written by another run, same seed). STEP 4
    # re-seeds, so the run is the one that made them (what lets benchmark.sh's KL sweep share them); a per-prompt
    # reward offset changes the training objective only, never the evaluation. The runs below are main() in this
    # process, with the same arguments and one torch thread as the subprocess above (the command line is its)
    loaded = ("--sft-model-path", str(run_dir / "sft_model"), "--reward-model-path", str(run_dir / "reward_model"))
    again = run_in_process(M, runs_dir, *SMOKE, *loaded)
    assert again["metrics"] == m
    offset = run_in_process(M, runs_dir, *SMOKE, *loaded, "--reward-offset", "2.0")
    # same SFT policy, same eval noise: the same SFT gold reward
    assert offset["metrics"]["eval/sft_gold_reward"] == m["eval/sft_gold_reward"]
    # --eval-only on the run dir reproduces the final policy's evaluation
    ev = run_in_process(M, runs_dir, *SMOKE, "--eval-only", "--checkpoint", str(run_dir))
    assert ev["metrics"]["eval/gold_reward"] == pytest.approx(m["eval/gold_reward"])


def test_real_checkpoint_end_to_end_sft_ends_with_the_models_eos(hf_checkpoint, runs_dir):
    # a tiny GPT-2 / Llama / GPT-NeoX with a BPE tokenizer and no pad token, as a user's --model-name-or-path
    from transformers import AutoConfig, AutoTokenizer

    summary = run_in_process(M, runs_dir, *REAL_SMOKE, "--model-name-or-path", str(hf_checkpoint))
    m = summary["metrics"]
    assert m["eval/sft_eos_rate"] >= 0.9  # SFT taught the model to end its answers with its own EOS token
    assert summary["args"]["max_new_tokens"] > 16  # BPE spells the longest demonstrations in more than 16 tokens
    run_dir = Path(summary["run_dir"])
    curve = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [0, 1, 2] and all(math.isfinite(c["kl"]) for c in curve)
    model_type = AutoConfig.from_pretrained(hf_checkpoint).model_type
    for sub in ("policy", "sft_model", "reward_model"):  # the checkpoint's architecture, fine-tuned, with its pad
        assert AutoConfig.from_pretrained(run_dir / sub).model_type == model_type
        tok = AutoTokenizer.from_pretrained(run_dir / sub)
        assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id


def test_missing_reward_model_dir_is_a_clear_error(runs_dir, tmp_path, monkeypatch):
    # the SystemExit message is what the command line prints (the CLI run at the end shows it: one line, no traceback)
    monkeypatch.setattr("sys.argv", ["rlhf_ppo_kl.py", *SMOKE, "--reward-model-path", str(tmp_path / "nope")])
    with pytest.raises(SystemExit) as err:
        M.parse_args()
    assert str(err.value.code).startswith("error: --reward-model-path")
    (tmp_path / "empty").mkdir()
    for flag, path in (("sft_model_path", tmp_path / "empty"), ("model_name_or_path", tmp_path / "missing")):
        run = SimpleNamespace(args=M.Args(**{flag: str(path)}))  # STEP 1's load, as main calls it, before any work
        with pytest.raises(SystemExit) as err:
            M.Run.load_pretrained(run, str(path), "causal")
        assert str(err.value.code).startswith(f"error: --{flag.replace('_', '-')} "), err.value.code
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline, a hub id that is not cached: one line, no traceback
    proc = run_script(
        "rlhf_ppo_kl",
        *SMOKE,
        "--model-name-or-path",
        "seqrl-no-such-org/no-such-model",
        runs_dir=runs_dir,
        expect_fail=True,
    )
    assert "error: could not load --model-name-or-path" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-minibatches", "0"], "--num-minibatches"),
        (["--batch-size", "0"], "--batch-size"),
        (["--update-epochs", "0"], "--update-epochs"),
        (["--batch-size", "6"], "not divisible by --num-minibatches"),
        (["--seed", "-1"], "--seed"),
        (["--num-updates", "-1"], "--num-updates"),
        (["--eval-episodes", "0"], "--eval-episodes"),
        (["--eval-every", "0"], "--eval-every"),
        (["--bon-max-n", "0"], "--bon-max-n"),
        (["--kl-horizon", "0"], "--kl-horizon"),
        (["--rm-batch-size", "0"], "--rm-batch-size"),
        (["--pref-prompts", "0"], "--pref-prompts"),
        (["--pref-k", "1"], "--pref-k must be >= 2"),
        (["--n-head", "0"], "--n-head"),
        (["--n-embd", "30"], "divisible by --n-head"),
        (["--labeler-temperature", "0"], "--labeler-temperature"),
        (["--labeler-flip-prob", "1.5"], "--labeler-flip-prob"),
        (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
        (["--lam", "-0.1"], "--lam must be in [0, 1]"),
        (["--save-every", "-1"], "--save-every must be >= 0"),
        (["--resume", "x", "--eval-only", "--checkpoint", "y"], "nothing to --resume"),
        (["--learning-rate", "-1e-4"], "--learning-rate"),
        (["--vf-coef", "-1"], "--vf-coef"),
        (["--cliprange", "0"], "--cliprange"),
        (["--max-grad-norm", "0"], "--max-grad-norm"),
        (["--target-kl", "0"], "--target-kl"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_parse_args_rejects_bad_values(argv, message, monkeypatch, tmp_path):
    """Every bad value is a one-line error before any work (the CLI path of these checks is the one above)."""
    monkeypatch.setattr("sys.argv", ["rlhf_ppo_kl.py", "--runs-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as err:
        M.parse_args()
    assert str(err.value.code).startswith("error: ") and message in str(err.value.code)


@pytest.mark.slow
def test_kl_penalized_ppo_beats_sft_on_gold(runs_dir):
    """The default run (beta = 0.1, about 2-3 CPU minutes): the final policy's gold reward beats SFT's clearly."""
    summary = run_script("rlhf_ppo_kl", runs_dir=runs_dir, timeout=900)
    m = summary["metrics"]
    assert m["eval/gold_reward"] > m["eval/sft_gold_reward"] + 0.3
    assert m["eval/proxy_reward"] > m["eval/sft_proxy_reward"]
