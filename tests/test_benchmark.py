"""benchmark.sh's claim checks: a failing prediction is reported as failing (and the exit status says so), a crashed
run is reported apart from the claims, a malformed check is a clear error naming its line, and every experiment line
of benchmark.sh itself parses. Runs `bash benchmark.sh --aggregate` on hand-made results folders (no training)."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

HEADER = "# id | claim | command | metrics | prediction | check"


def make_folder(tmp_path: Path, lines: list[str], metrics: dict, seeds=(1, 2), crashed=()) -> Path:
    """A results folder as benchmark.sh writes it; metrics: {exp_id: {seed: {metric: value}}}."""
    out = tmp_path / "results"
    (out / "runs").mkdir(parents=True)
    (out / "experiments.txt").write_text("\n".join([HEADER, *lines]) + "\n")
    (out / "meta.json").write_text(json.dumps({"seeds": " ".join(map(str, seeds)), "argv": "--quick"}))
    for exp_id, per_seed in metrics.items():
        for seed, values in per_seed.items():
            run_dir = out / "runs" / exp_id / f"seed{seed}" / f"run_{seed}"
            run_dir.mkdir(parents=True)
            summary = {"script": "x", "run_dir": str(run_dir), "args": {"seed": seed}, "metrics": values}
            (run_dir / "summary.json").write_text(json.dumps(summary))
    for exp_id, seed in crashed:
        (out / "runs" / exp_id / f"seed{seed}").mkdir(parents=True)
    return out


def aggregate(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmark.sh"), "--aggregate", str(out)], capture_output=True, text=True, timeout=120
    )


def test_failing_prediction_is_reported_as_failing_with_the_seed_and_values(tmp_path):
    lines = [
        "ppo | PPO reaches 475 | ppo_recurrent --rnn gru | eval/episodic_return | >= 475 | eval/episodic_return >= 475",
        "line | p(right) is 1/2 | ppo_recurrent | eval/p | 0.5 | 0.45 <= eval/p <= 0.55",
        "zero | zero state has larger error | r2d2_rnnstate | model/dq | larger | model/dq > line:eval/p",
        "anchor | an anchor | ilql_per_token | dataset/mean_return | 0.41 | info",
    ]
    metrics = {
        "ppo": {1: {"eval/episodic_return": 500.0}, 2: {"eval/episodic_return": 221.8}},
        "line": {1: {"eval/p": 0.50}, 2: {"eval/p": 0.52}},
        "zero": {1: {"model/dq": 0.9}, 2: {"model/dq": 0.7}},
        "anchor": {1: {"dataset/mean_return": 0.41}, 2: {"dataset/mean_return": 0.41}},
    }
    proc = aggregate(make_folder(tmp_path, lines, metrics))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = (tmp_path / "results" / "results.md").read_text()
    assert "claims holding: 2 of 3" in text  # the anchor is reported, not counted
    assert "runs finished: 8 of 8" in text  # the run status is separate from the verdicts
    ppo_row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert "**FAILS**" in ppo_row and "holds on 1/2 seeds" in ppo_row and "seed 2" in ppo_row and "221.8" in ppo_row
    assert "500.000 / 221.800" in ppo_row  # per-seed values in seed order
    assert "holds 2/2 seeds" in next(line for line in text.splitlines() if line.startswith("| 2 |"))
    assert "holds 2/2 seeds" in next(line for line in text.splitlines() if line.startswith("| 3 |"))


def test_all_claims_holding_exits_zero_and_mean_checks_use_the_means(tmp_path):
    lines = [
        "a | A beats B on average | s | eval/x | A > B | mean: eval/x > b:eval/x",
        "b | B | s | eval/x | - | eval/x >= 0",
    ]
    # seed 2 alone would fail A > B, but the mean over seeds holds (0.75 > 0.55)
    metrics = {"a": {1: {"eval/x": 1.0}, 2: {"eval/x": 0.5}}, "b": {1: {"eval/x": 0.5}, 2: {"eval/x": 0.6}}}
    proc = aggregate(make_folder(tmp_path, lines, metrics))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "claims holding: 2 of 2" in (tmp_path / "results" / "results.md").read_text()


def test_crashed_run_is_reported_and_fails_the_benchmark(tmp_path):
    lines = ["a | A | s | eval/x | >= 0 | eval/x >= 0"]
    proc = aggregate(make_folder(tmp_path, lines, {"a": {1: {"eval/x": 1.0}}}, crashed=[("a", 2)]))
    assert proc.returncode == 1
    text = (tmp_path / "results" / "results.md").read_text()
    assert "CRASHED" in text and "runs finished: 1 of 2" in text
    assert "**FAILS**" in text  # no result on seed 2: the claim is not shown there


def test_missing_metric_fails_the_claim(tmp_path):
    lines = ["a | A | s | eval/x | >= 0 | eval/y >= 0"]
    proc = aggregate(make_folder(tmp_path, lines, {"a": {1: {"eval/x": 1.0}, 2: {"eval/x": 1.0}}}))
    assert proc.returncode == 1 and "**FAILS**" in (tmp_path / "results" / "results.md").read_text()


def test_malformed_check_is_a_clear_error_naming_the_line(tmp_path):
    for check, message in [
        ("eval/x >>= 3", "cannot parse"),
        ("eval/x + 3", "not a comparison"),
        ("eval/x / 2 > 3", "Div is not allowed"),
        ("__import__('os') > eval/x", "not allowed"),
        ("3 > 2", "names no metric"),
    ]:
        lines = ["ok | fine | s | eval/x | - | eval/x >= 0", f"bad | broken | s | eval/x | - | {check}"]
        proc = aggregate(make_folder(tmp_path / check.replace("/", "_"), lines, {"ok": {1: {"eval/x": 1.0}}}))
        assert proc.returncode == 2, (check, proc.stdout, proc.stderr)
        assert "experiments.txt line 3" in proc.stderr and message in proc.stderr, (check, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1  # one line, no traceback
    lines = ["bad | five fields only | s | eval/x | -"]
    proc = aggregate(make_folder(tmp_path / "fields", lines, {}))
    assert proc.returncode == 2 and "needs 6" in proc.stderr


def test_unknown_experiment_is_an_error_before_a_run_and_not_checked_in_a_folder(tmp_path):
    lines = ["ok | fine | s | eval/x | - | eval/x >= 0", "cmp | compared | s | eval/x | - | eval/x > nothere:eval/x"]
    source = (ROOT / "benchmark.sh").read_text()
    agg_py = source.split("AGG_PY=$(cat <<'PY'\n", 1)[1].split("\nPY\n)", 1)[0]
    spec = tmp_path / "lines.txt"
    spec.write_text("".join(f"quick: {line}\n" for line in lines))
    proc = subprocess.run([sys.executable, "-c", agg_py, "validate", str(spec)], capture_output=True, text=True)
    assert proc.returncode == 2 and "experiment line 2 (id cmp)" in proc.stderr
    assert "unknown experiment 'nothere'" in proc.stderr  # a typo stops benchmark.sh before any run
    # in a results folder it is an experiment that --only left out: the claim is not checked, the rest is
    metrics = {"ok": {1: {"eval/x": 1.0}}, "cmp": {1: {"eval/x": 2.0}}}
    proc = aggregate(make_folder(tmp_path / "folder", lines, metrics, seeds=(1,)))
    text = (tmp_path / "folder" / "results" / "results.md").read_text()
    assert proc.returncode == 0, proc.stderr
    assert "claims holding: 1 of 1** (1 not checked" in text and "not checked: nothere not run" in text


def test_every_experiment_line_of_benchmark_sh_parses():
    proc = subprocess.run(["bash", str(ROOT / "benchmark.sh"), "--validate"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "parses" in proc.stdout


def test_bad_usage_is_a_one_line_error():
    for args in (["--seeds", "one"], ["--jobs", "0"], ["--nonsense"]):
        proc = subprocess.run(["bash", str(ROOT / "benchmark.sh"), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
