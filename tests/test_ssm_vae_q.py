"""Tests of algos/ssm_vae_q.py: KL, ELBO, masks, double-Q target, Markov counts, smoke runs, TwoDoors learning."""

import json
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import spaces_env
import torch
from conftest import load_script, run_in_process, run_script

m = load_script("ssm_vae_q")


def test_gaussian_kl_matches_torch_distributions():
    torch.manual_seed(0)
    mu_q, mu_p = torch.randn(5, 3, 4), torch.randn(5, 3, 4)
    std_q, std_p = torch.rand(5, 3, 4) + 0.1, torch.rand(5, 3, 4) + 0.1
    q = torch.distributions.Independent(torch.distributions.Normal(mu_q, std_q), 1)
    p = torch.distributions.Independent(torch.distributions.Normal(mu_p, std_p), 1)
    expected = torch.distributions.kl_divergence(q, p)  # (5, 3)
    torch.testing.assert_close(m.gaussian_kl(mu_q, std_q, mu_p, std_p), expected)
    assert m.gaussian_kl(mu_q, std_q, mu_q, std_q).abs().max() < 1e-6


def test_kl_loss_free_nats_and_balance():
    post = (torch.zeros(2, 1, 1, requires_grad=True), torch.ones(2, 1, 1))
    prior = (torch.tensor([[[0.1]], [[3.0]]], requires_grad=True), torch.ones(2, 1, 1))
    loss, kl = m.kl_loss(post, prior, free_nats=1.0, balance=0.8)
    torch.testing.assert_close(kl, torch.tensor([[0.005], [4.5]]))  # 0.5 * (mu_q - mu_p)^2
    torch.testing.assert_close(loss, torch.tensor([[1.0], [4.5]]))  # clamped at 1 nat, alpha + (1 - alpha) = 1
    loss.sum().backward()
    assert prior[0].grad[0].item() == 0.0  # below the free nats: no gradient
    assert prior[0].grad[1].item() == pytest.approx(0.8 * 3.0)  # alpha of d/dmu_p 0.5 (mu_p - mu_q)^2
    assert post[0].grad[1].item() == pytest.approx(0.2 * -3.0)


def hand_batch(T=5, B=3, obs_dim=2):
    """Two short TwoDoors episodes per stream: reset, fail, pass | reset, pass."""
    obs = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])[:, None].expand(T, B, obs_dim)
    return {
        "obs": obs.contiguous(),
        "prev_action": torch.tensor([-1, 0, 1, -1, 1])[:, None].expand(T, B).contiguous(),
        "reward": torch.tensor([0.0, -0.1, 1.0, 0.0, 1.0])[:, None].expand(T, B).contiguous(),
        "terminated": torch.tensor([False, False, True, False, True])[:, None].expand(T, B).contiguous(),
        "is_first": torch.tensor([True, False, False, True, False])[:, None].expand(T, B).contiguous(),
    }


def test_elbo_shapes_and_terms_on_hand_made_batch():
    torch.manual_seed(0)
    batch = hand_batch()
    model = m.WorldModel(obs_dim=2, num_actions=2, deter=6, stoch=3, hidden=8)
    out = model.observe(batch["obs"], batch["prev_action"], batch["is_first"])
    assert out["h"].shape == (5, 3, 6) and out["z"].shape == (5, 3, 3)
    assert out["prior"][0].shape == out["post"][1].shape == (5, 3, 3)
    assert out["obs_mean"].shape == (5, 3, 2) and out["reward_mean"].shape == out["done_logit"].shape == (5, 3)
    mask = m.valid_mask(batch["is_first"], burn_in=4)
    terms = m.elbo_terms(out, batch, mask, obs_std=0.5, free_nats=0.0, kl_balance=0.5)
    assert all(v.shape == () for v in terms.values())
    # recon_obs against a hand computation of -log N(o; mean, 0.5) summed over 2 dims, mean over 15 entries
    err = ((batch["obs"] - out["obs_mean"]) ** 2).sum(-1) / 0.25
    expected = (0.5 * err + np.log(2 * np.pi * 0.25)).mean()
    torch.testing.assert_close(terms["recon_obs"], expected)
    # reward is only scored on the 3 entries with an incoming transition per stream
    trans = ~batch["is_first"]
    expected_r = (0.5 * (batch["reward"] - out["reward_mean"]) ** 2 + 0.5 * np.log(2 * np.pi))[trans].mean()
    torch.testing.assert_close(terms["recon_reward"], expected_r)
    torch.testing.assert_close(terms["neg_elbo"], terms["loss"])  # free_nats 0, balance 0.5: loss value = -ELBO
    terms["loss"].backward()
    assert model.prior_net[0].weight.grad.abs().sum() > 0 and model.obs_head[0].weight.grad.abs().sum() > 0


