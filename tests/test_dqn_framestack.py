"""Tests of algos/dqn_framestack.py: stacks by index, replay validity, TD targets, autoreset, runs and errors."""

import json
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import spaces_env
import torch
from conftest import load_script, run_in_process, run_script

dqn = load_script("dqn_framestack")


TMAZE_STARTS = {(0.0, 1.0, 1.0), (1.0, 1.0, 0.0)}  # the two cue observations of TMaze, seen only at t = 0


def eval_only(run_dir, runs_dir, episodes=4):
    """The summary of `--eval-only` on a saved run (its env and architecture come from its args.json), in-process
    (test_smoke_tmaze_and_eval_only_roundtrip runs it as a command)."""
    return run_in_process(dqn, runs_dir, "--eval-only", "--checkpoint", run_dir, "--eval-episodes", str(episodes))


def scripted_replay():
    """One env, D = 1, k = 3, capacity 6: episode 1 is 10, 11, 12 (terminated), episode 2 is 20, 21, 22, ..."""
    rb = dqn.FrameStackReplay(capacity=6, num_envs=1, obs_dim=1, k=3)
    no, yes = np.array([False]), np.array([True])
    rb.reset(np.array([[10.0]]))  # slot 0
    rb.add(np.array([1]), np.array([-1.0]), np.array([0.0]), np.array([[11.0]]), no)  # slot 1
    rb.add(np.array([1]), np.array([5.0]), np.array([1.0]), np.array([[12.0]]), no)  # slot 2: final obs
    rb.add(np.array([0]), np.array([0.0]), np.array([0.0]), np.array([[20.0]]), yes)  # slot 3: NEXT_STEP reset
    for value in (21.0, 22.0):  # slots 4, 5
        rb.add(np.array([1]), np.array([-1.0]), np.array([0.0]), np.array([[value]]), no)
    return rb


def stack_at(rb, slot):
    return dqn.build_stacks(rb.obs, rb.ep_step, np.array([slot]), np.array([0]), rb.k)[0].tolist()


def test_stacks_zero_pad_at_episode_start_and_never_show_the_previous_episode():
    rb = scripted_replay()
    assert stack_at(rb, 0) == [0.0, 0.0, 10.0]
    assert stack_at(rb, 1) == [0.0, 10.0, 11.0]
    assert stack_at(rb, 2) == [10.0, 11.0, 12.0]  # the final (terminal) observation of episode 1
    assert stack_at(rb, 3) == [0.0, 0.0, 20.0]  # not [11, 12, 20]
    assert stack_at(rb, 4) == [0.0, 20.0, 21.0]  # not [12, 20, 21]
    assert stack_at(rb, 5) == [20.0, 21.0, 22.0]
    assert rb.valid[:, 0].tolist() == [True, True, False, True, True, False]  # autoreset slot and newest: invalid


def test_stacks_across_the_ring_wrap():
    rb = scripted_replay()
    for value in (23.0, 24.0):  # overwrite slots 0 and 1
        rb.add(np.array([1]), np.array([-1.0]), np.array([0.0]), np.array([[value]]), np.array([False]))
    assert rb.pos == 1 and rb.size == 6
    assert stack_at(rb, 0) == [21.0, 22.0, 23.0]  # slots 4, 5, 0
    assert stack_at(rb, 1) == [22.0, 23.0, 24.0]  # slots 5, 0, 1
    assert rb.current_stacks()[0].tolist() == [22.0, 23.0, 24.0]


def test_sampling_skips_autoreset_and_overwritten_windows():
    rb = scripted_replay()
    for value in (23.0, 24.0):
        rb.add(np.array([1]), np.array([-1.0]), np.array([0.0]), np.array([[value]]), np.array([False]))
    # ring now (slot: value) 0:23 1:24 2:12 3:20 4:21 5:22 with pos = 1. Ages 1..size-k = 1..3 -> slots 0, 5, 4;
    # slot 2 (12, the autoreset slot) is invalid, slot 3 (20) is too old: its window would reach slot 1 (overwritten).
    slots, _ = rb.sample_slots(2000, np.random.default_rng(0))
    assert set(slots.tolist()) == {0, 5, 4}
    batch = rb.sample(500, np.random.default_rng(1))
    np.testing.assert_array_equal(batch["next_obs"][:, -1], batch["obs"][:, -1] + 1.0)  # one step, same episode
    np.testing.assert_array_equal(batch["next_obs"][:, :-1], batch["obs"][:, 1:])  # the window shifts by one


