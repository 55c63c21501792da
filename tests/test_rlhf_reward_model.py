"""Tests of algos/rlhf_reward_model.py: losses by hand, pooling, Spearman, smoke runs, a slow learning test."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script, run_in_process, run_script

from envs import preference
from envs.preference import Completion

rm = load_script("rlhf_reward_model")
BAYES_GAP = 0.05  # the slow test's line = benchmark.sh's rlhf_rm claim: at most this far below the Bayes accuracy
TINY_ENSEMBLE = tuple(  # the default ensemble of 2 members
    "--n-train-prompts 48 --epochs 1 --eval-episodes 16 --n-norm-samples 64 --n-center-samples 8 --sft-epochs 1 "
    "--sft-examples 64".split()
)
TINY = (*TINY_ENSEMBLE, "--ensemble-size", "1")  # one reward model, saved as RUN_DIR/reward_model


def test_bradley_terry_loss_is_the_nll_by_hand():
    # lecture Problem 21.3: r("paris") = 2.0, r("i don't know") = 0.0 -> p = e^2 / (e^2 + 1) ≈ 0.88
    p = math.exp(2.0) / (math.exp(2.0) + 1.0)
    assert p == pytest.approx(0.8808, abs=1e-4)
    loss = rm.pairwise_loss(torch.tensor([2.0]), torch.tensor([0.0]))
    assert loss.item() == pytest.approx(-math.log(p), abs=1e-6)
    # margin and centering terms by hand
    loss = rm.pairwise_loss(torch.tensor([2.0, 1.0]), torch.tensor([0.0, 1.5]), margin=0.5, center_coef=0.1)
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = (-math.log(s(1.5)) + 0.1 * 4.0 - math.log(s(-1.0)) + 0.1 * 6.25) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_pairwise_and_kwise_agree_for_k2_and_kwise_pairs_by_hand():
    r = torch.tensor([[2.0, 0.0], [0.3, 1.1], [-1.0, -4.0]])  # (B, 2), best first
    pair = rm.pairwise_loss(r[:, 0], r[:, 1], margin=0.2, center_coef=0.05)
    assert rm.kwise_loss(r, "pairs", margin=0.2, center_coef=0.05).item() == pytest.approx(pair.item(), abs=1e-6)
    pair0 = rm.pairwise_loss(r[:, 0], r[:, 1])
    assert rm.kwise_loss(r, "softmax").item() == pytest.approx(pair0.item(), abs=1e-6)
    # K = 3, "pairs": mean of the three pair losses
    r3 = torch.tensor([[1.0, 0.5, -2.0]])
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    by_hand = -(math.log(s(0.5)) + math.log(s(3.0)) + math.log(s(2.5))) / 3
    assert rm.kwise_loss(r3, "pairs").item() == pytest.approx(by_hand, abs=1e-6)
    softmax = -math.log(math.exp(1.0) / (math.exp(1.0) + math.exp(0.5) + math.exp(-2.0)))
    assert rm.kwise_loss(r3, "softmax").item() == pytest.approx(softmax, abs=1e-6)


def test_pooled_index_is_last_non_pad_token_left_and_right():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert rm.last_non_pad_index(right).tolist() == [2, 4, 0]
    assert rm.last_non_pad_index(left).tolist() == [4, 4, 4]
    assert rm.position_ids_from_mask(left)[0].tolist() == [0, 0, 0, 1, 2]


def tiny_reward_model(args=None):
    lm, tok = rm.build_lm(args or rm.Args(), "cpu")
    return rm.reward_model_from(lm, tok, "cpu").eval(), tok


def test_reward_is_padding_invariant_and_matches_hf_forward():
    torch.manual_seed(0)
    model, tok = tiny_reward_model()
    assert tok.pad_token_id != tok.eos_token_id
    prompts = ["what is the capital of france ?"] * 3
    completions = [
        Completion("paris", True),
        Completion("it's a city called paris", True),
        Completion("i don't know", False),
    ]
    with torch.no_grad():
        r_right = rm.reward_forward(model, **rm.encode(tok, prompts, completions, "right"))
        r_left = rm.reward_forward(model, **rm.encode(tok, prompts, completions, "left"))
        single = torch.stack(
            [rm.reward_forward(model, **rm.encode(tok, [p], [c])) for p, c in zip(prompts, completions, strict=True)]
        )
        hf = model(**rm.encode(tok, prompts, completions, "right")).logits[:, 0]  # how rlhf_ppo_kl.py reads it
    torch.testing.assert_close(r_right, r_left, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_right, single.squeeze(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_right, hf, atol=1e-5, rtol=1e-5)


def test_causal_lm_loss_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))  # (1, 3, V=3)
    ids, mask = torch.tensor([[2, 1, 0]]), torch.tensor([[1, 1, 0]])  # last token is padding: not a target
    # targets: position 0 predicts ids[1] = 1 (p = 0.25); position 1 predicts ids[2] = pad (masked out)
    assert rm.causal_lm_loss(logits, ids, mask).item() == pytest.approx(-math.log(0.25), abs=1e-6)
    mask = torch.tensor([[1, 1, 1]])  # now both: mean of -log 0.25 and -log 0.1
    assert rm.causal_lm_loss(logits, ids, mask).item() == pytest.approx(-(math.log(0.25) + math.log(0.1)) / 2)


def test_sft_trains_the_lm_and_the_reward_model_gets_its_backbone(tmp_path):
    torch.manual_seed(0)
    args = rm.Args(sft_epochs=2, sft_examples=128, sft_batch_size=32, runs_dir=str(tmp_path), save_every=0)
    lm, tok = rm.build_lm(args, "cpu")
    before = {k: v.clone() for k, v in lm.base_model.state_dict().items()}
    run = rm.start_run(args)
    try:
        nll = rm.fine_tune_backbone(lm, tok, args, run, member=0, first=0, finished=[])
    finally:
        rm.restore_signal_handlers(run.stop)
    assert math.isfinite(nll) and nll < math.log(len(tok))  # below the uniform guess after 4 updates
    changed = [k for k, v in lm.base_model.state_dict().items() if not torch.equal(v, before[k])]
    assert "wte.weight" in changed and any(k.startswith("h.1.") for k in changed)  # SFT trained the backbone
    model = rm.reward_model_from(lm, tok, "cpu")
    for k, v in lm.base_model.state_dict().items():  # the reward model starts from exactly the SFT backbone
        assert torch.equal(model.base_model.state_dict()[k], v), k
    assert model.score.weight.shape == (1, args.n_embd) and model.config.pad_token_id == tok.pad_token_id


def test_spearman_and_rankdata():
    assert rm.rankdata(np.array([10.0, 20.0, 20.0, 5.0])).tolist() == [2.0, 3.5, 3.5, 1.0]
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert rm.spearman(x, x**3) == pytest.approx(1.0)
    assert rm.spearman(x, -x) == pytest.approx(-1.0)
    # hand: d = rank differences (0, 0, 1, -1, 0) -> 1 - 6 * 2 / (5 * 24) = 0.9
    assert rm.spearman(x, np.array([1.0, 2.0, 4.0, 3.0, 5.0])) == pytest.approx(0.9)


def test_calibration_table_by_hand():
    rows, ece = rm.calibration_table(np.array([0.05, 0.15, 0.95, 0.95]), np.array([0.05, 0.35, 0.85, 0.75]), 10)
    assert [r[2] for r in rows] == [1, 1, 2]
    assert ece == pytest.approx((0.0 + 0.2 + 2 * 0.15) / 4)


def test_fold_normalization_makes_saved_model_output_normalized(tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model, tok = tiny_reward_model()
    prompts = ["what is the capital of france ?"] * 4
    completions = [Completion(t, True) for t in ("paris", "london", "i don't know", "go away")]
    raw = rm.score_texts(model, tok, prompts, completions, "cpu")
    where = rm.fold_normalization(model, float(raw.mean()), float(raw.std()))
    assert where == "final-norm bias"
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    normed = rm.score_texts(loaded, tok, prompts, completions, "cpu")
    np.testing.assert_allclose(normed, (raw - raw.mean()) / raw.std(), atol=1e-4)


def test_prompt_baselines_remove_a_per_prompt_offset(monkeypatch):
    # A "reward model" that scores the gold utility plus an arbitrary per-prompt constant c(s): Bradley-Terry could
    # never tell it from the gold (same within-prompt differences). Pooled ρ suffers; the prompt baseline removes c(s).
    prompts = preference.heldout_prompts()
    offset = {p: 3.0 * math.sin(7.0 * i) for i, p in enumerate(prompts)}  # c(s), spread wider than the utilities
    texts: list[tuple[str, str]] = []

    def fake_score(model, tok, ps, cs, device):
        texts.extend(zip(ps, cs, strict=True))
        return preference.gold_utility_batch(ps, cs) + np.array([offset[p] for p in ps])

    monkeypatch.setattr(rm, "score_texts", fake_score)
    base = rm.prompt_baselines(None, None, prompts, 64, seed=0, device="cpu")
    assert len(texts) == 64 * len(prompts) and {p for p, _ in texts} == set(prompts)
    ps = [p for p in prompts for _ in range(8)]
    cs = preference.sample_completions(prompts, np.random.default_rng(1), n=8)
    gold = preference.gold_utility_batch(ps, cs)
    raw = gold + np.array([offset[p] for p in ps])
    centered = raw - np.array([base[p] for p in ps])
    assert rm.spearman(raw, gold) < 0.7
    assert rm.spearman(centered, gold) > 0.9  # only the sampling noise of the 64-sample baseline is left


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One tiny pairwise run (margin 0.1) with validation comparisons and the default ensemble of two: the smoke,
    validation and ensemble tests share it."""
    runs = tmp_path_factory.mktemp("smoke")
    argv = ("--loss", "pairwise", "--margin", "0.1", "--val-prompts", "16")
    summary = run_script("rlhf_reward_model", *TINY_ENSEMBLE, *argv, runs_dir=runs)
    return summary, runs