def test_valid_mask_and_filter_reset():
    is_first = torch.tensor([[False, True], [False, False], [True, False], [False, False], [False, False]])
    mask = m.valid_mask(is_first, burn_in=4)
    assert mask[:, 1].all()  # history complete from the start
    assert mask[:, 0].tolist() == [False, False, True, True, True]
    # is_first resets the filter: the result cannot depend on what came before it
    torch.manual_seed(0)
    model = m.WorldModel(2, 2, 6, 3, 8)
    h_a, h_b = torch.randn(1, 6), torch.zeros(1, 6)
    o, a = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    first = torch.tensor([True])
    torch.testing.assert_close(
        model.filter_step(h_a, torch.randn(1, 3), a, o, first)[0],
        model.filter_step(h_b, torch.zeros(1, 3), a, o, first)[0],
    )


def test_q_is_trained_only_on_beliefs_with_the_whole_episode_in_the_chunk():
    # column 0 starts mid-episode (the filter starts from zeros there: a belief acting never has), its next episode
    # starts at t = 3; column 1 starts at an episode start, the next one at t = 2
    is_first = torch.tensor(
        [[False, True], [False, False], [False, True], [True, False], [False, False], [False, False], [False, False]]
    )  # (T, B), one row per time step
    q_mask = m.q_loss_mask(is_first)  # (T-1, B): transition t -> t+1
    assert q_mask[:, 0].tolist() == [0, 0, 0, 1, 1, 1]  # before the episode start nothing, even at t >= burn-in
    assert q_mask[:, 1].tolist() == [1, 0, 1, 1, 1, 1]  # never into an is_first entry (1 -> 2 crosses episodes)
    # --q-burn-in 4: the approximation for long episodes also uses the mid-episode chunk from t = 4 on
    no_start = torch.zeros(7, 1, dtype=torch.bool)  # a chunk inside one long episode
    assert m.q_loss_mask(no_start).sum() == 0
    assert m.q_loss_mask(no_start, 4)[:, 0].tolist() == [0, 0, 0, 0, 1, 1]
    assert m.q_loss_mask(is_first, 2)[:, 0].tolist() == [0, 0, 0, 1, 1, 1]  # never across the episode start
    # the ELBO still learns from the tail of a mid-episode chunk (t >= burn-in)
    assert m.valid_mask(is_first, burn_in=4)[:, 0].tolist() == [False, False, False, True, True, True, True]


def test_pass_within_k_tries_latent_markov_truth():
    np.testing.assert_allclose(m.pass_within_k([0.5, 0.5, 0.5]), [0.5, 0.75, 0.875])  # Markov: 1 - 0.5^k
    np.testing.assert_allclose(m.pass_within_k([0.5, 0.0, 0.0]), [0.5, 0.5, 0.5])  # truth: a failed door stays shut
    np.testing.assert_allclose(m.true_pass_within_k(5), [0.5] * 5)
    # the truth is what the env does: try one door k times from the start
    env = gym.make("seqrl/TwoDoors-v0")
    passed = np.zeros(m.MAX_TRIES)
    n = 4000
    for ep in range(n):
        env.reset(seed=ep)
        door = ep % 2
        for j in range(m.MAX_TRIES):
            *_, terminated, _, _ = env.step(door)
            if terminated:
                passed[j:] += 1
                break
    np.testing.assert_allclose(passed / n, m.true_pass_within_k(), atol=4 * 0.5 / np.sqrt(n))