def test_sampled_terminal_transition_carries_reward_and_flag():
    # k = 2, episode 1 is 10, 11, 12, 13 (the step 12 -> 13 terminates with reward 5), episode 2 is 20, 21
    rb = dqn.FrameStackReplay(capacity=10, num_envs=1, obs_dim=1, k=2)
    rb.reset(np.array([[10.0]]))
    for value, reward, term, reset in [(11, -1, 0, 0), (12, -1, 0, 0), (13, 5, 1, 0), (20, 0, 0, 1), (21, -1, 0, 0)]:
        rb.add(np.array([1]), np.array([reward]), np.array([term]), np.array([[value]]), np.array([bool(reset)]))
    batch = rb.sample(500, np.random.default_rng(0))  # ages 1..4: slots 4, 3 (autoreset, rejected), 2, 1
    assert set(batch["obs"][:, -1].tolist()) == {11.0, 12.0, 20.0}
    terminal = batch["discount"] == 0.0
    assert terminal.any()
    np.testing.assert_array_equal(batch["obs"][terminal], [[11.0, 12.0]] * terminal.sum())
    np.testing.assert_array_equal(batch["next_obs"][terminal], [[12.0, 13.0]] * terminal.sum())
    assert (batch["rewards"][terminal] == 5.0).all() and (batch["discount"][~terminal] == 1.0).all()
    first = batch["obs"][:, -1] == 20.0
    np.testing.assert_array_equal(batch["obs"][first], [[0.0, 20.0]] * first.sum())  # zero-padded, not 13


def test_n_step_sample_cuts_at_termination_final_observation_and_newest_slot():
    # k = 1, episode 1: 10 -> 11 -> 12 -> 13 (rewards 1, 2, 3; the step to 13 terminates); episode 2: 20 -> 21 -> 22
    # (rewards 4, 5), truncated at 22 (its next slot is an autoreset), then 30 -> 31 (reward 6), 31 the newest slot
    rb = dqn.FrameStackReplay(capacity=20, num_envs=1, obs_dim=1, k=1)
    rb.reset(np.array([[10.0]]))
    steps = [(11, 1, 0, 0), (12, 2, 0, 0), (13, 3, 1, 0), (20, 0, 0, 1), (21, 4, 0, 0), (22, 5, 0, 0), (30, 0, 0, 1)]
    for value, reward, term, reset in steps + [(31, 6, 0, 0)]:
        rb.add(np.array([1]), np.array([reward]), np.array([term]), np.array([[value]]), np.array([bool(reset)]))
    batch = rb.sample(2000, np.random.default_rng(0), n_step=3, gamma=0.5)
    expected = {  # start obs: (n-step reward sum, discount, bootstrap obs)
        10.0: (1 + 0.5 * 2 + 0.25 * 3, 0.0, 13.0),  # terminates within 3 steps: no bootstrap
        11.0: (2 + 0.5 * 3, 0.0, 13.0),
        12.0: (3.0, 0.0, 13.0),
        20.0: (4 + 0.5 * 5, 0.25, 22.0),  # truncated: bootstraps from the final observation 22
        21.0: (5.0, 0.5, 22.0),
        30.0: (6.0, 0.5, 31.0),  # the newest slot has no transition yet: bootstraps there
    }
    assert set(batch["obs"][:, 0].tolist()) == set(expected)
    for start, (reward, discount, boot) in expected.items():
        rows = batch["obs"][:, 0] == start
        np.testing.assert_allclose(batch["rewards"][rows], reward)
        np.testing.assert_allclose(batch["discount"][rows], discount)
        np.testing.assert_array_equal(batch["next_obs"][rows, 0], boot)
    one = rb.sample(500, np.random.default_rng(0), n_step=1, gamma=0.5)  # the one-step target
    np.testing.assert_array_equal(one["next_obs"][:, 0], np.where(one["obs"][:, 0] == 12.0, 13.0, one["obs"][:, 0] + 1))