def test_smoke_run_and_eval_only(smoke_run):
    summary, runs_dir = smoke_run
    m = summary["metrics"]
    for key in (
        "eval/preference_accuracy",
        "eval/bayes_accuracy",
        "eval/spearman_gold",
        "eval/calibration_error",
        "eval/spearman_gold_centered",
    ):
        assert key in m and math.isfinite(m[key])
    # the ceiling is the labeler's on exactly the held-out comparisons (held-out prompts, seed + 10 000, C(4,2) pairs)
    heldout = preference.make_preference_dataset(16, 4, 1 + 10_000, 1.0, 0.0, split="heldout")
    pair_prompts, chosen, rejected = preference.to_pairs(heldout)
    assert m["eval/n_pairs"] == 16 * 6 == len(chosen)
    ceiling = preference.Labeler(temperature=1.0).bayes_accuracy(pair_prompts, chosen, rejected)
    assert m["eval/bayes_accuracy"] == pytest.approx(ceiling)
    assert m["model/reward_mean_normalized"] == pytest.approx(0.0, abs=1e-3)
    assert m["model/reward_std_normalized"] == pytest.approx(1.0, abs=1e-3)
    run_dir = summary["run_dir"]
    again = run_in_process(rm, runs_dir, *TINY, "--eval-only", "--checkpoint", run_dir)  # both members
    # same model, same held-out set -> same accuracy and correlation (calibration rescaled by the stored std)
    keys = ("eval/preference_accuracy", "eval/spearman_gold", "eval/calibration_error", "eval/spearman_gold_centered")
    for key in keys:
        assert again["metrics"][key] == pytest.approx(m[key], abs=1e-4)


