"""Tests of algos/rlhf_ppo_kl.py under torchrun (issue 16) and of its checkpoints / --resume / Ctrl-C (issue 17).

torchrun: (a) DDP's summed, token-weighted gradient of a fixed global minibatch split over 2 gloo ranks equals the
one-process gradient of the whole minibatch, and the global whitening / mean / gather helpers equal their one-process
values; every rank's RNG states are in rank 0's checkpoint, complete before any rank goes on (this file is also the
worker: `python -m torch.distributed.run ... tests/test_scale_rlhf_ppo_kl.py OUT`); (b) the script runs end to end
under `python -m torch.distributed.run --standalone --nproc_per_node 2` and writes exactly one run dir. Resume: a tiny
run killed with SIGKILL (or stopped with SIGINT) after a checkpoint and resumed ends with bit-identical metrics and
curve to the same run uninterrupted (CPU); a truncated checkpoint is refused naming the file while a half-written newer
one is ignored; a finished run, another script's run and changed flags are one-line errors."""

import functools
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
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
from safetensors.torch import save_file

M = load_script("rlhf_ppo_kl")
SCRIPT = str(ROOT / "algos" / "rlhf_ppo_kl.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
SLOW_WRITE_S = 0.5  # rank 0's checkpoint write, slowed in the worker: rank 1 must wait for it
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7  # float32: the shard and whole-batch forward passes sum in different orders
TINY = tuple(  # seconds: tiny data, tiny model; eval every update; batch 8 = 2 minibatches of 4 = 2 ranks x 2
    "--sft-examples 128 --sft-epochs 1 --pref-prompts 8 --rm-epochs 1 --batch-size 8 --num-minibatches 2 "
    "--update-epochs 1 --eval-every 1 --eval-episodes 8 --bon-max-n 4 --n-embd 16 --n-layer 1 --n-head 2".split()
)
# the resume tests: long enough (12 updates, a checkpoint every 2) that a kill after the first PPO checkpoint lands
# mid-run; --adaptive-kl so that beta is part of the restored state
RESUME_RUN = (*TINY, "--num-updates", "12", "--save-every", "2", "--adaptive-kl", "--kl-horizon", "50")


def run(cmd, timeout=240, expect_fail=False):
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if expect_fail:
        assert proc.returncode != 0, f"expected a failure:\n{proc.stdout[-2000:]}"
        return proc
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def one_line_error(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# (a) gradients and global statistics over 2 ranks (this file is the worker)
# ---------------------------------------------------------------------------------------------------------------
def flat_grad(policy) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None]).clone()


