"""Scaling out and long runs of algos/ilql_per_token.py: data-parallel training under torchrun (issue 16: the
all-reduced gradient of a global minibatch split over 2 ranks is the one-process gradient; a 2-process run writes one
run dir; SIGTERM stops both ranks at one checkpoint, which a 2-process --resume continues) and checkpoints (issue 17:
SIGKILL or Ctrl-C after a checkpoint, then --resume, ends with exactly the metrics of the uninterrupted run;
truncated checkpoints, finished runs, other scripts' runs, changed arguments are one-line errors).

Run as a script under torchrun, this file is the worker of the gradient test (see the end of the file)."""

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, gloo_threads, load_script, subprocess_env
from safetensors.torch import load_file, save_file
from test_ilql_per_token import TINY, check_evaluation_bookkeeping, run_main

import envs.guess_image as G

M = load_script("ilql_per_token")
SCRIPT = str(ROOT / "algos" / "ilql_per_token.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
RESUMABLE = (*TINY, "--num-steps", "120", "--save-every", "5", "--warmup-steps", "10")  # ~2 s of training
GRAD_IDX = [9, 3, 1, 12, 7, 0, 4]  # 7 dialogues of 12-107 tokens: shards of 4 (short) and 3 (long) over 2 ranks


# ----------------------------------------------------------------------------------------------------- torchrun
def grad_problem():
    """A tiny model and dataset, identical in every process (seeded), for the gradient test."""
    torch.manual_seed(0)
    args = M.Args(n_layer=1, n_embd=32)
    lm, heads, tok = M.build_model(args, torch.device("cpu"))
    torch.nn.init.normal_(heads.target_q1[-1].weight, std=0.3)  # targets != online heads: the V loss is non-trivial
    data = M.build_tensors(G.make_dataset(24, seed=5), tok)
    return lm, heads, data, args


def shard_losses_and_grads(lm, heads, data, args, rank=0, world_size=1):
    """The losses of one rank's shard of the global minibatch GRAD_IDX (all of it for world_size 1), after
    backward(): the gradients are in the parameters' .grad."""
    idx = torch.tensor(GRAD_IDX)
    batch = M.make_minibatch(data, idx, idx.tensor_split(world_size)[rank], torch.device("cpu"))
    out = M.forward_all(lm, heads, batch["input_ids"], batch["attention_mask"], q_at=batch["q_at"])
    losses = M.ilql_losses(out, batch, args)
    losses["loss"].backward()
    return {k: float(v.detach()) for k, v in losses.items()}


def named_grads(lm, heads) -> dict:
    named = [*(("lm." + n, p) for n, p in lm.named_parameters())]
    named += [("heads." + n, p) for n, p in heads.named_parameters()]
    return {n: p.grad.clone() for n, p in named if p.grad is not None}


def test_shard_losses_sum_to_the_global_minibatch_losses():
    """In one process, without torch.distributed: the two shards' losses (each divided by the global minibatch's
    token counts) add up to the one-process losses, so summing gradients over ranks is exact."""
    lm, heads, data, args = grad_problem()
    whole = shard_losses_and_grads(lm, heads, data, args)
    parts = [shard_losses_and_grads(lm, heads, data, args, r, 2) for r in range(2)]
    for k in whole:
        assert parts[0][k] + parts[1][k] == pytest.approx(whole[k], rel=1e-5, abs=1e-7), k
    assert parts[0]["q"] > 0 and parts[1]["q"] > 0 and whole["belief"] > 0  # both shards contribute to every term


def test_allreduced_gradient_equals_one_process_gradient(tmp_path):
    """Issue 16 (a). 2 gloo ranks each backpropagate their shard of GRAD_IDX (4 short and 3 long dialogues, each
    shard trimmed to its own longest) through `run.data_parallel` (DDP with a summing comm hook); the result equals
    the one-process gradient of the whole minibatch up to float summation order (the shards are padded to other
    widths): |Δ| <= 1e-4 * max|g| + 1e-7 per tensor; DDP's default averaging would halve it."""
    proc = subprocess.run(
        [*TORCHRUN, __file__, str(tmp_path)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reduced = load_file(tmp_path / "grads.safetensors")
    reduced_losses = json.loads((tmp_path / "losses.json").read_text())
    lm, heads, data, args = grad_problem()
    losses = shard_losses_and_grads(lm, heads, data, args)
    grads = named_grads(lm, heads)
    assert set(reduced) == set(grads) and len(grads) > 10
    for name, g in grads.items():
        assert (reduced[name] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-7, name
    for k in losses:  # the logged losses are the global minibatch's
        assert reduced_losses[k] == pytest.approx(losses[k], rel=1e-5, abs=1e-7), k


def torchrun(runs: Path, *args: str) -> subprocess.Popen:
    cmd = [*TORCHRUN, SCRIPT, "--runs-dir", str(runs), *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_torchrun_two_processes_stop_resume_and_write_one_run_dir(tmp_path):
    """Issue 16 (b): 2 processes train; SIGTERM (what torchrun's agent forwards) stops both at one step with one
    checkpoint holding both ranks' RNG states; a resume on another number of processes is refused; the resumed 2
    processes split the β sweep, agree on the β, and only rank 0 writes."""
    runs = tmp_path / "runs"
    proc = torchrun(runs, *RESUMABLE, "--num-steps", "60", "--eval-episodes", "6", "--val-episodes", "6")
    run_dir = wait_for_first_checkpoint(runs, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "SIGTERM: checkpoint saved at step" in err, err  # (torchrun's own traceback too)
    assert f"continue with: torchrun --nproc_per_node 2 {SCRIPT} --resume {run_dir}" in err, err
    state = M.read_train_state(run_dir)
    assert state["step"] < 60 and len(state["rngs"]) == 2  # rank 1 reseeds its torch RNG (dropout): its own state
    assert not torch.equal(state["rngs"][0]["torch"], state["rngs"][1]["torch"])
    with pytest.raises(SystemExit) as err:  # what `--resume` in one process exits with (resume() checks that path)
        M.start_run(M.resume_args(M.Args(resume=str(run_dir)))[0])
    assert str(err.value.code) == f"error: --resume {run_dir} ran on 2 processes, not 1"
    proc = subprocess.run(
        [*TORCHRUN, SCRIPT, "--resume", str(run_dir)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [p.name for p in runs.iterdir()] == [run_dir.name]  # exactly one run dir
    summary = json.loads((run_dir / "summary.json").read_text())
    check_evaluation_bookkeeping(summary["metrics"], betas=(0.0, 4.0))
    assert len(list(run_dir.glob("events.out.tfevents*"))) == 2  # one tensorboard writer per start, rank 0's
    assert not (run_dir / M.TRAIN_STATE).exists()  # a finished run keeps no checkpoint
    assert proc.stdout.count("β=0: val") == 1 and proc.stdout.count("β=4: val") == 1  # each β on one rank
    assert proc.stdout.count("best β=") == 1  # one summary line: rank 0


def test_shard_error_explains_batches_that_do_not_split():
    assert M.shard_error(32, 20000, 2, True) is None
    assert "not divisible" in M.shard_error(15, 300, 2, True)
    assert M.shard_error(16, 301, 2, False) is None  # uniform sampling: every minibatch is full
    assert "last minibatch" in M.shard_error(16, 305, 8, True)  # 305 % 16 = 1 dialogue for 8 ranks
    assert M.shard_error(16, 307, 2, True) is None  # 3 dialogues: shards of 2 and 1 (global counts keep it exact)


# ----------------------------------------------------------------------------------------------------- resume
def start_run(runs: Path) -> subprocess.Popen:
    cmd = [sys.executable, SCRIPT, "--runs-dir", str(runs), *RESUMABLE]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_first_checkpoint(runs: Path, proc: subprocess.Popen, timeout: float = 120) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = list(runs.glob(f"*/{M.TRAIN_STATE}"))
        if found:
            return found[0].parent
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("no checkpoint appeared")


def resume_error(run_dir: Path, **given) -> str:
    """The one-line error that `--resume RUN_DIR` (with the arguments `given`) exits with, from the script's
    resume_args in this process: the SystemExit(str) the command line prints (resume() checks that path)."""
    with pytest.raises(SystemExit) as err:
        M.resume_args(M.Args(resume=str(run_dir), **given))
    message = str(err.value.code)
    assert "\n" not in message, message
    return message


def resume(run_dir: Path, *extra: str, expect_fail: bool = False):
    cmd = [sys.executable, SCRIPT, "--resume", str(run_dir), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    if expect_fail:
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # a one-line error
        return proc.stderr.strip()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run without interruption, in this process (it is not about the command line or signals)."""
    return run_main(*RESUMABLE, runs_dir=tmp_path_factory.mktemp("runs"))


def wait_for_a_later_checkpoint(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """The step of run_dir's checkpoint once it is later than `step`; the run must still be going."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        saved = M.read_train_state(run_dir)["step"]
        if saved > step:
            return saved
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"no checkpoint after step {step} appeared")


def test_sigkill_then_sigint_then_resume_ends_with_the_uninterrupted_metrics(uninterrupted, tmp_path):
    """Issue 17, one run stopped twice: kill -9 after the first checkpoint; a truncated checkpoint is a one-line error;
    a save killed half way (its temporary file left beside the checkpoint) leaves the previous one, which --resume
    continues; Ctrl-C after a later checkpoint of that resumed run writes the checkpoint of the interrupted step and
    exits with STOP_EXIT_CODE; --resume (the run's own arguments repeated) ends bit-identical to the uninterrupted
    run. (One run serves both stops: each --resume starts from a checkpoint, as that of a run stopped once would.)"""
    runs = tmp_path / "runs"
    proc = start_run(runs)
    run_dir = wait_for_first_checkpoint(runs, proc)
    proc.kill()
    proc.communicate(timeout=60)
    checkpoint = run_dir / M.TRAIN_STATE
    killed_at = M.read_train_state(run_dir)["step"]
    assert killed_at < 120 and not (run_dir / "summary.json").exists()  # killed in training
    complete = checkpoint.read_bytes()
    checkpoint.write_bytes(complete[: len(complete) // 2])
    assert resume(run_dir, expect_fail=True).startswith(f"error: cannot read checkpoint {checkpoint}")
    checkpoint.write_bytes(complete)
    (run_dir / f".tmp_{M.TRAIN_STATE}").write_bytes(complete[: len(complete) // 3])  # a save killed half way

    # the resumed run, stopped by Ctrl-C once it has saved a checkpoint of its own
    cmd = [sys.executable, SCRIPT, "--resume", str(run_dir)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_a_later_checkpoint(run_dir, killed_at, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == M.STOP_EXIT_CODE and "Traceback" not in err, err
    assert f"--resume {run_dir}" in err and "SIGINT" in err
    step = M.read_train_state(run_dir)["step"]
    assert killed_at < step < 120 and f"step {step} of 120" in err  # the checkpoint of the interrupted step
    assert "--seed 7 differs" in resume_error(run_dir, seed=7)  # a resumed run keeps its arguments
    resumed = resume(run_dir, *RESUMABLE)  # repeating the run's own arguments is fine
    assert resumed["metrics"] == uninterrupted["metrics"]  # bit-identical on CPU
    assert not checkpoint.exists()  # a finished run keeps no checkpoint
    assert "has finished" in resume_error(run_dir)


def test_resume_refuses_other_scripts_and_bad_dirs(tmp_path):
    """One-line errors: another script's checkpoint, a missing one, the arguments of another version; and a
    --runs-dir that cannot hold a run dir."""
    other = tmp_path / "other_run"
    other.mkdir()
    save_file({}, str(other / M.TRAIN_STATE), metadata={"script": "rlhf_ppo_kl", "state": "{}"})
    for run_dir, message in ((other, "is a run of rlhf_ppo_kl.py"), (tmp_path / "missing", "cannot read checkpoint")):
        with pytest.raises(SystemExit, match=message):
            M.resume_args(M.Args(resume=str(run_dir)))
    old = {k: v for k, v in vars(M.Args()).items() if k not in ("tau", "expectile", "cql_alpha")}
    old.update(tau=0.7, polyak=0.05, cql_weight=0.1)  # a run of the version before the renames (tau: the expectile)
    M.save_train_state(other, {"args": old})
    with pytest.raises(SystemExit, match="do not fit this script"):
        M.resume_args(M.Args(resume=str(other)))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(SystemExit, match=f"error: --runs-dir {a_file}: Not a directory"):
        M.start_run(M.Args(runs_dir=str(a_file), n_train_dialogues=300))


# ----------------------------------------------------------------------------------------------------- worker
if __name__ == "__main__":  # under torchrun: the 2 ranks of test_allreduced_gradient_equals_one_process_gradient
    import torch.distributed as dist

    lm, heads, data, args = grad_problem()
    run = M.start_run(replace(args, runs_dir=str(Path(sys.argv[1]) / "runs"), n_train_dialogues=24))
    forward = run.data_parallel(M.forward_all, lm, heads)  # what main() trains through
    idx = torch.tensor(GRAD_IDX)
    batch = M.make_minibatch(data, idx, run.shard(idx), torch.device("cpu"))
    losses = M.ilql_losses(forward(batch["input_ids"], batch["attention_mask"], q_at=batch["q_at"]), batch, args)
    losses["loss"].backward()
    summed = run.global_sum(torch.tensor([float(v.detach()) for v in losses.values()], dtype=torch.float64))
    losses = dict(zip(losses, summed.tolist(), strict=True))
    if run.rank == 0:
        save_file(named_grads(lm, heads), str(Path(sys.argv[1]) / "grads.safetensors"))
        (Path(sys.argv[1]) / "losses.json").write_text(json.dumps(losses))
    run.end_training()  # as main() does: DDP lets go of the process group
    dist.destroy_process_group()
    left = gloo_threads()
    assert not left, f"rank {run.rank}: the process group outlived destroy_process_group ({left} still run)"
