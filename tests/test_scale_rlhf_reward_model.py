"""Issue 16 (data-parallel under torchrun) and issue 17 (checkpoints, --resume, Ctrl-C) for rlhf_reward_model.py.

Distributed tests run on CPU with gloo and 2 processes (no GPU needed): an in-process world of 2 started with
torch.multiprocessing (the gradient and checkpoint test, through the script's own Run: DDP, its share of a minibatch,
the ranks' RNG states in rank 0's checkpoint) and `python3 -m torch.distributed.run` subprocesses (the end-to-end runs).
"""

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from conftest import (
    ROOT,
    gloo_threads,
    load_script,
    parse_error,
    run_in_process,
    run_script,
    scalar_steps,
    subprocess_env,
)
from safetensors.torch import safe_open, save_file

from envs import preference

rm = load_script("rlhf_reward_model")
SCRIPT = str(ROOT / "algos" / "rlhf_reward_model.py")
# Gradients of the same minibatch summed in another order (per rank, then across ranks) in float32: they agree to
# ~1e-7 relative; 1e-5 relative (1e-7 absolute, for entries near zero) leaves room for other CPUs' kernels.
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-7}
# A run big enough that 1 vs 2 ranks is a comparison of learned models: 256 ranked prompts, global batch 32.
DP_ARGS = tuple(
    "--n-train-prompts 256 --epochs 2 --batch-size 32 --sft-epochs 1 --sft-examples 128 "
    "--sft-batch-size 32 --eval-episodes 64 --n-norm-samples 64 --n-center-samples 8 --seed 3 --save-every 10".split()
)
ACC_TOL = 0.02  # |held-out accuracy 2 ranks - 1 rank| over 64 x 6 = 384 held-out pairs (~8 pairs); see the test
# Checkpointed every 2 updates: per member of the default ensemble of two, 80 SFT updates, then 36 reward-model
# updates (member 1 from update 116), so the first checkpoint (update 2), the first reward-phase one (update 82) and
# member 1's first (update 118) come long before the end: the signals land in the middle of the run.
RESUME_ARGS = tuple(
    "--n-train-prompts 96 --epochs 6 --batch-size 16 --sft-epochs 10 --sft-examples 128 "
    "--sft-batch-size 16 --eval-episodes 16 --n-norm-samples 64 --n-center-samples 8 --save-every 2 "
    "--seed 2".split()
)
TIMEOUT = 300  # seconds for any subprocess


# ------------------------------------------------------------------------------------------------------------
# issue 16 (a): DDP's summed gradient of a split global minibatch is the one-process gradient; each rank's RNGs
# go into rank 0's checkpoint and come back to that rank
# ------------------------------------------------------------------------------------------------------------
def start_run(runs_dir: Path, **fields):
    """The script's Run (one process, or this rank of the process group the environment describes)."""
    return rm.start_run(rm.Args(runs_dir=str(runs_dir), **fields))


def minibatch_gradients(kind: str, run) -> dict:
    """Gradients (summed by DDP when run.world_size > 1, through the script's gradient_step at learning rate 0)
    and the global loss of one fixed minibatch of 7 examples (split 4 + 3 over 2 ranks, so the weighting of unequal
    shares is tested too)."""
    args = rm.Args()
    torch.manual_seed(0)
    lm, tok = rm.build_lm(args, "cpu")
    mb = torch.tensor([5, 0, 3, 8, 1, 2, 6])  # 7 of 9 examples, in a shuffled order
    part = run.shard(mb)  # this rank's share, weighted at the call site
    if kind == "sft":  # token-mean causal-LM loss over demonstrations of different lengths
        demos = preference.make_sft_dataset(9, seed=4)
        enc = rm.encode(tok, [d[0] for d in demos], [d[1] for d in demos])
        ids, mask = enc["input_ids"], enc["attention_mask"]
        width = int(mask[mb].sum(-1).max())
        model = lm
        n_targets = float(mask[mb, 1:width].sum().clamp(min=1))
        loss = run.data_parallel(rm.sft_minibatch_loss, lm)(ids[part, :width], mask[part, :width], n_targets)
    else:  # K-wise reward loss over rankings
        data = preference.make_preference_dataset(9, args.k, 4, 1.0, 0.0, split="train")
        enc = rm.encode(
            tok,
            [d["prompt"] for d in data for _ in range(args.k)],
            [d["completions"][j] for d in data for j in d["ranking"]],
        )
        ids, mask = (enc[key].view(len(data), args.k, -1) for key in ("input_ids", "attention_mask"))  # (N, K, L)
        width = int(mask[mb].sum(-1).max())
        model = rm.reward_model_from(lm, tok, "cpu")
        minibatch_loss = run.data_parallel(rm.reward_minibatch_loss, model)
        loss, _ = minibatch_loss(ids[part, :, :width], mask[part, :, :width], args)
        loss = loss * (len(part) / len(mb))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=0.0
    )  # the step leaves the weights and the gradients as they are
    state = rm.TrainState(kind, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    rm.gradient_step(state, loss, run, max_grad_norm=1e9)
    global_loss = run.global_sum(torch.tensor([loss.item()], dtype=torch.float64)).item()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"grads": grads, "loss": torch.tensor(global_loss), "state": state}