def gradient_worker(out_dir: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    run = M.start_run(M.Args(runs_dir=str(Path(out_dir) / "runs"), save_every=1))  # joins torchrun's process group
    rank, world = run.rank, run.world_size
    torch.manual_seed(0)  # the same model and minibatch on every rank
    config = GPT2Config(
        vocab_size=12,
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
    policy = M.PolicyWithValue(GPT2LMHeadModel(config))
    torch.nn.init.normal_(policy.v_head.weight, std=0.5)  # a non-zero value head: the value loss has gradients
    not_text = torch.zeros(12, dtype=torch.bool)
    not_text[[0, 1, 3]] = True  # pad, bos, unk
    B, T = 8, 6
    query = torch.randint(4, 12, (B, 3))
    query[::2, 0] = 0  # left padding on half the prompts
    response = torch.randint(4, 12, (B, T))
    # rank 0's half ends early, rank 1's runs long: unequal token counts, so a plain average of shard means is wrong
    for i, length in enumerate([1, 2, 1, 3, 6, 5, 6, 4]):
        if length < T:
            response[i, length - 1], response[i, length:] = 2, 0  # EOS, then padding
    mask = M.completion_mask(response, 2)[0].float()
    with torch.no_grad():
        logits, values = policy(query, response, 0, not_text)
        old_logprobs = M.response_logprobs(logits, response, 1.0) + 0.3 * torch.randn(B, T) * mask  # ratios != 1
    advantages, returns = torch.randn(B, T) * mask, (values + torch.randn(B, T)) * mask
    args = SimpleNamespace(temperature=1.0, cliprange=0.2, cliprange_value=0.2, vf_coef=0.5, advantage="gae")
    batch = (query, response, mask, old_logprobs, values, advantages, returns)

    def loss_of(forward, rows):
        return forward(*(x[rows] for x in batch), args, 0, not_text)[0]

    everything, mine = slice(0, B), slice(rank * B // world, (rank + 1) * B // world)  # as run.shard splits
    policy.zero_grad()
    loss_of(functools.partial(M.ppo_minibatch_loss, policy), everything).backward()  # one process, no collective
    one_process = flat_grad(policy)
    minibatch_loss = run.data_parallel(M.ppo_minibatch_loss, policy)  # DDP, as the script calls it
    policy.zero_grad()
    (loss_of(minibatch_loss, mine) * M.token_share(mask[mine], run.global_sum(mask[mine].sum()))).backward()
    data_parallel = flat_grad(policy)
    policy.zero_grad()
    loss_of(minibatch_loss, mine).backward()  # without the token share: the sum of the shards' means
    unweighted = flat_grad(policy)

    x = torch.randn(B, T)
    assert run.shard(list(range(B))) == list(range(B))[mine]
    mean, var = M.masked_mean_var(x[mine], mask[mine], run.global_sum)  # as the script calls it
    whitened = M.masked_whiten(x[mine], mask[mine], mean_var=(mean, var))
    gathered_whitened = torch.cat(run.gather(whitened))
    # issue 24: no rank leaves end_step before rank 0's checkpoint is complete (a rank that exits early makes
    # torchrun's agent stop the others, rank 0 mid-write); rank 0's write is slowed so that an early return shows.
    # Each rank samples with its own generator: rank 0's checkpoint holds every rank's, and each gets its own back
    save_train_state = M.save_train_state
    M.save_train_state = lambda *a: (time.sleep(SLOW_WRITE_S), save_train_state(*a))
    sample_gen = torch.Generator().manual_seed(100 + rank)
    state = M.TrainState(
        policy, torch.optim.Adam(policy.parameters()), sample_gen, np.random.default_rng(0), None, 0.0, {}
    )
    mine = sample_gen.get_state()
    run.end_step(1, state)
    checkpoint_complete_on_return = (run.run_dir / M.TRAIN_STATE).is_file()
    M.save_train_state = save_train_state
    run.checkpoint, run.resuming = M.read_train_state(run.run_dir), True
    sample_gen.manual_seed(999)
    run.restore(state)
    rng_restored = torch.equal(sample_gen.get_state(), mine) and len(run.checkpoint["rng"]) == world
    if rank == 0:  # tears the group down: rank 0 goes on, the others leave
        run.end_training()
    else:
        with pytest.raises(SystemExit):
            run.end_training()
    left = gloo_threads()
    assert not left, f"rank {rank}: the process group outlived destroy_process_group ({left} still run)"
    result = {
        "grad_max_abs_diff": (data_parallel - one_process).abs().max().item(),
        "grad_close": torch.allclose(data_parallel, one_process, rtol=GRAD_RTOL, atol=GRAD_ATOL),
        "grad_max_abs": one_process.abs().max().item(),
        "unweighted_max_abs_diff": (unweighted - one_process).abs().max().item(),
        "mean_diff": (mean - M.masked_mean(x, mask)).abs().item(),
        "var_diff": (var - M.masked_mean_var(x, mask)[1]).abs().item(),
        "whiten_max_abs_diff": (gathered_whitened - M.masked_whiten(x, mask)).abs().max().item(),
        "data_parallel_grad": data_parallel.tolist(),
        "checkpoint_complete_on_return": checkpoint_complete_on_return,
        "rng_restored": rng_restored,
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def test_allreduced_gradient_of_a_split_minibatch_equals_the_one_process_gradient(tmp_path):
    run([*TORCHRUN, str(Path(__file__).resolve()), str(tmp_path)], timeout=180)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["data_parallel_grad"] == r1["data_parallel_grad"]  # every rank steps with the same gradient
    for r in (r0, r1):
        assert r["grad_close"], r["grad_max_abs_diff"]  # rtol 1e-5, atol 1e-7 (float32 summation order)
        assert r["grad_max_abs"] > 1e-3  # a gradient worth comparing
        assert r["unweighted_max_abs_diff"] > 100 * r["grad_max_abs_diff"]  # the token weighting is what makes it
        assert r["mean_diff"] < 1e-6 and r["var_diff"] < 1e-5 and r["whiten_max_abs_diff"] < 1e-5
        assert r["checkpoint_complete_on_return"]  # rank 1 waited for rank 0's write
        assert r["rng_restored"]  # each rank's sampling generator, saved by rank 0, back on its rank


# ---------------------------------------------------------------------------------------------------------------
# (b) end to end under torchrun
# ---------------------------------------------------------------------------------------------------------------
def test_torchrun_two_processes_end_to_end_writes_exactly_one_run_dir(runs_dir):
    proc = run([*TORCHRUN, SCRIPT, "--runs-dir", str(runs_dir), *TINY, "--num-updates", "2", "--save-every", "1"])
    (run_dir,) = runs_dir.iterdir()  # exactly one run dir: only rank 0 creates it
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["script"] == "rlhf_ppo_kl" and summary["args"]["num_updates"] == 2
    assert all(v == v for v in summary["metrics"].values())  # no NaN from a statistic over an empty shard
    assert len((run_dir / "curve.jsonl").read_text().splitlines()) == 3  # updates 0, 1, 2: one writer
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # one tensorboard writer
    assert not (run_dir / M.TRAIN_STATE).exists()  # saved every update by rank 0, gone once the run has finished
    assert proc.stdout.count("[bon]") == 1  # only rank 0 prints


# ---------------------------------------------------------------------------------------------------------------
# resume: SIGKILL / SIGINT after a checkpoint, then --resume, ends bit-identical to the uninterrupted run
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = tmp_path_factory.mktemp("uninterrupted")
    summary = run_in_process(M, runs, *RESUME_RUN)  # the resumed subprocess runs must end bit-identical to it
    return summary, Path(summary["run_dir"])


def start_and_stop_after_first_ppo_checkpoint(runs_dir: Path, sig: int) -> tuple[Path, subprocess.Popen]:
    """Start the resume-test run, send `sig` as soon as a checkpoint after update 0 exists; return its run dir."""
    cmd = [sys.executable, SCRIPT, "--runs-dir", str(runs_dir), *RESUME_RUN]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        found = list(runs_dir.glob(f"*/{M.TRAIN_STATE}"))  # renamed into place: always a complete file
        if found and checkpoint_header(found[0].parent)["update"] >= 2:
            proc.send_signal(sig)
            break
        time.sleep(0.01)
    out, err = proc.communicate(timeout=120)
    (run_dir,) = runs_dir.iterdir()
    assert not (run_dir / "summary.json").exists(), f"the run finished before the signal:\n{out[-2000:]}"
    proc.stderr_text = err
    return run_dir, proc


def checkpoint_header(run_dir: Path) -> dict:
    """The run's checkpoint (counters, args), read again while the next one is renamed into place."""
    for _ in range(100):
        try:
            return M.read_train_state(run_dir)
        except SystemExit:
            time.sleep(0.01)
    raise AssertionError(f"cannot read the checkpoint in {run_dir}")


def assert_same_final_metrics(run_dir: Path, uninterrupted) -> None:
    summary, ref_dir = uninterrupted
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["metrics"] == summary["metrics"]  # bit-identical floats
    assert (run_dir / "curve.jsonl").read_text() == (ref_dir / "curve.jsonl").read_text()
    assert not (run_dir / M.TRAIN_STATE).exists()  # a finished run has nothing to resume


def test_sigkill_then_resume_ends_bit_identical_and_truncated_checkpoints(
    runs_dir, tmp_path, uninterrupted, monkeypatch
):
    run_dir, proc = start_and_stop_after_first_ppo_checkpoint(runs_dir, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    latest = checkpoint_header(run_dir)
    # none lost to the kill (a guard: tensorboard's writer thread also drains within ms, so this holds without the
    # flush at checkpoints too; the flush itself is tested on the reward model's end_of_step)
    logged = scalar_steps(run_dir, "objective/kl")
    assert set(range(1, latest["update"] + 1)) <= set(logged), (latest, logged)
    # a copy whose checkpoint was truncated half-way (e.g. the disk filled up): refused, naming the file
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    weights = broken / M.TRAIN_STATE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    error = parse_error(monkeypatch, M, "--resume", str(broken))
    assert "cannot read checkpoint" in error and str(weights) in error
    # a kill during the next save leaves a half-written temporary file: ignored, the checkpoint before loads
    half = run_dir / f".tmp_{M.TRAIN_STATE}"
    half.write_bytes((run_dir / M.TRAIN_STATE).read_bytes()[:100])
    resumed = run([sys.executable, SCRIPT, "--resume", str(run_dir)])
    assert f"after update {latest['update']}" in resumed.stdout
    assert_same_final_metrics(run_dir, uninterrupted)
    assert not half.exists()  # the next save writes it whole and renames it into place


def test_sigint_writes_a_checkpoint_then_resume_ends_bit_identical(runs_dir, uninterrupted):
    run_dir, proc = start_and_stop_after_first_ppo_checkpoint(runs_dir, signal.SIGINT)
    assert proc.returncode == 130, proc.stderr_text[-2000:]
    assert f"--resume {run_dir}" in proc.stderr_text.strip().splitlines()[-1]
    stopped_at = checkpoint_header(run_dir)["update"]
    assert 2 <= stopped_at <= 12
    run([sys.executable, SCRIPT, "--resume", str(run_dir)])
    assert_same_final_metrics(run_dir, uninterrupted)


def test_resume_refuses_a_finished_run_another_scripts_run_and_changed_flags(tmp_path, uninterrupted, monkeypatch):
    _, finished = uninterrupted
    assert "finished" in parse_error(monkeypatch, M, "--resume", str(finished))
    # another script's run (its own checkpoint naming it), and a run dir with no checkpoint at all
    other = tmp_path / "other_run"
    other.mkdir()
    save_file({}, str(other / M.TRAIN_STATE), metadata={"script": "rlhf_reward_model", "state": "{}"})
    assert "rlhf_reward_model" in parse_error(monkeypatch, M, "--resume", str(other))
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert "cannot read checkpoint" in parse_error(monkeypatch, M, "--resume", str(empty))
    # a flag that changes the run (here, on a copy of a finished run made resumable: no summary, a checkpoint)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(finished, unfinished)
    (unfinished / "summary.json").unlink()
    M.save_train_state(unfinished, {"args": json.loads((unfinished / "args.json").read_text())})
    assert "--seed 7" in parse_error(monkeypatch, M, "--resume", str(unfinished), "--seed", "7")


def test_runs_dir_that_is_a_file_is_a_one_line_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    proc = run_script("rlhf_ppo_kl", *TINY, runs_dir=not_a_dir, expect_fail=True)
    assert "--runs-dir" in one_line_error(proc)


if __name__ == "__main__":  # the worker of test (a), started by torch.distributed.run
    gradient_worker(sys.argv[1])