def test_td_target_termination_vs_truncation_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0])
    discount = 0.9 * (1.0 - torch.tensor([0.0, 1.0, 0.0]))  # the third is a time-limit truncation: it bootstraps
    next_q_target = torch.tensor([[1.0, 5.0], [2.0, 4.0], [7.0, 3.0]])
    y = dqn.td_target(rewards, discount, next_q_target)
    torch.testing.assert_close(y, torch.tensor([1.0 + 0.9 * 5.0, 2.0, 3.0 + 0.9 * 7.0]))


def test_double_q_target_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0])
    discount = 0.9 * (1.0 - torch.tensor([0.0, 1.0, 0.0]))
    next_q_target = torch.tensor([[1.0, 5.0], [2.0, 4.0], [7.0, 3.0]])
    next_q_online = torch.tensor([[9.0, 0.0], [0.0, 9.0], [0.0, 9.0]])  # online argmax: 0, 1, 1
    y = dqn.td_target(rewards, discount, next_q_target, next_q_online)
    torch.testing.assert_close(y, torch.tensor([1.0 + 0.9 * 1.0, 2.0, 3.0 + 0.9 * 3.0]))


def drive(env_id, env_kwargs, num_envs, k, steps, policy, capacity=64, num_actions=0):
    """Run the script's collection loop (NEXT_STEP autoreset) and an independent rolling stack side by side
    (`num_actions` > 0: frames with the previous action, --stack-actions)."""
    envs = gym.vector.SyncVectorEnv([dqn.make_env(env_id, env_kwargs) for _ in range(num_envs)])
    obs, _ = envs.reset(seed=0)
    rb = dqn.FrameStackReplay(capacity, num_envs, obs.shape[1], k, num_actions)
    rb.reset(obs)
    prev = np.full(num_envs, -1) if num_actions else None
    frame = dqn.eval_frame(obs, prev, num_actions)
    rolling = dqn.roll_stack(np.zeros((num_envs, k, frame.shape[1]), dtype=np.float32), frame)
    autoreset = np.zeros(num_envs, dtype=bool)
    log = []
    for t in range(steps):
        np.testing.assert_array_equal(rb.current_stacks(), rolling.reshape(num_envs, -1))
        actions = policy(t, num_envs)
        next_obs, rewards, terminated, truncated, _ = envs.step(actions)
        rb.add(actions, rewards, terminated, next_obs, autoreset)
        log.append((autoreset.copy(), terminated.copy(), truncated.copy(), rewards.copy()))
        prev = np.where(autoreset, -1, actions) if num_actions else None  # the reset obs has no previous action
        frame = dqn.eval_frame(next_obs, prev, num_actions)
        rolling = dqn.roll_stack(rolling, frame)
        rolling[autoreset] = dqn.roll_stack(np.zeros_like(rolling[autoreset]), frame[autoreset])
        autoreset = terminated | truncated
    envs.close()
    return rb, log


def test_stacks_with_previous_actions_match_the_rolling_evaluation_stack():
    rng = np.random.default_rng(1)

    def actions(t, n):
        return rng.integers(0, 4, size=n)

    # 80 steps into a ring of 40 slots: it wraps twice
    rb, log = drive("seqrl/TMaze-v0", {"corridor_length": 2}, 3, 4, 80, actions, capacity=40, num_actions=4)
    assert any(entry[0].any() for entry in log)
    # by hand, env 0: the newest frame of the stack at slot s carries onehot(action of slot s - 1) within an episode
    stacks = rb.stacks(np.arange(40), np.zeros(40, dtype=np.int64)).reshape(40, 4, 3 + 4)
    for s in range(40):
        expected = np.eye(4)[rb.actions[(s - 1) % 40, 0]] if rb.ep_step[s, 0] > 0 else np.zeros(4)
        np.testing.assert_array_equal(stacks[s, -1, 3:], expected)
        np.testing.assert_array_equal(stacks[s, -1, :3], rb.obs[s, 0])


def test_tmaze_bump_and_step_east_give_the_same_stack_without_actions():
    """Why a 4-frame stack fails TMaze-3 (detail 9): after a wall bump at t = 0 the stack equals the stack after
    a step east, so Q(s_0, west) = Q(s_0, east) at the fixed point; with the previous actions they differ."""
    west, east = 3, 1  # TMaze actions
    for num_actions in (0, 4):
        stacks = {}
        for first in (west, east):
            rb, _ = drive(
                "seqrl/TMaze-v0",
                {"corridor_length": 3},
                1,
                4,
                1,
                lambda t, n, a=first: np.full(n, a),
                num_actions=num_actions,
            )
            stacks[first] = rb.current_stacks()[0]
        assert np.array_equal(stacks[west], stacks[east]) == (num_actions == 0)


