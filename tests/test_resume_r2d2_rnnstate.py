"""R2D2 (algos/r2d2_rnnstate.py): checkpoints (--save-every), --resume and Ctrl-C. A resumed run continues from the
checkpoint's networks, Adam, replay and RNG states and begins new episodes (as SB3 and RLlib do): right after the
restore they equal the checkpoint's, the episodes in progress end in the replay as truncations, and a run killed or
stopped after a checkpoint finishes its steps with the metrics of an uninterrupted run (the same keys)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, load_script, scalar_steps, script_command, start_script, subprocess_env
from safetensors.torch import save_file

r2d2 = load_script("r2d2_rnnstate")

# 2400 env steps, 125 updates from step 400, target copies every 20 updates, evaluations at 800 / 1600 / 2400 with
# the kept network (--keep-best): every part of the checkpoint changes between its saves at 1000 and 2000 steps
TINY = [
    *("--total-timesteps", "2400", "--learning-starts", "400", "--num-envs", "4", "--buffer-size", "2000"),
    *("--batch-size", "8", "--eval-episodes", "4", "--delta-q-frequency", "5", "--target-network-frequency", "20"),
    *("--select-frequency", "800", "--select-episodes", "2", "--keep-best", "--final-delta-q-sequences", "64"),
    *("--env-kwargs", '{"corridor_length": 3}'),
]
TIMEOUT = 180  # seconds for one subprocess run (a tiny run takes seconds)


def start_run(runs_dir, log_path) -> subprocess.Popen:
    return start_script("r2d2_rnnstate", log_path, "--runs-dir", str(runs_dir), *TINY, "--save-every", "1000")


def wait_for_checkpoint(proc: subprocess.Popen, runs_dir):
    """The run dir once its first checkpoint is complete (renamed into place); the run must still be going."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        found = list(runs_dir.glob(f"*/{r2d2.TRAIN_STATE}"))
        if found:
            return found[0].parent
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
    assert f"resumed {run_dir} at global_step=" in proc.stdout
    return json.loads((run_dir / "summary.json").read_text())