def test_ensemble_members_are_single_runs_with_their_own_seeds_and_their_mean_is_normalized(smoke_run, tmp_path):
    """Member m trains as the one-model run of seed --seed + 1000 m on the same data; the saved members' mean reward
    is normalized on the SFT demonstrations (each member alone is not)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    summary, _ = smoke_run
    argv = ("--loss", "pairwise", "--margin", "0.1", "--val-prompts", "16")
    single = [run_in_process(rm, tmp_path, *TINY, *argv, "--seed", str(seed), "--data-seed", "1") for seed in (1, 1001)]
    load = AutoModelForSequenceClassification.from_pretrained
    members = [load(Path(summary["run_dir"]) / f"reward_model_{m}") for m in range(2)]
    alone = [load(Path(s["run_dir"]) / "reward_model") for s in single]
    key = "transformer.h.1.attn.c_attn.weight"  # trained, and untouched by the normalization (ln_f, score)
    for member, one in zip(members, alone, strict=True):
        assert torch.equal(member.state_dict()[key], one.state_dict()[key])
    assert not torch.equal(members[0].state_dict()[key], members[1].state_dict()[key])
    demos = preference.make_sft_dataset(64, seed=1 + 20_000)
    tok = AutoTokenizer.from_pretrained(Path(summary["run_dir"]) / "reward_model_0")
    scores = [rm.score_texts(m, tok, [d[0] for d in demos], [d[1] for d in demos], "cpu") for m in members]
    mean = np.mean(scores, axis=0)
    assert abs(mean.mean()) < 1e-4 and abs(mean.std() - 1) < 1e-4
    assert abs(scores[0].std() - 1) > 1e-3  # a member alone is on the ensemble's scale, not normalized itself


def test_smoke_validation_comparisons(smoke_run):
    summary, _ = smoke_run
    assert summary["args"]["val_prompts"] == 16
    m = summary["metrics"]  # the last epoch's loss and pair accuracy on 16 rankings never trained on
    assert math.isfinite(m["val/loss"]) and m["val/loss"] > 0 and 0.0 <= m["val/accuracy"] <= 1.0


@pytest.fixture(scope="module")
def head_only_runs(tmp_path_factory):
    """The saved reward models of two K-wise softmax runs without SFT from the same seed: --head-only-fraction 1.0,
    and untrained (--learning-rate 0); and the first run's summary."""
    from safetensors.torch import load_file

    runs = tmp_path_factory.mktemp("head_only")
    kwise = ("--loss", "kwise", "--kwise-form", "softmax", "--sft-epochs", "0")

    def run(*extra):
        summary = run_in_process(rm, runs, *TINY, *kwise, *extra)
        return summary, load_file(str(Path(summary["run_dir"]) / "reward_model" / "model.safetensors"))

    (summary, frozen), (_, untrained) = run("--head-only-fraction", "1.0"), run("--learning-rate", "0")
    return summary, frozen, untrained