def test_eval_seeds_disjoint_across_training_seeds():
    num_envs, episodes = 8, m.EVAL_SEED_STRIDE
    blocks = [set(range(m.eval_env_seed(s), m.eval_env_seed(s) + episodes)) for s in range(0, 120)]
    training = set(range(0, 120 + num_envs))  # the training envs are seeded seed + i
    assert sum(len(b) for b in blocks) == len(set().union(*blocks)) and not training & set().union(*blocks)


@pytest.mark.parametrize("env_id", spaces_env.MODULE_IDS)
def test_structured_observation_spaces_are_flattened(runs_dir, env_id):
    env, raw = m.make_vector_env(env_id, {}, 1), gym.make(env_id)
    obs, raw_obs = env.reset(seed=0)[0][0], raw.reset(seed=0)[0]
    for _ in range(3):
        assert obs.dtype == np.float32
        np.testing.assert_array_equal(obs, spaces_env.expected_flat(raw_obs))
        obs, raw_obs = env.step(np.array([0]))[0][0], raw.step(0)[0]
    tiny = "--total-timesteps 200 --learning-starts 100 --num-envs 2 --eval-episodes 2 --deter-size 8 --hidden-size 8"
    s = run_in_process(m, runs_dir, "--env-id", env_id, *tiny.split())
    assert 0.0 <= s["metrics"]["eval/episodic_return"] <= spaces_env.EPISODE_LENGTH


def test_double_q_target():
    q_online = torch.tensor([[1.0, 2.0], [5.0, 0.0]])
    q_target = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    y = m.double_q_target(torch.tensor([1.0, 1.0]), torch.tensor([False, True]), q_online, q_target, gamma=0.5)
    torch.testing.assert_close(y, torch.tensor([1.0 + 0.5 * 20.0, 1.0]))  # online argmax, target value, no bootstrap


def test_markov_counts_give_one_half_on_two_doors_data():
    # 4 episodes of TwoDoors: (in_room, left) passes twice and fails twice, including two retries of a failed door
    in_room, passed = m.binary_codes(np.array([[1.0, 0.0], [0.0, 1.0]]))
    assert (in_room, passed) == (1, 2)
    codes = np.array([in_room] * 6)
    actions = np.array([0, 0, 0, 0, 1, 1])
    next_codes = np.array([passed, in_room, in_room, passed, passed, in_room])
    counts = m.markov_counts(codes, actions, next_codes, num_codes=4, num_actions=2)
    assert counts.sum() == 6 and counts[in_room, 0].sum() == 4
    assert m.markov_prob(counts, in_room, 0, passed) == 0.5
    assert m.markov_prob(counts, in_room, 1, passed) == 0.5
    assert np.isnan(m.markov_prob(counts, passed, 0, passed))  # never seen
    assert m.binary_codes(np.array([[0.3, 1.0]])) is None  # continuous obs: the baseline is skipped


def test_replay_transitions_never_cross_episodes():
    rep = m.StreamReplay(capacity=10, num_envs=1, obs_dim=2)
    stream = [([1, 0], -1, True), ([1, 0], 0, False), ([0, 1], 1, False), ([1, 0], -1, True), ([0, 1], 0, False)]
    for o, a, first in stream:
        rep.add(np.array([o], np.float32), np.array([a]), np.zeros(1), np.zeros(1, bool), np.array([first]))
    obs, act, next_obs = rep.transitions()
    assert act.tolist() == [0, 1, 0]  # 3 transitions, none into the is_first entry
    assert next_obs[:, 1].tolist() == [0.0, 1.0, 1.0]
    batch = rep.sample(4, 3, np.random.default_rng(0), "cpu")
    assert batch["obs"].shape == (3, 4, 2) and batch["is_first"].shape == (3, 4)


