"""Per-utterance CQL (algos/dialogue_cql_utterance.py), issue 17: RUN_DIR/train_state.safetensors at the phase ends
and every --save-every critic steps; --resume and Ctrl-C continue a run exactly.

A run killed (SIGKILL) or interrupted (SIGINT) after a checkpoint of the BC, candidate or critic phase and resumed
ends with the same metrics, bit for bit, as the same run uninterrupted; so does a run that writes no checkpoints.
"""

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from conftest import ROOT, load_script, script_command, start_script, subprocess_env
from safetensors.torch import save_file

cql = load_script("dialogue_cql_utterance")

# the smoke test's tiny run (200 dialogues, 1 BC epoch, 2 candidates, 18 + 18 episodes) with 60 critic steps
TINY = list(
    "--dataset-size 200 --bc-epochs 1 --critic-steps 60 --batch-size 16 --eval-episodes 18 "
    "--n-candidates 2 --n-embd 16 --critic-dim 16 --critic-hidden 16 --log-every 10 --val-episodes 18 "
    "--act-temperatures 1.0 0.5".split()
)
SAVE_EVERY = ["--save-every", "20"]  # checkpoints after BC, after the candidates, at critic steps 20, 40, 60
TIMEOUT = 300  # seconds for one subprocess run (a tiny run takes seconds)


def start_run(runs_dir, log_path) -> subprocess.Popen:
    return start_script("dialogue_cql_utterance", log_path, "--runs-dir", str(runs_dir), *TINY, *SAVE_EVERY)


