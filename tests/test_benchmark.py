"""benchmark.sh's claim checks: a failing prediction is reported as failing (and the exit status says so), a crashed
run is reported apart from the claims, a malformed check is a clear error naming its line, and every experiment line
of benchmark.sh itself parses. Runs `bash benchmark.sh --aggregate` on hand-made results folders (no training)."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

HEADER = "# id | claim | command | metrics | prediction | check"


def make_folder(tmp_path: Path, lines: list[str], metrics: dict, seeds=(1, 2), crashed=(), untrained=False) -> Path:
    """A results folder as benchmark.sh writes it; metrics: {exp_id: {seed: {metric: value}}}."""
    out = tmp_path / "results"
    (out / "runs").mkdir(parents=True)
    (out / "experiments.txt").write_text("\n".join([HEADER, *lines]) + "\n")
    meta = {"seeds": " ".join(map(str, seeds)), "argv": "--quick", "untrained": "1" if untrained else "0"}
    (out / "meta.json").write_text(json.dumps(meta))
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


AGG_PY = (ROOT / "benchmark.sh").read_text().split("AGG_PY=$(cat <<'PY'\n", 1)[1].split("\nPY\n)", 1)[0]


def validate(tmp_path: Path, lines: list[str], untrained_table: str | None = None) -> subprocess.CompletedProcess:
    """The validation benchmark.sh runs before anything: `quick:` lines (and the --untrained table if given)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = tmp_path / "lines.txt"
    spec.write_text("".join(f"quick: {line}\n" for line in lines))
    extra = []
    if untrained_table is not None:
        (tmp_path / "untrained.txt").write_text(untrained_table)
        extra = [str(tmp_path / "untrained.txt")]
    cmd = [sys.executable, "-c", AGG_PY, "validate", str(spec), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_lines_sharing_an_id_must_share_the_command(tmp_path):
    same = [
        "a | A | s --x 1 | eval/x | - | eval/x >= 0",
        "b | B | s --x 2 | eval/x | - | eval/x >= 0",
        "a | A again | s --x 1 | eval/y | - | eval/y >= 0",
    ]
    assert validate(tmp_path / "same", same).returncode == 0
    differ = [*same[:2], "a | A again | s --x 3 | eval/y | - | eval/y >= 0"]  # only line 1's command would run
    proc = validate(tmp_path / "differ", differ)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "experiment line 3 (id a)" in proc.stderr and "experiment line 1" in proc.stderr
    assert "another command" in proc.stderr


def test_a_negative_control_must_pair_with_a_positive_claim_on_the_same_task(tmp_path):
    gru = "gru | memory solves it | s --env-id T --rnn gru | eval/x | 1 | eval/x >= 0.9"
    cases = [  # (the negative control's line, the error it gets or None)
        ("none | memoryless at chance | s --env-id T | eval/x | 0.5 | negative(gru): eval/x <= 0.6", None),
        ("none | at chance | s --env-id T | eval/x | 0.5 | negative(nothere): eval/x <= 0.6", "without a pair"),
        ("none | at chance | s --env-id T | eval/x | 0.5 | negative(): eval/x <= 0.6", "must name the experiment"),
        ("none | at chance | s --env-id U | eval/x | 0.5 | negative(gru): eval/x <= 0.6", "same task"),
        ("none | at chance | s --env-id T | eval/x | 0.5 | negative(gru): info", "empty check"),
        ("none | at chance | s --env-id T | eval/x | 0.5 | negative(gru):", "empty check"),
    ]
    for n, (line, message) in enumerate(cases):
        proc = validate(tmp_path / str(n), [gru, line])
        if message is None:
            assert proc.returncode == 0, proc.stderr
        else:
            assert proc.returncode == 2 and message in proc.stderr, (line, proc.stderr)
            assert "experiment line 2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    # its pair must be a positive claim: another negative control or an info row is no pair
    for pair in [
        "gru | anchor | s --env-id T | eval/x | 1 | info",
        "gru | also at chance | s --env-id T | eval/x | 0.5 | negative(none): eval/x <= 0.6",
    ]:
        line = "none | at chance | s --env-id T | eval/x | 0.5 | negative(gru): eval/x <= 0.6"
        proc = validate(tmp_path / "pair", [pair, line])
        assert proc.returncode == 2 and "without a pair" in proc.stderr, proc.stderr


def test_every_script_needs_an_untrained_row(tmp_path):
    lines = ["a | A | s1 --x 1 | eval/x | - | eval/x >= 0", "b | B | s2 | eval/x | - | eval/x >= 0"]
    assert validate(tmp_path / "ok", lines, "s1 | --steps 0 | nothing\ns2 | --epochs 0 | nothing\n").returncode == 0
    proc = validate(tmp_path / "missing", lines, "s1 | --steps 0 | nothing\n")
    assert proc.returncode == 2 and "script 's2' has no UNTRAINED_TABLE row" in proc.stderr
    proc = validate(tmp_path / "bad", lines, "s1 | --steps 0\ns2 | --epochs 0 | nothing\n")
    assert proc.returncode == 2 and "UNTRAINED_TABLE line 1" in proc.stderr


UNTRAINED_LINES = [
    "gru | GRU solves it | s --env-id T | eval/success_rate | 1 | eval/success_rate >= 0.9",
    "none | memoryless at chance | s --env-id T | eval/success_rate | 0.5 | negative(gru): eval/success_rate <= 0.6",
    "line | p(right) is 1/2 | s --env-id L | eval/p | 0.5 | 0.4 <= eval/p <= 0.6",
    "cmp | A beats B by 2 | s --env-id L | eval/r | - | eval/r >= 2 + gru:eval/success_rate ; eval/r >= 0",
    "mean | ordering on the means | s --env-id L | eval/q | - | eval/q >= 0 ; mean: eval/q > 1",
    "anchor | the data's size | s | data/n | 7 | info",
]


def untrained_metrics(**override):
    """Untrained values: GRU and memoryless both at chance, p(right) 1/2 (holds untrained), cmp fails on its first
    condition but not its second, mean fails only on the means."""
    metrics = {
        "gru": {1: {"eval/success_rate": 0.5}, 2: {"eval/success_rate": 0.45}},
        "none": {1: {"eval/success_rate": 0.5}, 2: {"eval/success_rate": 0.55}},
        "line": {1: {"eval/p": 0.5}, 2: {"eval/p": 0.55}},
        "cmp": {1: {"eval/r": 0.3}, 2: {"eval/r": 0.2}},
        "mean": {1: {"eval/q": 0.5}, 2: {"eval/q": 1.0}},
        "anchor": {1: {"data/n": 7.0}, 2: {"data/n": 7.0}},
    }
    for exp_id, per_seed in override.items():
        metrics[exp_id] = per_seed
    return metrics


def rows_of(text: str, start: str) -> list[str]:
    """The list items of the results.md section whose title starts with `start`."""
    section = text.split(f"### {start}", 1)[1].split("\n#", 1)[0]
    return [line for line in section.splitlines() if line.startswith("- #")]


def test_untrained_counts_positive_claims_failing_and_lists_those_that_cannot_fail(tmp_path):
    proc = aggregate(make_folder(tmp_path, UNTRAINED_LINES, untrained_metrics(), untrained=True))
    text = (tmp_path / "results" / "results.md").read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a positive claim holds untrained
    # positive: gru, line, cmp, mean (the negative control and the info row are left out of Y)
    head = text.splitlines()[2]
    assert "positive claims failing untrained: 3 of 4" in head, head
    assert "holding untrained (cannot fail): 1" in head and "errors (nothing to judge): 0" in head
    assert "left out: 1 negative controls, 1 info rows" in head and "runs finished: 12 of 12" in head
    assert "positive claims failing untrained: 3 of 4" in proc.stdout  # printed too
    holds = rows_of(text, "Positive claims that hold untrained")
    assert len(holds) == 1 and holds[0].startswith("- #3 line:") and "cannot fail" in holds[0]
    fails = rows_of(text, "Positive claims that fail untrained")
    assert [row.split(":")[0] for row in fails] == ["- #1 gru", "- #4 cmp", "- #5 mean"]
    cmp_row = next(row for row in fails if row.startswith("- #4"))
    assert "holding untrained anyway: `eval/r >= 0`" in cmp_row  # the condition that cannot fail, named
    mean_row = next(row for row in fails if row.startswith("- #5"))
    assert "holding untrained anyway: `eval/q >= 0`" in mean_row  # fails on the mean condition only
    negative = rows_of(text, "Negative controls")
    assert len(negative) == 1 and "pairs with gru: fails untrained" in negative[0] and "holds untrained" in negative[0]
    assert "#6 anchor" in rows_of(text, "Info rows")[0]
    # the normal claims table is still there, with the trained-run verdict and the untrained one per row
    table_row = next(line for line in text.splitlines() if line.startswith("| 2 |"))
    assert "negative control (pairs with gru)" in table_row and "holds 2/2 seeds" in table_row
    assert not list((tmp_path / "results").glob("*.png"))  # no figures of learning


def test_untrained_exits_zero_only_when_every_positive_claim_fails(tmp_path):
    line_fails = {1: {"eval/p": 0.9}, 2: {"eval/p": 0.1}}
    mean_fails_everywhere = {1: {"eval/q": -1.0}, 2: {"eval/q": 0.5}}
    metrics = untrained_metrics(line=line_fails, mean=mean_fails_everywhere)
    proc = aggregate(make_folder(tmp_path / "ok", UNTRAINED_LINES, metrics, untrained=True))
    text = (tmp_path / "ok" / "results" / "results.md").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "positive claims failing untrained: 4 of 4" in text and "### Positive claims that hold" not in text
    # holding on one seed of two is enough to be unable to fail
    metrics = untrained_metrics(line={1: {"eval/p": 0.9}, 2: {"eval/p": 0.5}}, mean=mean_fails_everywhere)
    proc = aggregate(make_folder(tmp_path / "one", UNTRAINED_LINES, metrics, untrained=True))
    text = (tmp_path / "one" / "results" / "results.md").read_text()
    assert proc.returncode == 1 and "positive claims failing untrained: 3 of 4" in text
    assert "holds untrained on seed 2: cannot fail" in rows_of(text, "Positive claims that hold untrained")[0]


def test_untrained_crash_or_missing_metric_is_an_error_not_a_failure(tmp_path):
    # every run finished and every other positive claim fails, but one metric is missing: an error, exit 1
    metrics = untrained_metrics(
        line={1: {"eval/p": 0.9}, 2: {"eval/p": 0.1}}, mean={1: {"eval/q": -1.0}, 2: {"eval/q": -1.0}}
    )
    metrics["cmp"][2] = {"eval/other": 1.0}
    proc = aggregate(make_folder(tmp_path / "missing", UNTRAINED_LINES, metrics, untrained=True))
    text = (tmp_path / "missing" / "results" / "results.md").read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "positive claims failing untrained: 3 of 4" in text and "errors (nothing to judge): 1" in text
    assert "runs finished: 12 of 12" in text and "seed 2: eval/r" in rows_of(text, "Errors")[0]
    metrics = untrained_metrics(line={1: {"eval/p": 0.9}, 2: {"eval/p": 0.1}}, mean={1: {"eval/q": -1.0}})
    metrics["cmp"] = {1: {"eval/other": 1.0}, 2: {"eval/other": 1.0}}  # the run did not write eval/r
    out = make_folder(tmp_path, UNTRAINED_LINES, metrics, crashed=[("mean", 2)], untrained=True)
    proc = aggregate(out)
    text = (out / "results.md").read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "positive claims failing untrained: 2 of 4" in text and "errors (nothing to judge): 2" in text
    assert "runs finished: 11 of 12" in text
    errors = rows_of(text, "Errors")
    assert [row.split(":")[0] for row in errors] == ["- #4 cmp", "- #5 mean"]
    assert "seed 1: eval/r" in errors[0] and "seed 2: eval/q" in errors[1] and "CRASHED" in text
    # a crashed pair makes its negative control's pair state an error, not a failure
    metrics = untrained_metrics(line={1: {"eval/p": 0.9}, 2: {"eval/p": 0.1}}, gru={1: {"eval/success_rate": 0.5}})
    out = make_folder(tmp_path / "pair", UNTRAINED_LINES, metrics, crashed=[("gru", 2)], untrained=True)
    proc = aggregate(out)
    text = (out / "results.md").read_text()
    assert proc.returncode == 1 and "pairs with gru: error untrained" in rows_of(text, "Negative controls")[0]


def test_every_experiment_line_of_benchmark_sh_parses():
    proc = subprocess.run(["bash", str(ROOT / "benchmark.sh"), "--validate"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "parses" in proc.stdout


def test_bad_usage_is_a_one_line_error():
    for args in (["--seeds", "one"], ["--jobs", "0"], ["--nonsense"], ["--publish"], ["--publish", "no/such/folder"]):
        proc = subprocess.run(["bash", str(ROOT / "benchmark.sh"), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)


def test_a_consistency_check_is_judged_when_trained_and_left_out_untrained(tmp_path):
    line = "curve | the training curve agrees with the evaluation | s --env-id T | eval/r | close | consistency: abs(charts/late - eval/r) <= 0.5"  # noqa: E501
    agree, apart = {1: {"charts/late": 1.2, "eval/r": 1.0}}, {1: {"charts/late": 2.0, "eval/r": 1.0}}
    proc = aggregate(make_folder(tmp_path / "agree", [line], {"curve": agree}, seeds=(1,)))
    assert proc.returncode == 0 and "claims holding: 1 of 1" in proc.stdout, proc.stdout + proc.stderr
    proc = aggregate(make_folder(tmp_path / "apart", [line], {"curve": apart}, seeds=(1,)))
    assert proc.returncode == 1 and "claims holding: 0 of 1" in proc.stdout, proc.stdout + proc.stderr
    # untrained: no training curve, so nothing to judge; left out with its reason, neither an error nor a claim
    lines = [*UNTRAINED_LINES, line]
    metrics = untrained_metrics(
        line={1: {"eval/p": 0.9}, 2: {"eval/p": 0.1}}, mean={1: {"eval/q": -1.0}, 2: {"eval/q": 0.5}}
    )
    metrics["curve"] = {1: {"eval/r": 1.0}, 2: {"eval/r": 1.0}}
    proc = aggregate(make_folder(tmp_path / "untrained", lines, metrics, untrained=True))
    text = (tmp_path / "untrained" / "results" / "results.md").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "positive claims failing untrained: 4 of 4" in text and "errors (nothing to judge): 0" in text
    assert "1 consistency checks" in text.splitlines()[2]
    assert "no training curve" in rows_of(text, "Consistency checks")[0]
    proc = validate(tmp_path, [line.replace("consistency: abs(charts/late - eval/r) <= 0.5", "consistency: info")])
    assert proc.returncode == 2 and "empty check" in proc.stdout + proc.stderr


FAKE_SCRIPT = '''"""A training script's stand-in: eval/x = --value + seed, or 1 + the eval/x of the run dir --read."""
import argparse, json, sys, time
from pathlib import Path

p = argparse.ArgumentParser()
for flag in ("--seed", "--runs-dir", "--exp-name", "--read"):
    p.add_argument(flag)
p.add_argument("--value", type=float, default=1.0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--crash", action="store_true")
a = p.parse_args()
time.sleep(a.sleep)
if a.crash:
    sys.exit(3)
x = a.value + int(a.seed)
if a.read:
    x = json.loads((Path(a.read) / "summary.json").read_text())["metrics"]["eval/x"] + 1
run_dir = Path(a.runs_dir) / f"run{a.seed}"
run_dir.mkdir(parents=True)
summary = {"script": "fake", "run_dir": str(run_dir), "args": {"seed": int(a.seed)}, "metrics": {"eval/x": x}}
(run_dir / "summary.json").write_text(json.dumps(summary))
'''


def fake_benchmark(tmp_path: Path, base_args: str) -> Path:
    """A copy of benchmark.sh with two more quick lines run by algos/fake.py: fake_base, and fake_child, which reads
    fake_base's run dir of its seed through `{run:fake_base}`."""
    text = (ROOT / "benchmark.sh").read_text()
    lines = (
        f"quick: fake_base | the base | fake {base_args} | eval/x | 5 | eval/x >= 5\n"
        "quick: fake_child | reads the base's run | fake --read {run:fake_base} | eval/x | 6 | "
        "eval/x >= 6 ; eval/x > fake_base:eval/x\n"
    )
    text = text.replace("EXPERIMENTS=$(cat <<'EOF'\n", "EXPERIMENTS=$(cat <<'EOF'\n" + lines, 1)
    text = text.replace("UNTRAINED_TABLE=$(cat <<'EOF'\n", "UNTRAINED_TABLE=$(cat <<'EOF'\nfake | --value 0 | -\n", 1)
    text = text.replace("HEADLINES=$(cat <<'EOF'\n", "HEADLINES=$(cat <<'EOF'\nfake | fake_child | eval/x | -\n", 1)
    text = text.replace("FINGERPRINT_TABLE=$(cat <<'EOF'\n", "FINGERPRINT_TABLE=$(cat <<'EOF'\nfake | --sleep 0\n", 1)
    (tmp_path / "algos").mkdir(parents=True)
    for script in (ROOT / "algos").glob("*.py"):  # the real lines' keys read their scripts
        (tmp_path / "algos" / script.name).symlink_to(script)
    (tmp_path / "algos" / "fake.py").write_text(FAKE_SCRIPT)
    (tmp_path / "benchmark.sh").write_text(text)
    return tmp_path / "benchmark.sh"


def test_a_command_reads_an_earlier_experiments_run_dir_of_the_same_seed(tmp_path):
    # validation: {run:X} must name an experiment of an earlier line (it runs, and so ends, first)
    good = ["a | A | s | eval/x | - | eval/x >= 0", "b | B | s {run:a}/m | eval/x | - | info"]
    assert validate(tmp_path / "ok", good).returncode == 0
    for lines in (
        ["b | B | s {run:a}/m | eval/x | - | info", "a | A | s | eval/x | - | eval/x >= 0"],
        ["a | A | s {run:a} | eval/x | - | eval/x >= 0"],
    ):
        proc = validate(tmp_path / "bad", lines)
        assert proc.returncode == 2 and "{run:a} names no experiment of an earlier line" in proc.stderr, proc.stderr
    # two seeds, three runs at a time: the child of seed 1 starts beside the two bases; it waits for its own seed's
    script = fake_benchmark(tmp_path / "good", "--value 5 --sleep 1")
    run = ["bash", str(script), "--quick", "--only", "^fake_", "--seeds", "1 2", "--jobs", "3"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = next((tmp_path / "good" / "results").iterdir())
    for seed in (1, 2):
        child = json.loads(next((out / "runs" / "fake_child" / f"seed{seed}").glob("*/summary.json")).read_text())
        assert child["metrics"]["eval/x"] == 5 + seed + 1
    assert "python algos/fake.py --read '<run dir of fake_base>'" in (out / "results.md").read_text()
    # --only without the experiment a command reads: a one-line error before any run
    proc = subprocess.run([*run[:4], "^fake_child$"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "reads the runs of fake_base" in proc.stderr and "select it too" in proc.stderr
    # the base crashed: the child is reported crashed, not run
    script = fake_benchmark(tmp_path / "crash", "--crash")
    proc = subprocess.run(["bash", str(script), *run[2:]], capture_output=True, text=True, timeout=300)
    out = next((tmp_path / "crash" / "results").iterdir())
    assert proc.returncode == 1 and "fake_child seed=1 CRASHED" in (out / "log.txt").read_text()
    assert "did not finish" in (out / "logs" / "fake_child_seed1.log").read_text()