def test_smoke_run_eval_only_and_errors(runs_dir, monkeypatch):
    tiny = "--total-timesteps 400 --learning-starts 200 --num-envs 4 --eval-episodes 5 --log-every 5 --deter-size 16"
    s = run_script("ssm_vae_q", *tiny.split(), "--hidden-size", "16", runs_dir=runs_dir, timeout=120)
    for key in ("eval/episodic_return", "eval/one_step_obs_error", "model/p_pass_retry_same_door"):
        assert np.isfinite(s["metrics"][key]), key
    assert 0.0 <= s["metrics"]["model/markov_p_pass_same_door"] <= 1.0
    assert "losses/kl_last" in s["metrics"]
    metrics = s["metrics"]
    latent = [metrics[f"model/p_pass_within_{k}_tries"] for k in range(1, m.MAX_TRIES + 1)]
    for k in range(1, m.MAX_TRIES + 1):  # within k tries: truth 1/2; Markov 1 - (1 - p)^k from its own p
        assert metrics[f"model/true_p_pass_within_{k}_tries"] == 0.5
        markov = np.mean([1 - (1 - metrics[f"model/markov_p_pass_{door}"]) ** k for door in ("left", "right")])
        assert metrics[f"model/markov_p_pass_within_{k}_tries"] == pytest.approx(markov)
    assert 0.0 <= latent[0] and np.all(np.diff(latent) >= 0) and latent[-1] <= 1.0  # a CDF over tries
    # the first try is predicted as in the one-step probe (1000 particles each: Monte Carlo noise only)
    assert latent[0] == pytest.approx(metrics["model/p_pass_first_try"], abs=0.06)
    run_dir = Path(s["run_dir"])
    assert (run_dir / "model.safetensors").is_file() and json.loads((run_dir / "args.json").read_text())[
        "deter_size"
    ] == 16
    # --eval-only reloads the checkpoint (architecture from its args.json) into a new run dir
    e = run_script("ssm_vae_q", "--eval-only", "--checkpoint", str(run_dir), "--eval-episodes", "5", runs_dir=runs_dir)
    assert e["run_dir"] != s["run_dir"]
    assert e["metrics"]["model/p_pass_retry_same_door"] == pytest.approx(
        s["metrics"]["model/p_pass_retry_same_door"], abs=0.1
    )
    # clear errors: those of parse_args (main's first call; it makes the env once) in-process, as the SystemExit
    # message that Python prints as that one line on stderr, exit 1; a checkpoint that does not fit (found in main,
    # after parse_args) end to end
    bad = [
        ["--env-id", "seqrl/NoSuchEnv-v0"],
        ["--env-id", "Pendulum-v1"],  # continuous actions
        ["--env-kwargs", "[1, 2]"],
        ["--env-id", "tests.spaces_env:SpacesText-v0"],  # an observation space that cannot be flattened
        ["--env-id", "nosuchmodule:Foo-v0"],
        ["--eval-episodes", "10001"],
        ["--num-envs", "0"],  # before the buffer-size check divides by it
        ["--eval-only"],
        ["--eval-only", "--checkpoint", str(runs_dir / "missing")],
    ]
    corrupt = runs_dir / "corrupt.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    bad.append(["--eval-only", "--checkpoint", str(corrupt)])
    for args in bad:
        assert parse_error(monkeypatch, runs_dir, *args).startswith("error: "), args
    bare = runs_dir / "bare"  # weights without their args.json: the env comes from the flags, and its sizes differ
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((run_dir / "model.safetensors").read_bytes())
    args = ["--eval-only", "--checkpoint", str(bare / "model.safetensors"), "--env-id", "seqrl/TMaze-v0"]
    proc = run_script("ssm_vae_q", *args, runs_dir=runs_dir, expect_fail=True)
    assert "error: checkpoint does not fit" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-500:]