def test_autoreset_next_step_with_a_real_vector_env():
    rng = np.random.default_rng(0)
    rb, log = drive("seqrl/TMaze-v0", {"corridor_length": 1}, 3, 3, 60, lambda t, n: rng.integers(0, 4, size=n))
    assert rb.size == 61 and rb.pos == 60
    for slot in range(60):  # every slot of the unwrapped ring
        autoreset, _, _, reward = log[slot]
        # a reset observation (ep_step 0) is exactly the one returned by the autoreset step, or the first reset
        np.testing.assert_array_equal(rb.ep_step[slot + 1] == 0, autoreset)
        np.testing.assert_array_equal(rb.valid[slot], ~autoreset)  # the autoreset step is not a transition
        assert (reward[autoreset] == 0.0).all()
        starts = {tuple(o) for o in rb.obs[slot + 1][autoreset].tolist()}
        assert starts <= TMAZE_STARTS
        within = ~autoreset
        np.testing.assert_array_equal(rb.ep_step[slot + 1][within], rb.ep_step[slot][within] + 1)
    assert any(log[s][0].any() for s in range(60))  # episodes did end and restart


def test_truncation_is_stored_as_a_bootstrapping_transition():
    # ThreeStateLine with a 2-step limit, always "left": from A the agent bumps the wall and is truncated at t = 2,
    # from C it reaches B at t = 1 (terminated).
    rb, log = drive("seqrl/ThreeStateLine-v0", {"max_steps": 2}, 4, 2, 30, lambda t, n: np.zeros(n, dtype=np.int64))
    terminated = np.array([entry[1] for entry in log])  # (T, N)
    truncated = np.array([entry[2] for entry in log])  # (T, N)
    assert truncated.any() and terminated.any()
    np.testing.assert_array_equal(rb.terminated[:30], terminated.astype(np.float32))  # truncation stored as 0
    np.testing.assert_array_equal(rb.valid[:30][truncated], True)  # the truncated step itself is sampled
    np.testing.assert_array_equal(rb.valid[1:31][truncated], False)  # the slot of its final obs is not


def test_td_loss_huber_and_mse_by_hand():
    q = torch.tensor([0.0, 0.0, 0.0])
    y = torch.tensor([0.5, -2.0, 3.0])  # Huber (delta 1): 0.5 * 0.25, 2 - 0.5, 3 - 0.5
    torch.testing.assert_close(dqn.td_loss(q, y, "huber"), torch.tensor((0.125 + 1.5 + 2.5) / 3))
    torch.testing.assert_close(dqn.td_loss(q, y, "mse"), torch.tensor((0.25 + 4.0 + 9.0) / 3))


def test_observation_scale_divides_by_bounds_and_keeps_zero_padding():
    space = gym.spaces.Box(np.array([-4.8, -0.5, 0.0, -np.inf]), np.array([4.8, 2.0, 0.0, np.inf]))
    np.testing.assert_allclose(dqn.observation_scale(space), [1 / 4.8, 0.5, 1.0, 1.0])
    env = dqn.make_env("seqrl/MaskedCartPole-v0", {}, scale_obs=True)()
    raw = dqn.make_env("seqrl/MaskedCartPole-v0", {})()
    obs, _ = env.reset(seed=3)
    raw_obs, _ = raw.reset(seed=3)
    np.testing.assert_allclose(obs, raw_obs / np.array([4.8, 0.41887903]), rtol=1e-5)
    assert env.observation_space.contains(obs) and env.observation_space.high.tolist() == pytest.approx([1.0, 1.0])
    tmaze = dqn.make_env("seqrl/TMaze-v0", {}, scale_obs=True)()  # 0/1 codes: bound 1, unchanged
    assert tuple(tmaze.reset(seed=0)[0].tolist()) in TMAZE_STARTS


def test_linear_schedule():
    assert dqn.linear_schedule(1.0, 0.05, 100, 0) == 1.0
    assert dqn.linear_schedule(1.0, 0.05, 100, 50) == pytest.approx(0.525)
    assert dqn.linear_schedule(1.0, 0.05, 100, 1000) == 0.05