def checkpointed_rngs(run, state) -> dict:
    """Each rank draws from its own RNG: end_step saves all in rank 0's checkpoint; restore gives each rank its own."""
    torch.manual_seed(100 + run.rank)
    mine = torch.get_rng_state()
    run.args.save_every = 1
    run.end_step(1, state)
    saved = rm.read_train_state(run.run_dir)
    run.checkpoint = saved
    torch.manual_seed(999)
    run.restore(state)
    return {
        "ranks_saved": len(saved["rng"]),
        "saved_is_mine": torch.equal(saved["rng"][run.rank]["torch"], mine),
        "restored_is_mine": torch.equal(torch.get_rng_state(), mine),
    }


def gradient_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run = start_run(Path(out_dir) / "runs")  # init_torchrun joins the group from the environment, as under torchrun
    result = {kind: minibatch_gradients(kind, run) for kind in ("sft", "reward")}
    result["rng"] = checkpointed_rngs(run, result["reward"]["state"])
    for kind in ("sft", "reward"):
        del result[kind]["state"]
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    with pytest.raises(SystemExit) if rank else contextlib.nullcontext():
        run.end_training()  # tears the group down; ranks other than 0 leave
    left = gloo_threads()
    assert not left, f"rank {rank}: the process group outlived destroy_process_group ({left} still run)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gradient_of_split_minibatch_equals_one_process_gradient_and_each_rank_gets_its_rng_back(tmp_path):
    ctx = mp.start_processes(
        gradient_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.time() + TIMEOUT
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the 2-process gradient test did not finish in time")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    run = start_run(tmp_path / "one")  # one process, the whole minibatch
    try:
        for kind in ("sft", "reward"):
            whole = minibatch_gradients(kind, run)
            assert len(whole["grads"]) > 10
            for name, grad in whole["grads"].items():
                assert grad.abs().sum() > 0, f"{kind} {name}: no gradient"
                torch.testing.assert_close(ranks[0][kind]["grads"][name], grad, **GRAD_TOL, msg=f"{kind} {name}")
                assert torch.equal(ranks[0][kind]["grads"][name], ranks[1][kind]["grads"][name])  # identical steps
            torch.testing.assert_close(ranks[0][kind]["loss"], whole["loss"], rtol=1e-6, atol=0.0)
    finally:
        rm.restore_signal_handlers(run.stop)
    for r in range(2):
        assert ranks[r]["rng"] == {"ranks_saved": 2, "saved_is_mine": True, "restored_is_mine": True}


def test_shard_is_contiguous_and_covers_the_minibatch():
    mb = torch.arange(10, 18)

    def shard(items, world_size, rank):
        return rm.Run.shard(SimpleNamespace(rank=rank, world_size=world_size), items)

    assert shard(mb, 1, 0) is mb
    assert [shard(mb, 2, r).tolist() for r in range(2)] == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert [len(shard(mb[:7], 2, r)) for r in range(2)] == [4, 3]  # a short last minibatch: as even as it goes


# ------------------------------------------------------------------------------------------------------------
# issue 16 (b), (c): end to end under torchrun; 2 ranks reach 1 rank's held-out accuracy
# ------------------------------------------------------------------------------------------------------------
def torchrun(runs_dir: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, SCRIPT, "--runs-dir", str(runs_dir), *args]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory):
    """The same run (global batch, seed) in one process and under torchrun with 2 processes."""
    runs = tmp_path_factory.mktemp("dp")
    one = run_in_process(rm, runs / "one", *DP_ARGS)
    proc = torchrun(runs / "two", *DP_ARGS)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return one, proc, runs / "two"