def test_head_only_fraction_1_trains_the_head_and_leaves_the_backbone(head_only_runs):
    """--head-only-fraction 1.0 (LP-FT's first stage for the whole run): the backbone stays at its start, which an
    untrained run (--learning-rate 0) from the same seed saves too; the scalar head has moved."""
    _, frozen, untrained = head_only_runs
    backbone = [k for k in frozen if k != "score.weight" and ".ln_f." not in k]  # ln_f: the normalization's shift
    assert backbone and all(torch.equal(frozen[k], untrained[k]) for k in backbone)
    assert not torch.allclose(frozen["score.weight"], untrained["score.weight"])


def test_smoke_kwise_softmax(head_only_runs):
    summary, _, _ = head_only_runs  # the head-only run trains through the K-wise softmax loss
    assert summary["args"]["loss"] == "kwise" and summary["args"]["kwise_form"] == "softmax"
    assert math.isfinite(summary["metrics"]["eval/preference_accuracy"])


def test_real_checkpoint_keeps_its_weights_gets_a_pad_token_and_its_own_eos_and_bos(hf_checkpoint):
    # a tiny GPT-2 / Llama / GPT-NeoX saved with save_pretrained, byte-level BPE tokenizer without a pad token
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(hf_checkpoint)
    lm, tok = rm.build_lm(rm.Args(model_name_or_path=str(hf_checkpoint)), "cpu")
    assert type(lm) is type(original)
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    n = original.get_input_embeddings().num_embeddings  # the pretrained rows are kept, a pad row was added
    assert lm.get_input_embeddings().num_embeddings == len(tok) == n + 1
    torch.testing.assert_close(lm.get_input_embeddings().weight[:n], original.get_input_embeddings().weight)
    for (k, v), (k0, v0) in zip(lm.state_dict().items(), original.state_dict().items(), strict=True):
        if "embed" not in k and "wte" not in k and "lm_head" not in k and "embed_out" not in k:
            assert k == k0 and torch.equal(v, v0), k  # every other pretrained weight as loaded
    model = rm.reward_model_from(lm, tok, "cpu")
    assert type(model.base_model) is type(lm.base_model) and model.config.pad_token_id == tok.pad_token_id
    # the task's words, the tokenizer's tokens: an ended answer ends with the tokenizer's own EOS id, Llama gets <s>
    prompt = "what is the capital of france ?"
    enc = rm.encode(tok, [prompt, prompt], [Completion("paris", True), Completion("it's paris", False)])
    ids, mask = enc["input_ids"], enc["attention_mask"]
    last = mask.sum(1) - 1
    assert ids[0, last[0]] == tok.eos_token_id and ids[1, last[1]] != tok.eos_token_id
    assert (ids[0, 0] == tok.bos_token_id) == (original.config.model_type == "llama")
    assert tok.decode(ids[0], skip_special_tokens=True).strip() == f"{prompt} paris"


def test_smoke_run_on_real_checkpoint(hf_checkpoint, runs_dir):
    from transformers import AutoConfig, AutoTokenizer

    summary = run_in_process(rm, runs_dir, *TINY, "--model-name-or-path", str(hf_checkpoint))
    m = summary["metrics"]
    assert m["model/reward_mean_normalized"] == pytest.approx(0.0, abs=1e-3)
    assert m["model/reward_std_normalized"] == pytest.approx(1.0, abs=1e-3)
    assert math.isfinite(m["model/sft_nll"]) and math.isfinite(m["eval/spearman_gold_within_prompt"])
    out = Path(summary["run_dir"]) / "reward_model"
    assert AutoConfig.from_pretrained(out).model_type == AutoConfig.from_pretrained(hf_checkpoint).model_type
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.pad_token_id is not None and saved.pad_token_id != saved.eos_token_id
    again = run_in_process(rm, runs_dir, *TINY, "--eval-only", "--checkpoint", summary["run_dir"])
    assert again["metrics"]["eval/spearman_gold"] == pytest.approx(m["eval/spearman_gold"], abs=1e-4)