def parse_error(monkeypatch, runs_dir, *args: str) -> str:
    """The one-line SystemExit message of parse_args on the command line ARGS (what the script prints, exit 1)."""
    monkeypatch.setattr(sys, "argv", ["ssm_vae_q.py", "--runs-dir", str(runs_dir), *args])
    with pytest.raises(SystemExit) as exc:
        m.parse_args()
    error = str(exc.value.code)
    assert "\n" not in error, error
    return error


def test_keep_best_saves_and_reports_the_kept_networks(runs_dir, monkeypatch):
    tiny = ["--env-id", "seqrl/TMaze-v0", "--env-kwargs", '{"corridor_length": 2}'] + (
        "--total-timesteps 400 --learning-starts 200 --num-envs 4 --eval-episodes 6 --deter-size 16 --hidden-size 16"
        " --select-frequency 200 --select-episodes 4 --keep-best"
    ).split()
    s = run_in_process(m, runs_dir, *tiny)  # in-process: test_smoke_run_eval_only_and_errors runs commands
    metrics = s["metrics"]
    assert metrics["select/best_global_step"] in (200.0, 400.0)  # evaluations at 200 and 400 env steps
    assert {"eval/last_network_episodic_return", "eval/last_network_success_rate"} <= set(metrics)
    # --eval-only takes the env (TMaze, corridor 2, not the default TwoDoors) and the architecture from args.json
    e = run_in_process(m, runs_dir, "--eval-only", "--checkpoint", s["run_dir"], "--eval-episodes", "6")
    assert e["args"]["env_id"] == "seqrl/TMaze-v0" and e["args"]["env_kwargs"] == '{"corridor_length": 2}'
    assert e["metrics"]["eval/success_rate"] == metrics["eval/success_rate"]  # the kept networks are the saved ones
    assert e["metrics"]["eval/one_step_obs_error"] == pytest.approx(metrics["eval/one_step_obs_error"])
    if metrics["select/best_global_step"] == 400.0:  # the kept networks are the last ones: the same evaluation
        assert metrics["eval/last_network_one_step_obs_error"] == metrics["eval/one_step_obs_error"]
    assert parse_error(monkeypatch, runs_dir, "--keep-best") == "error: --keep-best needs --select-frequency > 0"


def test_smoke_run_continuous_obs_skips_markov(runs_dir):
    tiny = "--total-timesteps 300 --learning-starts 100 --num-envs 2 --eval-episodes 2 --deter-size 16 --hidden-size 16"
    s = run_in_process(m, runs_dir, "--env-id", "seqrl/MaskedCartPole-v0", *tiny.split())
    assert s["metrics"]["eval/episodic_return"] > 0
    assert not any(k.startswith("model/markov") for k in s["metrics"])


@pytest.mark.slow
def test_two_doors_latent_model_remembers_the_failed_door(runs_dir):
    s = run_script("ssm_vae_q", "--total-timesteps", "12000", "--eval-episodes", "200", runs_dir=runs_dir, timeout=400)
    metrics = s["metrics"]
    assert metrics["model/p_pass_retry_same_door"] < 0.1
    assert metrics["model/p_pass_other_door"] > 0.9
    assert 0.4 < metrics["model/p_pass_first_try"] < 0.6
    assert metrics["model/markov_p_pass_same_door"] == pytest.approx(0.5, abs=0.05)
    assert metrics["model/markov_p_pass_other_door"] == pytest.approx(0.5, abs=0.05)
    assert metrics["eval/episodic_return"] > 0.93  # memory-optimal 0.95; memoryless optimum 0.9


def test_runs_dir_that_is_a_file_is_a_clear_error(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("not a directory")
    proc = run_script("ssm_vae_q", runs_dir=afile, expect_fail=True)
    assert proc.stderr.strip() == f"error: --runs-dir {afile}: Not a directory"