def assert_finished_like(summary: dict, uninterrupted: dict, run_dir) -> None:
    """The resumed run finished in its own dir: the uninterrupted run's metric keys, its final evaluation at the last
    step, tensorboard continued there, the checkpoint gone."""
    assert summary["metrics"].keys() == uninterrupted["metrics"].keys()
    assert all(np.isfinite(value) for value in summary["metrics"].values())
    assert summary["run_dir"] == str(run_dir)
    same = [key for key in uninterrupted["args"] if key not in r2d2.RESUME_FREE_FIELDS]  # the run's own arguments
    assert [summary["args"][key] for key in same] == [uninterrupted["args"][key] for key in same]
    assert scalar_steps(run_dir, "eval/episodic_return") == [2400]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    assert sorted(path.name for path in run_dir.glob("*.safetensors")) == ["model.safetensors"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The tiny run without checkpoints (what benchmark.sh's fingerprint runs): nothing of a checkpoint left."""
    runs_dir = tmp_path_factory.mktemp("uninterrupted")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:  # in-process: its command line and signals are not under test here
        patch.setattr(sys, "argv", ["r2d2_rnnstate.py", "--runs-dir", str(runs_dir), *TINY, "--save-every", "0"])
        try:
            r2d2.main()
        finally:
            torch.set_num_threads(threads)  # main sets it
    assert not list(runs_dir.glob("*/*train_state*"))
    (summary,) = runs_dir.glob("*/summary.json")
    return json.loads(summary.read_text())


def test_sigkill_after_a_checkpoint_then_resume_finishes_the_run(uninterrupted, tmp_path):
    runs_dir = tmp_path / "runs"
    proc = start_run(runs_dir, tmp_path / "log.txt")
    run_dir = wait_for_checkpoint(proc, runs_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (run_dir / "summary.json").exists()
    assert_finished_like(resume(run_dir), uninterrupted, run_dir)
    assert list(runs_dir.iterdir()) == [run_dir]


def test_sigint_checkpoints_and_exits_and_resume_refuses_what_it_cannot_continue(uninterrupted, tmp_path):
    runs_dir = tmp_path / "runs"
    proc = start_run(runs_dir, tmp_path / "log.txt")
    run_dir = wait_for_checkpoint(proc, runs_dir)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=TIMEOUT) == r2d2.STOP_EXIT_CODE
    last_line = (tmp_path / "log.txt").read_text().strip().splitlines()[-1]
    assert last_line.startswith("stopped at step ") and f"--resume {run_dir}" in last_line
    assert r2d2.read_train_state(run_dir)["global_step"] >= 1000 and not (run_dir / "summary.json").exists()

    # one-line errors: a changed algorithm flag, a finished run, another script's run, a dir without a checkpoint
    assert resume(run_dir, "--seed", "2", expect_fail=True) == (
        "error: --seed 2 differs from the run's 1; --resume continues a run with its own arguments"
    )

    def refusal(run_dir):
        with pytest.raises(SystemExit) as err:
            r2d2.resume_args(r2d2.Args(resume=str(run_dir)))
        assert len(str(err.value).splitlines()) == 1
        return str(err.value)

    finished = uninterrupted["run_dir"]
    assert refusal(finished) == f"error: run {finished} has finished (summary.json exists); there is nothing to resume"
    (tmp_path / "foreign").mkdir()
    save_file(
        {"x": torch.zeros(1)}, str(tmp_path / "foreign" / r2d2.TRAIN_STATE), {"script": "ilql_per_token", "state": "{}"}
    )
    assert (
        refusal(tmp_path / "foreign")
        == f"error: {tmp_path / 'foreign'} is a run of ilql_per_token.py, not of r2d2_rnnstate.py"
    )
    assert refusal(tmp_path / "nothing").startswith(f"error: cannot read checkpoint {tmp_path / 'nothing'}/")

    # a kill during the next save left its temporary file: the checkpoint before it is resumed
    (run_dir / f".tmp_{r2d2.TRAIN_STATE}").write_bytes(b"half a file")
    assert_finished_like(resume(run_dir), uninterrupted, run_dir)


# ---------------------------------------------------------------- in-process: the checkpoint and the replay
def train_state(seed: int) -> "r2d2.TrainState":
    """A small TrainState whose every field differs with `seed` (Adam's moments and the replay filled)."""
    torch.manual_seed(seed)
    rng, nets = np.random.default_rng(seed), (r2d2.RecurrentQNetwork(3, 2, 8), r2d2.RecurrentQNetwork(3, 2, 8))
    optimizer = torch.optim.Adam(nets[0].parameters(), lr=1e-3)
    sum(param.square().sum() for param in nets[0].parameters()).backward()
    optimizer.step()  # Adam's moments and step counter are not empty
    rb = r2d2.SequenceReplay(64, 2, 3, 8, 6, 2, 3, 3)
    for t in range(40 + seed):
        flags = np.array([t % 9 == 0] * 2), np.array([t % 9 == 8] * 2), np.zeros(2, bool)
        rb.add(
            rng.random((2, 3)), *flags, rng.integers(2, size=2), rng.random(2), *rng.random((2, 2, 8)), [0, 1], [1, 0]
        )
    rb.update_priorities(np.arange(5), rng.random(5) + 2.0)
    vec_env = r2d2.make_next_step_vec_env("seqrl/TMaze-v0", {"corridor_length": 3}, 2)
    state = r2d2.TrainState(*nets, optimizer, rb, rng, vec_env, rng.random((2, 3), np.float32), *torch.rand(2, 2, 8))
    state.first, state.final, state.terminal = np.array([False, True]), np.array([True, False]), np.array([True, False])
    state.prev_action, state.prev_reward = rng.integers(2, size=2), rng.random(2).astype(np.float32)
    state.ep_return, state.ep_length = rng.random(2), rng.integers(9, size=2)
    state.ep_returns, state.ep_lengths, state.late_selects = rng.random(3).tolist(), [seed, 4], [rng.random()]
    state.delta_q_log, state.num_updates_done, state.learner_seconds = [(rng.random(), 0.5, np.nan)], seed, 0.25
    state.best_return, state.best_step, state.best_model = rng.random(), seed, {"w": torch.rand(3) + seed}
    return state


def test_restore_equals_the_checkpoint_then_begins_new_episodes(tmp_path):
    """Right after --resume: networks, Adam, the replay (plus the row that ends each episode in progress), counters,
    the curve, the kept network and every RNG (python, numpy, torch, the loop's generator) are the checkpoint's; the
    envs are reset with a seed drawn from the run's seed and the step, every env at the first row of an episode."""
    args = r2d2.Args(runs_dir=str(tmp_path), num_envs=2, hidden_size=8, env_kwargs='{"corridor_length": 3}')
    state, run = train_state(0), r2d2.Run(args)
    run.end_step(args.save_every, state)  # a multiple of --save-every: a checkpoint
    run.end_training()
    expected = (random.random(), np.random.random(), state.rng.random(), torch.rand(1))  # the draws after the save
    pending = {key: np.array(value) for key, value in state.row().items()} | {"h": state.h.numpy().copy()}
    r2d2.close_episodes(state)  # what restore does to the checkpoint's replay

    fresh = train_state(1)
    resumed = r2d2.Run(r2d2.resume_args(r2d2.Args(resume=str(run.run_dir)))[0])
    assert resumed.restore(fresh) == args.save_every and resumed.run_dir == run.run_dir
    resumed.end_training()
    assert (random.random(), np.random.random(), fresh.rng.random(), torch.rand(1)) == expected
    for name in ("q_network", "target_network", "rb"):
        saved, loaded = getattr(state, name).state_dict(), getattr(fresh, name).state_dict()
        assert saved.keys() == loaded.keys()
        for key, value in saved.items():
            np.testing.assert_array_equal(np.asarray(loaded[key]), np.asarray(value), err_msg=f"{name}.{key}")
    saved, loaded = state.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert json.dumps(saved["param_groups"]) == json.dumps(loaded["param_groups"])  # (its tuples come back as lists)
    for key, value in saved["state"][0].items():
        assert torch.equal(loaded["state"][0][key], value), key
    for name in ("ep_returns", "ep_lengths", "late_selects", "num_updates_done", "learner_seconds", "best_return"):
        assert getattr(fresh, name) == getattr(state, name), name
    assert fresh.delta_q_log[0][:2] == list(state.delta_q_log[0][:2]) and fresh.best_step == state.best_step
    assert torch.equal(fresh.best_model["w"], state.best_model["w"])

    row = (state.rb.t - 1) % state.rb.cap  # the row that ends each env's episode: the one it was at, now final
    np.testing.assert_array_equal(fresh.rb.obs[row], pending["obs"])
    np.testing.assert_array_equal(fresh.rb.first[row], pending["first"])
    np.testing.assert_array_equal(fresh.rb.final[row], [True, True])
    np.testing.assert_array_equal(fresh.rb.terminal[row], pending["terminal"])  # ended: as it ended; else truncated
    np.testing.assert_array_equal(fresh.rb.h[row], pending["h"] * ~pending["first"][:, None])

    seed = int(np.random.SeedSequence([args.seed, args.save_every]).generate_state(1)[0])
    new_obs = r2d2.make_next_step_vec_env("seqrl/TMaze-v0", {"corridor_length": 3}, 2).reset(seed=seed)[0]
    np.testing.assert_array_equal(fresh.obs, new_obs)
    assert fresh.first.all() and not fresh.final.any() and (fresh.prev_action == r2d2.NO_ACTION).all()
    assert not fresh.h.any() and not fresh.c.any() and not fresh.ep_return.any() and not fresh.ep_length.any()


def test_an_episode_cut_by_resume_ends_as_a_truncation_and_no_sequence_crosses_into_the_next():
    """Env 0 is 7 rows into an episode, env 1 at the reset row after an episode's end when the checkpoint is written.
    Closing makes env 0's row 7 final (not terminal): the episode's last anchors (2, 4, 6) are registered, the target
    of anchor 6 bootstraps from row 7, and every trained row of every sequence lies in the sequence's own episode."""
    m, overlap, burn_in, n, gamma = 4, 2, 1, 2, 0.5
    rb = r2d2.SequenceReplay(64, 2, 1, 2, m, overlap, burn_in, n)
    for t in range(7):  # env 0: one episode from row 0 on; env 1: an episode of rows 0..6, row 6 final
        first, final = np.array([t == 0, t == 0]), np.array([False, t == 6])
        rb.add(
            np.full((2, 1), t), first, final, np.zeros(2, bool), [0, 0], [0, 0], *np.zeros((2, 2, 2)), [1, 1], [t, 0]
        )
    state = r2d2.TrainState(None, None, None, rb, None, None, np.full((2, 1), 7.0), *torch.ones(2, 2, 2))
    state.first = np.array([False, True])
    state.prev_action, state.prev_reward = np.array([1, 1]), np.array([6.0, 0.0], dtype=np.float32)
    r2d2.close_episodes(state)
    for t in range(8, 20):  # the new episodes
        rb.add(
            np.full((2, 1), t),
            np.full(2, t == 8),
            np.zeros(2, bool),
            np.zeros(2, bool),
            [1, 1],
            [0, 0],
            *np.zeros((2, 2, 2)),
            [1, 1],
            [t, t],
        )

    ids = np.nonzero(rb.priority > 0)[0]
    anchors = {(int(rb.seq_env[i]), int(rb.seq_anchor[i])) for i in ids}
    assert {(0, 0), (0, 2), (0, 4), (0, 6)} <= anchors and (1, 7) not in anchors  # env 1's row 7: no action taken
    win = r2d2.to_torch(rb.gather(ids), "cpu")
    final = win["final"][burn_in:].float()
    mask = torch.cumprod(1.0 - final[:m], dim=0)  # (m, B) the trained rows
    rows = torch.as_tensor(rb.seq_anchor[ids])[None] + torch.arange(m)[:, None]  # (m, B) absolute rows
    episode_start = torch.as_tensor(rb.seq_ep_start[ids])[None]
    next_start = torch.where(episode_start < 8, 8, 10**9)  # env 0's second episode begins at row 8 (env 1's too)
    assert ((rows >= episode_start) & (rows < next_start) | (mask == 0)).all()

    six = [i for i in range(len(ids)) if rb.seq_env[ids[i]] == 0 and rb.seq_anchor[ids[i]] == 6][0]
    boot = torch.arange(m + n, dtype=torch.float32)[:, None].expand(-1, len(ids)) + 100.0
    targets = r2d2.nstep_rescaled_targets(
        win["reward"][burn_in:], final, win["terminal"][burn_in:].float(), boot, gamma, n, m, 0.0
    )
    truncated = r2d2.value_rescale(torch.tensor(6.0 + gamma * 101.0), 0.0)  # r_6, then gamma h^-1(Q^-) of row 7
    assert targets[0, six].item() == pytest.approx(truncated.item())
    assert mask[:, six].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """save_train_state writes a temporary file and renames it: a kill during the write leaves the checkpoint before."""
    r2d2.save_train_state(tmp_path, {"global_step": 8, "weights": torch.arange(4.0)})

    def killed(tensors, path, metadata):  # half of the file written, then the process is gone
        save_file(tensors, path, metadata)
        os.truncate(path, os.path.getsize(path) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(r2d2, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        r2d2.save_train_state(tmp_path, {"global_step": 16, "weights": torch.zeros(4)})
    monkeypatch.undo()
    saved = r2d2.read_train_state(tmp_path)
    assert saved["global_step"] == 8 and torch.equal(saved["weights"], torch.arange(4.0))