def test_bad_input_gives_clear_error(runs_dir, tmp_path, monkeypatch):
    def parse_error(*argv):  # the SystemExit message is what the command line prints (as the CLI run below shows)
        monkeypatch.setattr("sys.argv", ["rlhf_reward_model.py", "--runs-dir", str(runs_dir), *argv])
        with pytest.raises(SystemExit) as err:
            rm.parse_args()
        return str(err.value.code)

    assert parse_error("--eval-only", "--checkpoint", str(tmp_path / "nope")).startswith("error: --checkpoint")
    assert parse_error("--eval-only").startswith("error: --eval-only needs --checkpoint")
    assert parse_error("--n-center-samples", "0").startswith("error: --n-center-samples must be >= 1")
    with pytest.raises(SystemExit) as err:  # a local path that does not exist: main's build_lm, before any work
        rm.build_lm(rm.Args(model_name_or_path=str(tmp_path / "missing")), "cpu")
    assert str(err.value.code).startswith("error: --model-name-or-path")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline, a hub id that is not cached: one line, no traceback
    proc = run_script(
        "rlhf_reward_model",
        "--model-name-or-path",
        "seqrl-no-such-org/no-such-model",
        runs_dir=runs_dir,
        expect_fail=True,
    )
    assert "error: could not load --model-name-or-path" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--head-only-fraction", "1.5"], "--head-only-fraction must be in [0, 1]"),
        (["--head-only-fraction", "-0.1"], "--head-only-fraction must be in [0, 1]"),
        (["--val-prompts", "-3"], "--val-prompts must be >= 0"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--data-seed", "-1"], "--data-seed must be >= 0"),
        (["--n-norm-samples", "1"], "--n-norm-samples must be >= 2"),
        (["--dropout", "1.0"], "--dropout must be in [0, 1)"),
        (["--n-head", "0"], "--n-head must be >= 1"),
        (["--n-embd", "30"], "divisible by --n-head"),
        (["--learning-rate", "-1e-3"], "--learning-rate must be >= 0"),
        (["--weight-decay", "-0.01"], "--weight-decay must be >= 0"),
        (["--center-coef", "-1"], "--center-coef must be >= 0"),
        (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
        (["--flip-prob", "1.5"], "--flip-prob must be in [0, 1]"),
        (["--k", "1"], "--k must be >= 2"),
        (["--sft-epochs", "-1"], "--sft-epochs must be >= 0"),
        (["--save-every", "-1"], "--save-every must be >= 0"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--margin", "0.1", "--kwise-form", "softmax"], "--margin"),
    ],
)
def test_parse_args_rejects_bad_values(argv, message, monkeypatch, tmp_path):
    """Every bad value is a one-line error before any work (the CLI path of these checks is the one above)."""
    monkeypatch.setattr("sys.argv", ["rlhf_reward_model.py", "--runs-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as err:
        rm.parse_args()
    assert str(err.value.code).startswith("error: ") and message in str(err.value.code)


@pytest.mark.slow
def test_reward_model_learns_near_the_bayes_ceiling(runs_dir):
    # the default run (benchmark.sh's rlhf_rm claim, at its line): ~1.5 min alone on 2 cores. Tuning seeds 101-110:
    # 1.2-4.1 points below the ceiling; what is missing is a fact on a held-out phrasing, which varies by seed
    summary = run_script("rlhf_reward_model", runs_dir=runs_dir, timeout=900)
    m = summary["metrics"]
    assert m["eval/n_pairs"] == 2000 * 6  # the held-out pairs: ±0.35 points of label noise on the accuracy (1 SD)
    assert m["eval/preference_accuracy"] >= m["eval/bayes_accuracy"] - BAYES_GAP  # chance is 0.5, ceiling ≈ 0.75
    assert m["eval/spearman_gold_within_prompt"] > 0.7
    assert m["eval/score_lecture_0"] > m["eval/score_lecture_3"]  # "paris" > "london": the facts were learned
    assert m["eval/score_lecture_0"] > m["eval/score_lecture_4"] + 1.0  # "paris" >> rude
