"""Tests of algos/rlhf_ppo_kl.py: the PPO-with-KL math against hand computations, the model plumbing (left padding,
temperature, EOS masking) against plain loops, and subprocess smoke runs (GPT-2 default, a tiny Llama, loading
saved SFT / reward models, bad input)."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import load_script, run_script

M = load_script("rlhf_ppo_kl")
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


def test_response_logprobs_match_manual_product_of_softmaxes_with_left_padding_and_temperature():
    lm, temperature, pad = tiny_lm(), 0.7, 0
    queries = [[1, 5, 6, 7], [1, 8]]  # different lengths: the second is left-padded
    responses = [[9, 3, 2], [4, 2, pad]]  # the second ends earlier (right padding after EOS)
    query_ids = torch.tensor([queries[0], [pad, pad] + queries[1]])  # (2, 4), left-padded
    response_ids = torch.tensor(responses)  # (2, 3)
    with torch.no_grad():
        logp = M.response_logprobs(M.lm_forward(lm, query_ids, response_ids, pad), response_ids, temperature)
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
        lm, query_ids, pad_id=0, eos_id=2, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert out.shape == (2, 6)
    mask, has_eos = M.completion_mask(out, eos_id=2)
    for row, m, e in zip(out.tolist(), mask, has_eos, strict=False):
        if 2 in row:
            k = row.index(2)
            assert e and m.sum() == k + 1 and all(tok == 0 for tok in row[k + 1 :])
        else:
            assert not e and m.all()


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
    assert M.adaptive_kl_update(0.1, kl=10.0, target=5.0, n_steps=100, horizon=1000) == pytest.approx(0.1 * 1.02)
    assert M.adaptive_kl_update(0.1, kl=4.0, target=5.0, n_steps=100, horizon=1000) == pytest.approx(0.1 * 0.98)


def test_smoke_run_writes_summary_curve_and_models(runs_dir):
    summary = run_script("rlhf_ppo_kl", *SMOKE, runs_dir=runs_dir, timeout=300)
    m = summary["metrics"]
    for key in (
        "eval/gold_reward",
        "eval/proxy_reward",
        "eval/kl",
        "eval/sft_gold_reward",
        "eval/bon_gold_reward",
        "eval/bon_n",
        "eval/episodic_return",
    ):
        assert isinstance(m[key], float) and math.isfinite(m[key])
    run_dir = Path(summary["run_dir"])
    curve = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [0, 1, 2] and set(curve[0]) == {"step", "kl", "proxy_reward", "gold_reward"}
    assert curve[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as pi_SFT
    assert -12.0 < m["eval/gold_reward"] < 1.0  # within the gold utility's range
    for sub in ("policy", "sft_model", "reward_model"):
        assert (run_dir / sub / "config.json").exists() and (run_dir / sub / "tokenizer.json").exists()
    # STEPS 1-3 skipped: load the saved SFT policy and reward model (as written by another run)
    again = run_script(
        "rlhf_ppo_kl",
        *SMOKE,
        "--sft-model-path",
        str(run_dir / "sft_model"),
        "--reward-model-path",
        str(run_dir / "reward_model"),
        runs_dir=runs_dir,
        timeout=300,
    )
    # same SFT policy, same eval noise: the same SFT gold reward
    assert again["metrics"]["eval/sft_gold_reward"] == pytest.approx(m["eval/sft_gold_reward"])
    # --eval-only on the run dir reproduces the final policy's evaluation
    ev = run_script("rlhf_ppo_kl", *SMOKE, "--eval-only", "--checkpoint", str(run_dir), runs_dir=runs_dir)
    assert ev["metrics"]["eval/gold_reward"] == pytest.approx(m["eval/gold_reward"])


def test_another_architecture_tiny_llama(runs_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    import envs.tokenizer

    tokenizer = envs.tokenizer.build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    summary = run_script("rlhf_ppo_kl", *SMOKE, "--model-name-or-path", str(tmp_path / "llama"), runs_dir=runs_dir)
    assert math.isfinite(summary["metrics"]["eval/gold_reward"])
    saved = json.loads((Path(summary["run_dir"]) / "policy" / "config.json").read_text())
    assert saved["model_type"] == "llama"


def test_missing_reward_model_dir_is_a_clear_error(runs_dir, tmp_path):
    proc = run_script(
        "rlhf_ppo_kl", *SMOKE, "--reward-model-path", str(tmp_path / "nope"), runs_dir=runs_dir, expect_fail=True
    )
    assert "error: --reward-model-path" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = run_script(
        "rlhf_ppo_kl", *SMOKE, "--sft-model-path", str(tmp_path / "empty"), runs_dir=runs_dir, expect_fail=True
    )
    assert "error: --sft-model-path" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_kl_penalized_ppo_beats_sft_on_gold(runs_dir):
    """The default run (beta = 0.1, about 2-3 CPU minutes): the final policy's gold reward beats SFT's clearly."""
    summary = run_script("rlhf_ppo_kl", runs_dir=runs_dir, timeout=900)
    m = summary["metrics"]
    assert m["eval/gold_reward"] > m["eval/sft_gold_reward"] + 0.3
    assert m["eval/proxy_reward"] > m["eval/sft_proxy_reward"]
