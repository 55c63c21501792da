"""R2D2 with a Transformer-XL memory (algos/r2d2_trxl_memory.py): --resume continues from the checkpoint's networks,
Adam, replay and RNG states with new episodes (an empty memory, or window of rows, per env): right after the restore
they equal the checkpoint's, and a run killed after its first checkpoint finishes with an uninterrupted run's metrics
(the same keys)."""

import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, load_script, scalar_steps, script_command, start_script, subprocess_env

trxl = load_script("r2d2_trxl_memory")

# 1600 env steps, updates from step 400 (target copies every 20), the first checkpoint at 800 (--save-every 800)
TINY = [
    *("--total-timesteps", "1600", "--learning-starts", "400", "--num-envs", "4", "--buffer-size", "2000"),
    *("--batch-size", "8", "--eval-episodes", "4", "--target-network-frequency", "20", "--d-model", "16"),
    *("--memory-length", "6", "--window", "15", "--final-delta-q-sequences", "64"),
    *("--env-kwargs", '{"corridor_length": 3}'),
]
TIMEOUT = 180  # seconds for one subprocess run (a tiny run takes seconds)


@pytest.mark.parametrize("memory", ["stored", "window"])  # the actor carries a memory, or a window of rows
def test_sigkill_after_first_checkpoint_then_resume_finishes_the_run(tmp_path, monkeypatch, memory):
    args = [*TINY, "--memory", memory]
    # the uninterrupted run (its metric keys) in-process: its command line and signals are not under test here
    plain_args = ["--runs-dir", str(tmp_path / "plain"), *args, "--save-every", "0"]
    monkeypatch.setattr(sys, "argv", ["r2d2_trxl_memory.py", *plain_args])
    threads = torch.get_num_threads()
    try:
        trxl.main()
    finally:
        torch.set_num_threads(threads)  # main sets it
    (plain_summary,) = (tmp_path / "plain").glob("*/summary.json")
    plain = json.loads(plain_summary.read_text())
    runs_dir = tmp_path / "runs"
    proc = start_script(
        "r2d2_trxl_memory", tmp_path / "log.txt", "--runs-dir", str(runs_dir), *args, "--save-every", "800"
    )
    deadline = time.time() + TIMEOUT
    while not list(runs_dir.glob(f"*/{trxl.TRAIN_STATE}")):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    run_dir = next(runs_dir.iterdir())
    assert not (run_dir / "summary.json").exists()
    cmd = script_command("r2d2_trxl_memory", "--resume", str(run_dir))
    done = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0 and f"resumed {run_dir} at global_step=" in done.stdout, done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"].keys() == plain["metrics"].keys() and summary["args"]["memory"] == memory
    assert scalar_steps(run_dir, "eval/episodic_return") == [1600]  # the resumed run finished its steps
    assert sorted(path.name for path in run_dir.glob("*.safetensors")) == ["model.safetensors"]  # checkpoint gone


@pytest.mark.parametrize("memory", ["stored", "window", "episode"])
def test_restore_equals_the_checkpoint_then_begins_new_episodes(tmp_path, memory):
    """Right after --resume: networks, Adam, the replay (plus the row that ends each episode in progress: final, with
    a zero memory entry), counters, the curve and every RNG are the checkpoint's; the actor starts from an empty memory
    (window of rows) at the first row of a new episode in every env."""
    args = trxl.Args(runs_dir=str(tmp_path), num_envs=2, d_model=16, memory_length=6, window=15, memory=memory)
    args.env_kwargs = '{"corridor_length": 3}'

    def train_state(seed: int) -> "trxl.TrainState":
        torch.manual_seed(seed)
        rng, nets = np.random.default_rng(seed), (trxl.build_network(args, 3, 2), trxl.build_network(args, 3, 2))
        optimizer = torch.optim.Adam(nets[0].parameters(), lr=1e-3)
        sum(param.square().sum() for param in nets[0].parameters()).backward()
        optimizer.step()
        layers = 2 if trxl.MEMORY_MODES[memory].stores_memory else 0
        rb = trxl.MemoryReplay(64, 2, 3, layers, 16, 4, 2, trxl.replay_lead(args), 2)
        for t in range(40 + seed):
            row = {"obs": rng.random((2, 3)), "first": np.full(2, t % 9 == 0), "final": np.full(2, t % 9 == 8)}
            row |= {"terminal": np.zeros(2, bool), "prev_action": [0, 1], "prev_reward": rng.random(2)}
            rb.add(**row, layer_inputs=rng.random((2, 2, 16)), action=[1, 0], reward=rng.random(2))
        rb.update_priorities(np.arange(5), rng.random(5) + 2.0)
        vec_env = trxl.make_next_step_vec_env("seqrl/TMaze-v0", {"corridor_length": 3}, 2)
        context = trxl.initial_context(nets[0], memory, args.window, 2, "cpu")
        context = {
            key: torch.rand(value.shape) < 0.5 if value.dtype == torch.bool else value + seed
            for key, value in context.items()
        }
        state = trxl.TrainState(*nets, optimizer, rb, rng, vec_env, rng.random((2, 3), np.float32), context)
        state.first, state.final, state.terminal = (
            np.array([False, True]),
            np.array([True, False]),
            np.array([True, False]),
        )
        state.ep_returns, state.ep_lengths, state.num_updates_done = rng.random(3).tolist(), [seed, 4], seed
        return state

    state, run = train_state(0), trxl.Run(args)
    run.end_step(args.save_every, state)  # a multiple of --save-every: a checkpoint
    run.end_training()
    expected = (random.random(), np.random.random(), state.rng.random(), torch.rand(1))  # the draws after the save
    first, terminal = state.first.copy(), state.terminal.copy()
    trxl.close_episodes(state)  # what restore does to the checkpoint's replay

    fresh = train_state(1)
    resumed = trxl.Run(trxl.resume_args(trxl.Args(resume=str(run.run_dir)))[0])
    assert resumed.restore(fresh) == args.save_every
    resumed.end_training()
    assert (random.random(), np.random.random(), fresh.rng.random(), torch.rand(1)) == expected
    for name in ("q_network", "target_network", "rb"):
        saved, loaded = getattr(state, name).state_dict(), getattr(fresh, name).state_dict()
        assert saved.keys() == loaded.keys()
        for key, value in saved.items():
            np.testing.assert_array_equal(np.asarray(loaded[key]), np.asarray(value), err_msg=f"{name}.{key}")
    for key, value in state.optimizer.state_dict()["state"][0].items():
        assert torch.equal(fresh.optimizer.state_dict()["state"][0][key], value), key
    assert (fresh.ep_returns, fresh.ep_lengths, fresh.num_updates_done) == (state.ep_returns, [0, 4], 0)
    row = (state.rb.t - 1) % state.rb.cap  # the row that ends each env's episode
    assert (
        fresh.rb.final[row].all()
        and (fresh.rb.first[row] == first).all()
        and (fresh.rb.terminal[row] == terminal).all()
    )
    assert not fresh.rb.layer_inputs[row].any()
    empty = trxl.initial_context(fresh.q_network, memory, args.window, 2, "cpu")
    assert fresh.context.keys() == empty.keys() and all(torch.equal(fresh.context[k], v) for k, v in empty.items())
    assert fresh.first.all() and not fresh.final.any() and (fresh.prev_action == trxl.NO_ACTION).all()