# CleanRL-like settings for the small discrete POMDPs (the script defaults are tuned for MaskedCartPole)
TMAZE_CLEANRL_LIKE = [
    "--learning-rate",
    "5e-4",
    "--train-frequency",
    "1",
    "--gradient-steps",
    "1",
    "--batch-size",
    "128",
    "--exploration-fraction",
    "0.5",
    "--end-e",
    "0.05",
    "--hidden-size",
    "128",
    "--gamma",
    "0.99",
    "--target-network-frequency",
    "256",
    "--difference-scale",
    "0",
]
TINY = ["--total-timesteps", "400", "--learning-starts", "128", "--batch-size", "32", "--num-envs", "2"]


TMAZE = ["--env-id", "seqrl/TMaze-v0", "--env-kwargs", '{"corridor_length": 2}', "--eval-episodes", "8"]


@pytest.fixture(scope="module")
def tmaze_run(tmp_path_factory):
    """One tiny TMaze run (frame stack 4, the default): smoke-tested, and its weights for the mismatch error."""
    return run_script("dqn_framestack", *TMAZE, *TINY, runs_dir=tmp_path_factory.mktemp("tmaze"), timeout=120)


def test_smoke_tmaze_and_eval_only_roundtrip(tmaze_run, runs_dir):
    summary = tmaze_run
    metrics = summary["metrics"]
    assert {"eval/episodic_return", "eval/episodic_length", "eval/success_rate"} <= set(metrics)
    assert 0.0 <= metrics["eval/success_rate"] <= 1.0
    assert all(isinstance(v, float) for v in metrics.values())
    run_dir = summary["run_dir"]
    assert json.loads((Path(run_dir) / "args.json").read_text())["frame_stack"] == 4
    again = run_script("dqn_framestack", *TMAZE, "--eval-only", "--checkpoint", run_dir, runs_dir=runs_dir, timeout=120)
    assert again["run_dir"] != run_dir
    assert again["metrics"] == metrics  # same weights, same eval seed, greedy policy


def test_eval_only_restores_the_architecture_from_args_json(runs_dir, monkeypatch):
    """A --no-scale-obs, 2-frame, 32-unit model is evaluated as trained, without repeating those flags."""
    arch = [
        "--no-scale-obs",
        "--frame-stack",
        "2",
        "--hidden-size",
        "32",
        "--difference-scale",
        "10",
        "--eval-episodes",
        "4",
    ]
    summary = run_in_process(dqn, runs_dir, *arch, *TINY)
    again = eval_only(summary["run_dir"], runs_dir, episodes=4)
    restored = again["args"]
    assert (restored["scale_obs"], restored["frame_stack"], restored["hidden_size"]) == (False, 2, 32)
    assert restored["difference_scale"] == 10.0
    assert again["metrics"] == summary["metrics"]  # same inputs (unscaled), same weights, same eval seeds


def test_eval_only_of_a_run_saved_before_difference_scale_reads_the_raw_stack(runs_dir, monkeypatch):
    """args.json without `difference_scale` (runs saved before the field existed): the raw stack, not the default."""
    summary = run_in_process(dqn, runs_dir, "--difference-scale", "0", "--eval-episodes", "4", *TINY)
    args_file = Path(summary["run_dir"]) / "args.json"
    saved = json.loads(args_file.read_text())
    del saved["difference_scale"]
    args_file.write_text(json.dumps(saved))
    again = eval_only(summary["run_dir"], runs_dir, episodes=4)
    assert again["args"]["difference_scale"] == 0.0
    assert again["metrics"] == summary["metrics"]


