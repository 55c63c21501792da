"""R2D2 (algos/r2d2_rnnstate.py), issue 17: checkpoints (--save-every), --resume and Ctrl-C continue a run exactly.

A run killed (SIGKILL) or interrupted (SIGINT) after its first checkpoint and resumed ends with the same metrics,
bit for bit, as the same run uninterrupted; so does a run that writes checkpoints and one that writes none.
"""

import dataclasses
import json
import random
import signal
import subprocess
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import ROOT, load_script, run_script, script_command, start_script, subprocess_env

r2d2 = load_script("r2d2_rnnstate")

# 2400 env steps, 125 updates from step 400, target copies every 20 updates, evaluations at 800 / 1600 / 2400 with
# the kept network (--keep-best): every part of the checkpoint changes between its saves at 1000 and 2000 steps
TINY = [
    "--total-timesteps",
    "2400",
    "--learning-starts",
    "400",
    "--num-envs",
    "4",
    "--buffer-size",
    "2000",
    "--batch-size",
    "8",
    "--eval-episodes",
    "4",
    "--delta-q-frequency",
    "5",
    "--target-network-frequency",
    "20",
    "--select-frequency",
    "800",
    "--select-episodes",
    "2",
    "--keep-best",
    "--final-delta-q-sequences",
    "64",
    "--env-kwargs",
    '{"corridor_length": 3}',
]
SAVE_EVERY = ["--save-every", "1000"]
TIMEOUT = 180  # seconds for one subprocess run (a tiny run takes seconds)


def untimed(summary: dict) -> dict:
    """The metrics but the learner's wall time per update (the one metric that differs between two runs)."""
    return {key: value for key, value in summary["metrics"].items() if not key.startswith("perf/")}


def start_run(runs_dir, log_path) -> subprocess.Popen:
    return start_script("r2d2_rnnstate", log_path, "--runs-dir", str(runs_dir), *TINY, *SAVE_EVERY)


def wait_for_checkpoint(proc: subprocess.Popen, runs_dir):
    """The run dir once its first checkpoint is complete (latest.json written); the run must still be going."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        found = list(runs_dir.glob("*/checkpoints/latest.json"))
        if found:
            return found[0].parents[1]
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.01)
    proc.kill()
    pytest.fail("no checkpoint within the timeout")


def resume(run_dir, *args: str, expect_fail: bool = False):
    cmd = script_command("r2d2_rnnstate", "--resume", str(run_dir), *args)
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if expect_fail:
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr.strip()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resumed {run_dir}" in proc.stdout
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same tiny run without checkpoints and with checkpoints every 1000 steps: identical metrics (saving reads
    the RNG states, it never draws), and the checkpoints are gone once the run has finished."""
    runs_dir = tmp_path_factory.mktemp("uninterrupted")
    plain = run_script("r2d2_rnnstate", *TINY, "--save-every", "0", runs_dir=runs_dir / "off", timeout=TIMEOUT)
    saving = run_script("r2d2_rnnstate", *TINY, *SAVE_EVERY, runs_dir=runs_dir / "on", timeout=TIMEOUT)
    assert untimed(saving) == untimed(plain)
    assert not (runs_dir / "on" / saving["run_name"] / "checkpoints").exists()
    assert plain["metrics"]["select/best_global_step"] in (800.0, 1600.0, 2400.0)
    return plain