def test_torchrun_two_processes_writes_exactly_one_run_dir(one_and_two_ranks):
    _, proc, runs = one_and_two_ranks
    run_dirs = list(runs.iterdir())
    assert len(run_dirs) == 1, run_dirs  # only rank 0 made a run dir
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["script"] == "rlhf_reward_model" and summary["run_dir"] == str(run_dirs[0])
    assert all((run_dirs[0] / f"reward_model_{m}" / "config.json").exists() for m in range(2))  # the default 2
    assert len(list(run_dirs[0].glob("events.out.tfevents.*"))) == 1  # one tensorboard writer
    # checkpoints every 10 updates, by rank 0 only, and none left once the run has finished (nothing to resume)
    assert not [p for p in run_dirs[0].iterdir() if "train_state" in p.name]
    assert proc.stdout.count("member 1, epoch 2/2") == 1  # rank 0 alone prints


def test_two_ranks_reach_one_rank_heldout_accuracy(one_and_two_ranks):
    # Same data, same permutation, same global minibatches: the runs differ only by float32 rounding of the summed
    # gradient, so their held-out accuracies agree within ACC_TOL (a rounding difference flips at most a few
    # near-tied pairs of 384); both models learned well above chance.
    one, _, runs = one_and_two_ranks
    two = json.loads((next(runs.iterdir()) / "summary.json").read_text())
    acc1, acc2 = one["metrics"]["eval/preference_accuracy"], two["metrics"]["eval/preference_accuracy"]
    assert acc1 > 0.6 and acc2 > 0.6, (acc1, acc2)
    assert abs(acc2 - acc1) <= ACC_TOL, (acc1, acc2)
    assert abs(two["metrics"]["model/sft_nll"] - one["metrics"]["model/sft_nll"]) < 1e-4  # the global SFT NLL


# ------------------------------------------------------------------------------------------------------------
# issue 17: kill / Ctrl-C, then --resume, ends with the uninterrupted run's metrics; bad resumes are one line
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = tmp_path_factory.mktemp("uninterrupted")
    return run_in_process(rm, runs, *RESUME_ARGS)  # the resumed subprocess runs must end bit-identical to it


def start_and_interrupt(runs: Path, sig: int, phase: str, member: int = 0) -> tuple[subprocess.Popen, Path, str]:
    """Start a run, wait for its first checkpoint of `phase` of ensemble member `member`, send `sig`; returns the
    ended process, its run dir and its output."""
    cmd = [sys.executable, SCRIPT, "--runs-dir", str(runs), *RESUME_ARGS]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + TIMEOUT
    while True:
        found = list(runs.glob(f"*/{rm.TRAIN_STATE}"))  # renamed into place: always a complete file
        if found and checkpoint_phase(found[0].parent) == (phase, member):
            break
        assert proc.poll() is None, f"the run ended before its first {phase} checkpoint:\n{proc.stdout.read()}"
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.01)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=TIMEOUT)
    return proc, found[0].parent, out


def checkpoint_header(run_dir: Path) -> dict:
    """The run's checkpoint (counters, phase, args), read again while the next one is renamed into place."""
    for _ in range(100):
        try:
            return rm.read_train_state(run_dir)
        except SystemExit:
            time.sleep(0.01)
    raise AssertionError(f"cannot read the checkpoint in {run_dir}")


def checkpoint_phase(run_dir: Path) -> tuple[str, int]:
    header = checkpoint_header(run_dir)
    return header["phase"], header["member"]