def test_network_inputs_are_the_stack_and_its_scaled_differences_without_padding_pairs():
    """k = 3, D = 2: an episode's second step (one padding frame), then a full stack; differences times 50."""
    net = dqn.QNetwork(2, 3, 2, 8, 50.0)
    second_step = torch.tensor([[0.0, 0.0, 0.1, 0.2, 0.3, 0.1]])  # padding, o_0, o_1
    full = torch.tensor([[0.1, 0.2, 0.3, 0.1, 0.3, 0.4]])
    expected_second = [0.0, 0.0, 0.1, 0.2, 0.3, 0.1, 0.0, 0.0, 10.0, -5.0]  # the (padding, o_0) pair is zeroed
    expected_full = [0.1, 0.2, 0.3, 0.1, 0.3, 0.4, 10.0, -5.0, 0.0, 15.0]
    inputs = net.inputs(torch.cat([second_step, full]))
    assert torch.allclose(inputs, torch.tensor([expected_second, expected_full]), atol=1e-5)
    assert net.network[0].in_features == 10
    raw = dqn.QNetwork(2, 3, 2, 8, 0.0)  # 0: the raw stack (the DQN paper); k = 1 has no pairs at all
    assert torch.equal(raw.inputs(full), full) and dqn.QNetwork(2, 1, 2, 8, 50.0).network[0].in_features == 2


def test_keep_best_saves_and_reports_the_kept_network(runs_dir, monkeypatch):
    summary = run_in_process(dqn, runs_dir, *TMAZE, *TINY, "--select-frequency", "200", "--keep-best")
    metrics = summary["metrics"]
    assert metrics["select/best_global_step"] in (200.0, 400.0)  # evaluations at 200 and 400 env steps
    assert {"eval/last_network_episodic_return", "eval/last_network_success_rate"} <= set(metrics)
    again = eval_only(summary["run_dir"], runs_dir, episodes=8)
    assert again["metrics"]["eval/episodic_return"] == metrics["eval/episodic_return"]  # the kept one is saved
    if metrics["select/best_global_step"] == 400.0:  # the kept network is the last one: same evaluation
        assert metrics["eval/last_network_episodic_return"] == metrics["eval/episodic_return"]
        # the evaluation at 400 steps is the only one in the last 10% of the steps
        assert metrics["select/late_episodic_return"] == metrics["select/best_episodic_return"]
    else:
        assert metrics["select/late_episodic_return"] <= metrics["select/best_episodic_return"]


def test_select_seeds_disjoint_from_the_final_evaluation_and_across_seeds():
    """Evaluations during training of seed s use 1e9 + 1e7 s + global_step + i (global_step + i < 1e7 as the
    script enforces); the final evaluations of seeds up to 99 998 end before 1e9."""
    base, stride = dqn.SELECT_SEED_BASE, dqn.SELECT_SEED_STRIDE
    assert dqn.eval_env_seed(99_998) + dqn.EVAL_SEED_STRIDE <= base
    largest = stride // 2 + dqn.EVAL_SEED_STRIDE  # global_step < stride / 2, episodes <= EVAL_SEED_STRIDE
    assert base + stride * 3 + largest < base + stride * 4  # seed 3's block ends before seed 4's begins


def test_eval_seeds_disjoint_across_training_seeds():
    num_envs, episodes = 4, dqn.EVAL_SEED_STRIDE
    blocks = [set(range(dqn.eval_env_seed(s), dqn.eval_env_seed(s) + episodes)) for s in range(0, 120)]
    training = set(range(0, 120 + num_envs))  # the training envs are seeded seed + i
    assert sum(len(b) for b in blocks) == len(set().union(*blocks)) and not training & set().union(*blocks)


@pytest.mark.parametrize("env_id", spaces_env.MODULE_IDS)
def test_structured_observation_spaces_are_flattened(runs_dir, env_id):
    env, raw = dqn.make_env(env_id, {}, scale_obs=True)(), gym.make(env_id)
    obs, raw_obs = env.reset(seed=0)[0], raw.reset(seed=0)[0]
    for _ in range(3):  # one-hot codes and Box parts within [-1, 1]: scaling leaves them unchanged
        assert obs.dtype == np.float32
        np.testing.assert_allclose(obs, spaces_env.expected_flat(raw_obs), rtol=1e-6)
        obs, raw_obs = env.step(1)[0], raw.step(1)[0]
    summary = run_in_process(dqn, runs_dir, "--env-id", env_id, *TINY, "--eval-episodes", "2")
    assert 0.0 <= summary["metrics"]["eval/episodic_return"] <= spaces_env.EPISODE_LENGTH