def wait_for_checkpoint(proc: subprocess.Popen, runs_dir, phases: tuple[str, ...], after=None):
    """The run dir once its train_state.safetensors is one of `phases` (and, with `after` the os.stat of an earlier
    checkpoint, a file saved since); the run must still be going."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        for checkpoint in runs_dir.glob(f"*/{cql.TRAIN_STATE}"):
            saved = checkpoint.stat()
            if after and (saved.st_ino, saved.st_mtime_ns) == (after.st_ino, after.st_mtime_ns):
                continue
            if cql.read_train_state(checkpoint.parent)["phase"] in phases:
                return checkpoint.parent
        assert proc.poll() is None, f"the run ended before a checkpoint of {phases}"
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no checkpoint of {phases} within the timeout")


def resume(run_dir, *args: str, expect_fail: bool = False):
    cmd = script_command("dialogue_cql_utterance", "--resume", str(run_dir), *args)
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)
    if expect_fail:
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # a one-line error
        return proc.stderr.strip()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resumed {run_dir}: " in proc.stdout
    return json.loads((run_dir / "summary.json").read_text())


def resume_error(run_dir) -> str:
    """The one-line error that `--resume RUN_DIR` exits with, from the script's resume_args in this process (the same
    SystemExit(str) the command line prints, no traceback; resume() checks that path)."""
    with pytest.raises(SystemExit) as err:
        cql.resume_args(cql.Args(resume=str(run_dir)))
    message = str(err.value.code)
    assert "\n" not in message, message
    return message


def run_main(*argv: str, runs_dir) -> dict:
    """`python algos/dialogue_cql_utterance.py --runs-dir RUNS_DIR ARGV...` run in this process (cql.main(), no
    interpreter start nor import of torch and transformers, which a run pays seconds for): the run's summary.json.
    main() sets torch's thread count and, while it trains, the Ctrl-C / SIGTERM handlers: both are put back."""
    import torch

    threads, argv_before = torch.get_num_threads(), sys.argv
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    sys.argv = [f"{cql.SCRIPT}.py", "--runs-dir", str(runs_dir), *argv]
    try:
        cql.main()
    finally:
        sys.argv = argv_before
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    (run_dir,) = runs_dir.iterdir()
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The tiny run without checkpoints and with all of them: identical metrics (saving never draws a random number),
    and the checkpoint is gone once the run has finished. Both run in this process (they are not about the command
    line or signals); the interrupted runs below are subprocesses and must end with these metrics, bit for bit."""
    runs_dir = tmp_path_factory.mktemp("uninterrupted")
    plain = run_main(*TINY, "--save-every", "0", runs_dir=runs_dir / "off")
    saving = run_main(*TINY, *SAVE_EVERY, runs_dir=runs_dir / "on")
    assert saving["metrics"] == plain["metrics"]
    assert not (runs_dir / "on" / saving["run_name"] / cql.TRAIN_STATE).exists()
    return plain


def test_sigkill_after_a_checkpoint_then_resume_matches_uninterrupted(uninterrupted, tmp_path):
    """kill -9 after the checkpoint of the BC or the candidate phase, --resume; kill -9 that resumed run after a
    checkpoint of the critic phase, --resume again: the run ends bit-identical to the uninterrupted one, in its run
    dir. (One run serves both kills: each resume starts from a checkpoint of its phase, as a fresh run's would.)"""
    runs_dir = tmp_path / "runs"
    proc = start_run(runs_dir, tmp_path / "log.txt")
    run_dir = wait_for_checkpoint(proc, runs_dir, ("bc", "candidates"))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (run_dir / "summary.json").exists()
    killed = (run_dir / cql.TRAIN_STATE).stat()  # the checkpoint the kill left (a later save replaces the file)
    proc = start_script("dialogue_cql_utterance", tmp_path / "resumed.txt", "--resume", str(run_dir))
    wait_for_checkpoint(proc, runs_dir, ("critic",), after=killed)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert f"resumed {run_dir}: " in (tmp_path / "resumed.txt").read_text()
    assert not (run_dir / "summary.json").exists()
    summary = resume(run_dir)
    assert summary["metrics"] == uninterrupted["metrics"]  # bit-identical
    assert summary["run_dir"] == str(run_dir) and list(runs_dir.iterdir()) == [run_dir]  # the same run dir
    assert not (run_dir / cql.TRAIN_STATE).exists()
    assert (run_dir / "critic.safetensors").exists() and (run_dir / "bc_lm" / "config.json").exists()


def test_sigint_truncated_checkpoint_and_refusals(uninterrupted, tmp_path):
    runs_dir = tmp_path / "runs"
    proc = start_run(runs_dir, tmp_path / "log.txt")
    run_dir = wait_for_checkpoint(proc, runs_dir, ("bc", "candidates"))
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=TIMEOUT) == cql.STOP_EXIT_CODE
    last_line = (tmp_path / "log.txt").read_text().strip().splitlines()[-1]
    assert last_line.startswith("SIGINT: checkpoint saved in ") and f"--resume {run_dir}" in last_line
    assert cql.read_train_state(run_dir)["phase"] != "bc" and not (run_dir / "summary.json").exists()  # a later one

    # changed arguments are refused (the command line: a one-line error); a checkpoint truncated half-way is a
    # one-line error naming it
    assert "--critic-steps 61 differs from the run's 60" in resume(run_dir, "--critic-steps", "61", expect_fail=True)
    checkpoint = run_dir / cql.TRAIN_STATE
    content = checkpoint.read_bytes()
    checkpoint.write_bytes(content[: len(content) // 2])
    assert resume_error(run_dir).startswith(f"error: cannot read checkpoint {checkpoint}")
    # a kill during the next save leaves its temporary file beside the previous, complete checkpoint
    checkpoint.write_bytes(content)
    (run_dir / f".tmp_{cql.TRAIN_STATE}").write_bytes(content[:100])
    summary = resume(run_dir, *TINY)  # repeating the run's own arguments is fine
    assert summary["metrics"] == uninterrupted["metrics"]  # bit-identical
    assert not checkpoint.exists()

    # a finished run, another script's run, a dir without checkpoint: one-line errors
    finished = resume_error(run_dir)
    assert finished == f"error: run {run_dir} has finished (summary.json exists); there is nothing to resume"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    save_file({}, str(foreign / cql.TRAIN_STATE), metadata={"script": "r2d2_rnnstate", "state": "{}"})
    for run, message in (
        (foreign, "is a run of r2d2_rnnstate.py, not of dialogue_cql_utterance.py"),
        (tmp_path, "cannot read checkpoint"),
    ):
        assert message in resume_error(run)


def test_checkpoint_round_trip_is_exact(tmp_path):
    """What Run.end_step writes of a TrainState (proposer with tied embeddings, utterance table, candidates, critic,
    target, Adam, minibatch rng, RNG states), Run.restore of the resumed run restores bit for bit: the phases done
    first, the critic phase's parts once they are built."""
    import numpy as np
    import torch

    torch.manual_seed(0)
    args = cql.Args(n_embd=16, n_head=4, critic_dim=8, critic_hidden=8, runs_dir=str(tmp_path), save_every=20)
    lm, tokenizer = cql.build_proposer(args)
    new_critic = lambda: cql.UtteranceCritic(len(tokenizer), 8, 8, tokenizer.pad_token_id)  # noqa: E731
    critic, target = new_critic(), new_critic()
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-3)
    sum(param.square().sum() for param in critic.parameters()).backward()
    optimizer.step()
    rng = np.random.default_rng(0)
    table = cql.UtteranceTable(tokenizer)
    table.add("is it red ?")  # the data's utterance
    table.add("it is big .")  # a sampled one
    state = cql.TrainState(phase="critic", lm=lm, table=table, bc_nll={"model/bc_nll_end": 1.25}, timings={"bc_s": 1.0})
    state.cand = torch.from_numpy(rng.integers(-1, 9, size=(5, 3)))
    state.critic, state.target, state.optimizer, state.rng = critic, target, optimizer, rng
    run = cql.start_run(args)
    run.end_step(20, state)
    run.end_training()
    expected = (rng.random(), torch.rand(1), np.random.random())  # the draws after the save

    torch.manual_seed(1)
    fresh_lm, _ = cql.build_proposer(args)
    fresh_table = cql.UtteranceTable(tokenizer)
    fresh_table.add("is it red ?")
    fresh = cql.TrainState(phase=None, lm=fresh_lm, table=fresh_table)
    resumed = cql.start_run(replace(args, resume=str(run.run_dir)))
    assert resumed.restore(fresh) == 0  # the start of main: the phases done
    assert fresh.phase == "critic" and fresh.bc_nll == state.bc_nll and fresh.timings == state.timings
    assert torch.equal(fresh.cand, state.cand) and list(fresh_table.ids) == ["is it red ?", "it is big ."]
    fresh.critic, fresh.target, fresh.rng = new_critic(), new_critic(), np.random.default_rng(3)
    fresh.optimizer = torch.optim.Adam(fresh.critic.parameters(), lr=1e-3)
    assert resumed.restore(fresh) == 20  # the critic phase, once its parts are built
    resumed.end_training()
    for old, new in ((lm, fresh_lm), (critic, fresh.critic), (target, fresh.target)):
        assert all(torch.equal(value, new.state_dict()[key]) for key, value in old.state_dict().items())
    assert fresh_lm.lm_head.weight.data_ptr() == fresh_lm.transformer.wte.weight.data_ptr()  # still tied
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(fresh.optimizer.state_dict()["state"][0][key], value)
    assert (fresh.rng.random(), torch.rand(1), np.random.random()) == expected