def resume(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, "--resume", str(run_dir), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run SIGKILLed right after its first checkpoint (update 2, in the SFT phase), not yet resumed."""
    proc, run_dir, _ = start_and_interrupt(tmp_path_factory.mktemp("killed"), signal.SIGKILL, "sft")
    assert proc.returncode == -signal.SIGKILL and not (run_dir / "summary.json").exists()
    return run_dir


def test_sigkill_then_resume_ends_with_the_uninterrupted_metrics(killed_run, uninterrupted, tmp_path):
    run_dir = Path(shutil.copytree(killed_run, tmp_path / killed_run.name))
    step = checkpoint_header(run_dir)["update"]
    assert step < 80, step  # killed inside SFT: the resume restores the SFT state, then trains the reward model
    proc = resume(run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"] == uninterrupted["metrics"]  # bit-identical on the same machine
    assert summary["run_dir"] == str(run_dir)
    assert not (run_dir / rm.TRAIN_STATE).exists()  # a finished run has nothing to resume


def test_sigterm_saves_a_checkpoint_and_resume_ends_with_the_uninterrupted_metrics(uninterrupted, tmp_path):
    """SIGTERM (torchrun's agent, a job scheduler) stops exactly as Ctrl-C does (the same handler: see
    test_stop_signals.py): a checkpoint at the next step, the tensorboard file closed, exit 130, the command."""
    proc, run_dir, out = start_and_interrupt(tmp_path / "runs", signal.SIGTERM, "reward")
    assert proc.returncode == 130, out
    assert out.strip().splitlines()[-1].startswith("interrupted; continue with: ")  # one line, naming the command:
    assert out.strip().endswith(f"rlhf_reward_model.py --resume {run_dir}")
    latest = checkpoint_header(run_dir)
    assert latest["phase"] == "reward" and 80 < latest["update"] < 116, latest  # inside the reward-model phase
    assert not (run_dir / "summary.json").exists()
    assert scalar_steps(run_dir, "losses/sft_nll") == list(range(8, 81, 8))  # on disk: the writer was closed
    done = resume(run_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"] == uninterrupted["metrics"]


def test_a_stop_in_the_second_member_resumes_with_the_first_from_the_checkpoint(uninterrupted, tmp_path):
    """Stopped in member 1's SFT: member 0 (done) comes back from the checkpoint, member 1 continues where it was."""
    proc, run_dir, out = start_and_interrupt(tmp_path / "runs", signal.SIGTERM, "sft", member=1)
    assert proc.returncode == 130, out
    latest = checkpoint_header(run_dir)
    assert latest["member"] == 1 and 116 < latest["update"] < 196 and len(latest["finished"]) == 1, latest["update"]
    done = resume(run_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"] == uninterrupted["metrics"]


def test_end_of_step_flushes_tensorboard_with_each_checkpoint_and_closes_it_on_a_stop(tmp_path):
    """Issue 24: scalars logged before a checkpoint are on disk when it is complete, and a stop closes the file."""

    class Writer:
        def __init__(self):
            self.calls = []

        def flush(self):
            self.calls.append("flush")

        def close(self):
            self.calls.append("close")

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run = start_run(tmp_path, save_every=2)
    run.writer.close()
    run.writer = Writer()
    state = rm.TrainState("sft", model, optimizer, scheduler)
    try:
        run.end_step(1, state)
        run.end_step(2, state)
        run.stop["signal"] = "SIGINT"  # what the stop handler sets
        with pytest.raises(SystemExit) as ended:
            run.end_step(3, state)
    finally:
        rm.restore_signal_handlers(run.stop)
    assert ended.value.code == rm.STOP_EXIT_CODE
    assert run.writer.calls == ["flush", "flush", "close"]  # update 2 (due), update 3 (the stop), then closed
    assert rm.read_train_state(run.run_dir)["update"] == 3


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_resuming_a_finished_run_is_a_one_line_error(uninterrupted, monkeypatch):
    assert "finished" in parse_error(monkeypatch, rm, "--resume", uninterrupted["run_dir"])


def test_resuming_another_scripts_run_is_a_one_line_error(killed_run, tmp_path, monkeypatch):
    run_dir = Path(shutil.copytree(killed_run, tmp_path / "other"))
    with safe_open(str(run_dir / rm.TRAIN_STATE), "pt") as file:
        tensors, meta = {key: file.get_tensor(key) for key in file.keys()}, file.metadata()
    save_file(tensors, str(run_dir / rm.TRAIN_STATE), metadata={**meta, "script": "rlhf_ppo_kl"})
    assert "is a run of rlhf_ppo_kl" in parse_error(monkeypatch, rm, "--resume", str(run_dir))


def test_resuming_with_a_different_algorithm_arg_is_a_one_line_error(killed_run, monkeypatch):
    assert "--learning-rate" in parse_error(monkeypatch, rm, "--resume", str(killed_run), "--learning-rate", "0.5")


def test_truncated_checkpoint_is_refused_in_one_line(killed_run, tmp_path, monkeypatch):
    run_dir = Path(shutil.copytree(killed_run, tmp_path / "truncated"))
    state_file = run_dir / rm.TRAIN_STATE
    state_file.write_bytes(state_file.read_bytes()[: state_file.stat().st_size // 2])
    message = parse_error(monkeypatch, rm, "--resume", str(run_dir))
    assert "cannot read checkpoint" in message and rm.TRAIN_STATE in message


def test_runs_dir_that_is_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = run_script("rlhf_reward_model", runs_dir=tmp_path / "a_file", timeout=TIMEOUT, expect_fail=True)
    assert "--runs-dir" in one_line_error(proc)


# ------------------------------------------------------------------------------------------------------------
# issue 17, in process: a save killed half-way leaves the previous checkpoint, which loads
# ------------------------------------------------------------------------------------------------------------
def tiny_training_state():
    torch.manual_seed(0)
    lm, tok = rm.build_lm(rm.Args(), "cpu")
    model = rm.reward_model_from(lm, tok, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 10)
    model.score.weight.sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_which_loads(tmp_path, monkeypatch):
    model, optimizer, scheduler = tiny_training_state()
    state = rm.TrainState("reward", model, optimizer, scheduler, perm=torch.arange(5), sft_nll=1.5)
    run = start_run(tmp_path, save_every=2)
    try:
        run.end_step(2, state)
        saved = {k: v.clone() for k, v in model.state_dict().items()}

        def killed_while_writing(tensors, filename, metadata=None):  # what a SIGKILL mid-write leaves: half a file
            Path(filename).write_bytes(b"half a file")
            raise KeyboardInterrupt

        with torch.no_grad():
            model.score.weight += 1.0
        monkeypatch.setattr(rm, "save_file", killed_while_writing)
        with pytest.raises(KeyboardInterrupt):
            run.end_step(4, state)
        monkeypatch.undo()
        assert (run.run_dir / f".tmp_{rm.TRAIN_STATE}").exists()
        run.checkpoint = rm.read_train_state(run.run_dir)  # what --resume reads: update 2, complete
        assert run.checkpoint["update"] == 2 and run.checkpoint["args"] == dataclasses.asdict(run.args)
        fresh, fresh_opt, fresh_sched = tiny_training_state()
        with torch.no_grad():
            fresh.score.weight.zero_()
        restored = rm.TrainState("reward", fresh, fresh_opt, fresh_sched)
        assert run.restore(restored) == 2
    finally:
        rm.restore_signal_handlers(run.stop)
    assert torch.equal(restored.perm, torch.arange(5)) and restored.sft_nll == 1.5
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert fresh_sched.last_epoch == 1  # one AdamW step on the one parameter that had a gradient (score.weight):
    assert [s["step"].item() for s in fresh_opt.state_dict()["state"].values()] == [1.0]


def test_resume_takes_the_saved_args_and_refuses_a_different_algorithm_arg(tmp_path):
    saved = dataclasses.asdict(rm.Args(learning_rate=3e-4, epochs=2, cuda=False, save_every=10))
    rm.save_train_state(tmp_path, {"args": saved})
    merged, _ = rm.resume_args(rm.Args(resume=str(tmp_path), save_every=5))  # only --resume and --save-every given
    assert (merged.learning_rate, merged.epochs, merged.save_every, merged.resume) == (3e-4, 2, 5, str(tmp_path))
    assert rm.resume_args(rm.Args(resume=str(tmp_path), learning_rate=3e-4))[0].learning_rate == 3e-4  # repeated
    with pytest.raises(SystemExit, match="--learning-rate"):
        rm.resume_args(rm.Args(resume=str(tmp_path), learning_rate=0.5))