def test_smoke_three_state_line_reports_failure_rate(runs_dir):
    args = ["--env-id", "seqrl/ThreeStateLine-v0", "--frame-stack", "1", *TINY, "--double-q"]
    summary = run_in_process(dqn, runs_dir, *args)
    metrics = summary["metrics"]
    assert metrics["eval/failure_rate"] == metrics["eval/timeout_rate"]
    assert -20.0 <= metrics["eval/episodic_return"] <= -1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env-id", "seqrl/NoSuchEnv-v0"], "cannot make env"),
        (["--env-id", "Pendulum-v1"], "only Discrete"),
        (["--env-id", "tests.spaces_env:SpacesText-v0"], "supported: Box, Discrete"),
        (["--env-id", "nosuchmodule:Foo-v0"], "cannot make env"),
        (["--eval-episodes", "10001"], "--eval-episodes"),
        (["--env-id", "seqrl/TMaze-v0", "--env-kwargs", "{corridor: 2}"], "Expecting property name"),
        (["--env-id", "seqrl/TMaze-v0", "--env-kwargs", '{"corridor_length": 0}'], "corridor_length"),
        (["--env-id", "seqrl/TMaze-v0", "--env-kwargs", '{"no_such_kwarg": 1}'], "cannot make env"),
        (["--frame-stack", "0"], "--frame-stack"),
        (["--n-step", "0"], "--n-step must be >= 1"),
        (["--gradient-steps", "0"], "--gradient-steps must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--difference-scale", "-1"], "--difference-scale must be"),
        (["--difference-scale", "nan"], "--difference-scale must be"),
        (["--keep-best"], "--keep-best needs --select-frequency"),
        (["--eval-only"], "needs --checkpoint"),
        (["--eval-only", "--checkpoint", "/nonexistent/run"], "cannot read checkpoint /nonexistent/run: No such file"),
    ],
)
def test_clear_errors(runs_dir, monkeypatch, args, message):
    """In-process: parse_args (main's first call; it makes the env once) stops with SystemExit("error: ..."), which
    Python prints as that one line on stderr, exit 1 (end to end: the mismatched checkpoint and the runs dir below)."""
    monkeypatch.setattr(sys, "argv", ["dqn_framestack.py", "--runs-dir", str(runs_dir), *args])
    with pytest.raises(SystemExit) as exc:
        dqn.parse_args()
    error = str(exc.value.code)
    assert error.startswith("error: ") and message in error and "\n" not in error, error
    assert not runs_dir.exists()  # before any run dir


def test_clear_error_on_mismatched_checkpoint(tmaze_run, runs_dir, tmp_path):
    bare = tmp_path / "model.safetensors"  # the weights alone (frame stack 4), without args.json: the flags decide
    bare.write_bytes((Path(tmaze_run["run_dir"]) / "model.safetensors").read_bytes())
    proc = run_script(
        "dqn_framestack",
        "--env-id",
        "seqrl/TMaze-v0",
        "--frame-stack",
        "2",
        "--eval-only",
        "--checkpoint",
        str(bare),
        runs_dir=runs_dir,
        expect_fail=True,
        timeout=60,
    )
    assert "does not fit --env-id seqrl/TMaze-v0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_tmaze_short_corridor_solved_with_a_stack_and_at_chance_without(runs_dir):
    """TMaze corridor 2: k = 4 still sees the cue at the junction (success ~1); k = 1 cannot (success ~1/2)."""
    common = [
        "--env-id",
        "seqrl/TMaze-v0",
        "--env-kwargs",
        '{"corridor_length": 2}',
        "--total-timesteps",
        "20000",
        "--learning-starts",
        "1000",
        "--eval-episodes",
        "200",
        *TMAZE_CLEANRL_LIKE,
    ]
    with_stack = run_script("dqn_framestack", *common, "--frame-stack", "4", runs_dir=runs_dir, timeout=300)
    assert with_stack["metrics"]["eval/success_rate"] >= 0.9
    memoryless = run_script("dqn_framestack", *common, "--frame-stack", "1", runs_dir=runs_dir, timeout=300)
    assert 0.35 <= memoryless["metrics"]["eval/success_rate"] <= 0.65  # a coin flip (200 episodes: sd 0.035)
    assert memoryless["metrics"]["eval/timeout_rate"] == 0.0  # it does reach the junction


def test_runs_dir_that_is_a_file_is_a_clear_error(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("not a directory")
    proc = run_script("dqn_framestack", runs_dir=afile, expect_fail=True)
    assert proc.stderr.strip() == f"error: --runs-dir {afile}: Not a directory"