def test_sigkill_after_first_checkpoint_then_resume_matches_uninterrupted(uninterrupted, tmp_path):
    runs_dir = tmp_path / "runs"
    proc = start_run(runs_dir, tmp_path / "log.txt")
    run_dir = wait_for_checkpoint(proc, runs_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (run_dir / "summary.json").exists()
    summary = resume(run_dir)
    assert untimed(summary) == untimed(uninterrupted)  # bit-identical
    assert summary["run_dir"] == str(run_dir) and list(runs_dir.iterdir()) == [run_dir]  # the same run dir
    assert not (run_dir / "checkpoints").exists()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # tensorboard continued in the run dir


def test_sigint_truncated_checkpoint_and_a_kill_during_a_save(uninterrupted, tmp_path):
    runs_dir = tmp_path / "runs"
    proc = start_run(runs_dir, tmp_path / "log.txt")
    run_dir = wait_for_checkpoint(proc, runs_dir)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=TIMEOUT) == r2d2.STOP_EXIT_CODE
    last_line = (tmp_path / "log.txt").read_text().strip().splitlines()[-1]
    assert last_line.startswith("interrupted at global_step=") and f"--resume {run_dir}" in last_line
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["global_step"] >= 1000 and not (run_dir / "summary.json").exists()

    # arguments that change the algorithm are refused; a checkpoint truncated half-way is refused naming its file
    assert "--seed 2 differs from the run's 1" in resume(run_dir, "--seed", "2", expect_fail=True)
    replay = run_dir / "checkpoints" / latest["step_dir"] / "rb.npz"
    content = replay.read_bytes()
    replay.write_bytes(content[: len(content) // 2])
    message = resume(run_dir, expect_fail=True)
    assert "truncated" in message and str(replay) in message and len(message.splitlines()) == 1

    # a kill during the next save leaves its temporary dir, and latest.json names the previous, complete checkpoint
    replay.write_bytes(content)
    partial = run_dir / "checkpoints" / f".tmp_step_{latest['global_step'] + 4}"
    partial.mkdir()
    (partial / "rb.npz").write_bytes(content[:1000])
    summary = resume(run_dir)
    assert untimed(summary) == untimed(uninterrupted)  # bit-identical
    assert not (run_dir / "checkpoints").exists()


def test_resume_refuses_finished_foreign_and_missing_runs(uninterrupted, tmp_path):
    run_dir = uninterrupted["run_dir"]
    finished = resume(run_dir, expect_fail=True)
    assert finished == f"error: run {run_dir} has finished (summary.json exists); there is nothing to resume"

    def refusal(run_dir):
        with pytest.raises(SystemExit) as err:
            r2d2.resume_args(r2d2.Args(resume=str(run_dir)))
        return str(err.value)

    foreign = tmp_path / "foreign"  # an unfinished run of another script with the same checkpoint layout
    (foreign / "checkpoints" / "step_8").mkdir(parents=True)
    (foreign / "checkpoints" / "latest.json").write_text(json.dumps({"step_dir": "step_8", "global_step": 8}))
    (foreign / "checkpoints" / "step_8" / "state.json").write_text(json.dumps({"script": "ilql_per_token"}))
    assert refusal(foreign) == f"error: {foreign} is a run of ilql_per_token.py, not of r2d2_rnnstate.py"
    (foreign / "summary.json").write_text(json.dumps({"script": "ppo_recurrent"}))  # a finished one
    assert refusal(foreign) == f"error: {foreign} is a run of ppo_recurrent.py, not of r2d2_rnnstate.py"
    assert "has no checkpoint" in refusal(tmp_path)
    assert "no such run directory" in refusal(tmp_path / "nothing")
    (tmp_path / "runs_file").write_text("")
    proc = run_script("r2d2_rnnstate", *TINY, runs_dir=tmp_path / "runs_file", expect_fail=True, timeout=TIMEOUT)
    assert proc.stderr.strip() == f"error: --runs-dir {tmp_path / 'runs_file'} is a file, not a directory"


# ---------------------------------------------------------------- in-process: the checkpoint files
def train_state(seed: int) -> "r2d2.TrainState":
    """A small TrainState whose every field differs with `seed` (Adam's moments and the replay filled)."""
    torch.manual_seed(seed)
    rng, nets = np.random.default_rng(seed), (r2d2.RecurrentQNetwork(3, 2, 8), r2d2.RecurrentQNetwork(3, 2, 8))
    optimizer = torch.optim.Adam(nets[0].parameters(), lr=1e-3)
    sum(param.square().sum() for param in nets[0].parameters()).backward()
    optimizer.step()  # Adam's moments and step counter are not empty
    rb = r2d2.SequenceReplay(64, 2, 3, 8, 6, 2, 3, 3)
    for t in range(40 + seed):
        rb.add(
            rng.random((2, 3)),
            np.array([t % 9 == 0] * 2),
            np.array([t % 9 == 8] * 2),
            np.zeros(2, bool),
            rng.integers(2, size=2),
            rng.random(2),
            rng.random((2, 8)),
            rng.random((2, 8)),
            rng.integers(2, size=2),
            rng.random(2),
        )
    rb.update_priorities(np.arange(5), rng.random(5) + 2.0)
    vec_env = r2d2.make_next_step_vec_env("seqrl/TMaze-v0", {"corridor_length": 3}, 2)
    obs = rng.random((2, 3))
    flags = {"first": rng.random(2) < 0.5, "final": rng.random(2) < 0.5, "terminal": rng.random(2) < 0.5}
    loop = flags | {"prev_action": rng.integers(2, size=2), "prev_reward": rng.random(2).astype(np.float32)}
    h, c = torch.rand(2, 8), torch.rand(2, 8)
    loop |= {"ep_return": rng.random(2), "ep_length": rng.integers(9, size=2)}
    state = r2d2.TrainState(
        *nets,
        optimizer,
        rb,
        rng,
        vec_env,
        obs,
        h,
        c,
        ep_returns=rng.random(3).tolist(),
        ep_lengths=[seed, 4],
        delta_q_log=[(rng.random(), rng.random(), float("nan"))],
        num_updates_done=seed,
        learner_seconds=rng.random(),
        late_selects=[rng.random()],
        best_return=rng.random(),
        best_step=seed,
    )
    for key, value in loop.items():  # the loop fields a new TrainState starts fresh
        setattr(state, key, value)
    return state


def test_checkpoint_round_trip_is_exact_and_replaces_the_previous_one(tmp_path):
    """What save_training_checkpoint writes from a TrainState's fields, load_training_checkpoint restores bit for bit
    (networks, Adam, replay, loop arrays and lists, counters, the kept network, python / numpy / torch RNG states); a
    new checkpoint replaces the older one only once complete."""
    state, run_dir = train_state(0), tmp_path / "run"
    r2d2.save_training_checkpoint(run_dir, 32, state, {"step": 10})
    state.best_model = {k: v + 1 for k, v in state.q_network.state_dict().items()}
    step_dir = r2d2.save_training_checkpoint(run_dir, 40, state, {"step": 10})
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["latest.json", "step_40"]
    expected = (random.random(), np.random.random(), state.rng.random(), torch.rand(1))  # the draws after the save

    found_dir, found_state = r2d2.read_checkpoint_state(run_dir)
    assert found_dir == step_dir and found_state["step"] == 10 and found_state["global_step"] == 40
    fresh = train_state(1)
    r2d2.load_training_checkpoint(found_dir, found_state, fresh, "cpu")
    assert (random.random(), np.random.random(), fresh.rng.random(), torch.rand(1)) == expected
    state.rng.random()  # (the same draw as fresh.rng's above)
    for field in dataclasses.fields(state):
        saved, loaded = getattr(state, field.name), getattr(fresh, field.name)
        if isinstance(saved, np.random.Generator | gym.vector.VectorEnv):
            continue  # the generator: its draws above; the envs are replayed (restore_envs, tested below)
        if isinstance(saved, torch.optim.Optimizer):
            saved, loaded = saved.state_dict()["state"][0], loaded.state_dict()["state"][0]
        elif hasattr(saved, "state_dict"):
            saved, loaded = saved.state_dict(), loaded.state_dict()
        if isinstance(saved, dict):
            assert saved.keys() == loaded.keys(), field.name
            for key, value in saved.items():
                np.testing.assert_array_equal(np.asarray(loaded[key]), np.asarray(value), err_msg=field.name)
        else:
            np.testing.assert_array_equal(np.asarray(loaded), np.asarray(saved), err_msg=field.name)
    assert fresh.rb.t == state.rb.t and isinstance(fresh.rb.t, int)

    for name in ("optimizer.pt", "best_model.safetensors", "arrays.npz", "rb.npz"):  # truncated: refused, named
        content = (step_dir / name).read_bytes()
        (step_dir / name).write_bytes(content[: len(content) // 2])
        with pytest.raises(SystemExit, match=f"checkpoint file {step_dir / name} is truncated"):
            r2d2.read_checkpoint_state(run_dir)
        (step_dir / name).write_bytes(content)
    (step_dir / "state.json").write_text("{")
    with pytest.raises(SystemExit, match="state.json is corrupt"):
        r2d2.read_checkpoint_state(run_dir)


# ---------------------------------------------------------------- the envs are restored by replaying each episode
class GlobalRandomEnv(gym.Env):
    """Draws its start from numpy's global RNG instead of its own np_random: it cannot be restored by replay."""

    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.start, self.t = np.random.random(), 0
        return np.array([self.start], dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.start + self.t], dtype=np.float32), 0.0, self.t >= 3, False, {}


def drive(vec_env, obs, final, episodes, actions):
    """The script's loop around the envs: step, compute the next row's flags, record what the replay needs."""
    for action in actions:
        obs, reward, term, trunc, _ = vec_env.step(action)
        first, final, _ = r2d2.next_row_flags(final, term, trunc)
        r2d2.track_episodes(episodes, vec_env, first, final, action)
    return obs, final


def no_episodes(num_envs: int) -> dict:
    return {
        "reset_rng": [None] * num_envs,
        "next_reset_rng": [None] * num_envs,
        "actions": [[] for _ in range(num_envs)],
    }


@pytest.mark.parametrize(
    "env_id, env_kwargs",
    [
        ("seqrl/TMaze-v0", {"corridor_length": 3}),
        ("seqrl/Tiger-v0", {}),
        ("seqrl/TwoDoors-v0", {}),
        ("seqrl/MaskedCartPole-v0", {}),
    ],
)
def test_restored_envs_continue_exactly(env_id, env_kwargs):
    """Envs restored from a JSON round trip of the recorded episodes (mid-episode, just ended, still in the first
    episode) give the same observations, rewards and flags as the originals under the same future actions."""
    E, seed, rng = 4, 3, np.random.default_rng(0)
    vec_env = r2d2.make_next_step_vec_env(env_id, env_kwargs, E)
    num_actions = int(vec_env.single_action_space.n)
    obs, _ = vec_env.reset(seed=seed)
    final, episodes = np.zeros(E, dtype=bool), no_episodes(E)
    obs, final = drive(vec_env, obs, final, episodes, rng.integers(num_actions, size=(60, E)))
    while not final.any():  # stop where an episode has just ended: it must reset on the next step
        obs, final = drive(vec_env, obs, final, episodes, rng.integers(num_actions, size=(1, E)))
    restored = r2d2.make_next_step_vec_env(env_id, env_kwargs, E)
    r2d2.restore_envs(restored, seed, obs, final, json.loads(json.dumps(episodes)))
    assert any(state is not None for state in episodes["reset_rng"])
    for action in rng.integers(num_actions, size=(200, E)):
        for got, expected in zip(restored.step(action)[:4], vec_env.step(action)[:4], strict=True):
            np.testing.assert_array_equal(got, expected)


def test_restore_refuses_an_env_with_randomness_outside_np_random():
    vec_env = gym.vector.SyncVectorEnv([GlobalRandomEnv] * 2)
    obs, _ = vec_env.reset(seed=0)
    final, episodes = np.zeros(2, dtype=bool), no_episodes(2)
    obs, final = drive(vec_env, obs, final, episodes, np.zeros((5, 2), dtype=np.int64))  # a second episode begun
    with pytest.raises(SystemExit, match="cannot restore env 0"):
        r2d2.restore_envs(gym.vector.SyncVectorEnv([GlobalRandomEnv] * 2), 0, obs, final, episodes)
