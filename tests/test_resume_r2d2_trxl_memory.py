"""R2D2 with a Transformer-XL memory (algos/r2d2_trxl_memory.py): a run killed after its first checkpoint and resumed
ends with the same metrics, bit for bit, as the same run uninterrupted (the actor's carried memory, or its window of
rows, is part of the checkpoint)."""

import json
import signal
import subprocess
import time

import pytest
from conftest import ROOT, run_script, script_command, start_script, subprocess_env

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
    "--target-network-frequency",
    "20",
    "--d-model",
    "16",
    "--memory-length",
    "6",
    "--window",
    "15",
    "--final-delta-q-sequences",
    "64",
    "--env-kwargs",
    '{"corridor_length": 3}',
]
TIMEOUT = 180  # seconds for one subprocess run (a tiny run takes seconds)


@pytest.mark.parametrize("memory", ["stored", "zero", "window", "episode", "exact"])
def test_sigkill_after_first_checkpoint_then_resume_matches_uninterrupted(tmp_path, memory):
    args = [*TINY, "--memory", memory]
    plain = run_script("r2d2_trxl_memory", *args, "--save-every", "0", runs_dir=tmp_path / "plain", timeout=TIMEOUT)
    runs_dir = tmp_path / "runs"
    proc = start_script(
        "r2d2_trxl_memory", tmp_path / "log.txt", "--runs-dir", str(runs_dir), *args, "--save-every", "1000"
    )
    deadline = time.time() + TIMEOUT
    while not list(runs_dir.glob("*/checkpoints/latest.json")):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    run_dir = next(runs_dir.iterdir())
    assert not (run_dir / "summary.json").exists()
    cmd = script_command("r2d2_trxl_memory", "--resume", str(run_dir))
    done = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0 and f"resumed {run_dir}" in done.stdout, done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    timing = ("perf/learner_ms_per_update",)  # wall time, the one metric that differs between two runs
    assert {k: v for k, v in summary["metrics"].items() if k not in timing} == {
        k: v for k, v in plain["metrics"].items() if k not in timing
    }  # bit-identical
    assert not (run_dir / "checkpoints").exists()
