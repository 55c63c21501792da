"""benchmark.sh's fingerprints and drawn report seeds. A line's fingerprint is what its code computes (a tiny run's
numbers): an edit that computes the same numbers keeps it, one that does not changes it, and docs/fingerprints.json
holds what the code as it is computes. Report seeds are drawn per group of lines compared on the same seed, from
their fingerprints and checks; --check-published fails on a published fingerprint or seed list that HEAD would not
give. Runs benchmark.sh on copies of the repository (a tiny run of a few seconds per fingerprint)."""

import json
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT
from test_benchmark import AGG_PY, FAKE_SCRIPT


def agg() -> dict:
    """benchmark.sh's Python (AGG_PY) as a namespace of functions."""
    namespace = {"__name__": "agg"}
    exec(AGG_PY, namespace)
    return namespace


def tables(tmp_path: Path, tree: Path = ROOT) -> tuple[Path, Path]:
    """benchmark.sh's experiment lines (as run) and FINGERPRINT_TABLE, written out as benchmark.sh does."""
    proc = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^EXPERIMENTS=/,/^AGG_PY=/p" {tree / "benchmark.sh"} | sed \'$d\'); '
         f'printf "%s\\n" "$EXPERIMENTS" | grep -v "^\\s*$" > {tmp_path}/lines; '
         f'printf "%s\\n" "$FINGERPRINT_TABLE" > {tmp_path}/fingerprint'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "lines", tmp_path / "fingerprint"


def copy_tree(tmp_path: Path) -> Path:
    """benchmark.sh, algos/, envs/ and docs/, as in the repository."""
    tree = tmp_path / "tree"
    tree.mkdir(parents=True)
    shutil.copy(ROOT / "benchmark.sh", tree / "benchmark.sh")
    for name in ("algos", "envs", "docs"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def bench(tree: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(tree / "benchmark.sh"), *args], cwd=tree, capture_output=True, text=True, timeout=timeout
    )


def fingerprint_of(tree: Path, exp_id: str) -> dict:
    proc = bench(tree, "--fingerprint", "--only", f"^{exp_id}$", "--jobs", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tree / "docs" / "fingerprints.json").read_text())["lines"][exp_id] | {"out": proc.stdout}


def edit(path: Path, old: str, new: str):
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_a_fingerprint_changes_with_the_numbers_and_only_with_them(tmp_path):
    tree = copy_tree(tmp_path)
    committed = json.loads((ROOT / "docs" / "fingerprints.json").read_text())["lines"]["ppo_line_none"]
    (tree / "docs" / "fingerprints.json").unlink()  # computed here from scratch: the committed one is what it computes
    first = fingerprint_of(tree, "ppo_line_none")
    assert first["key"] == committed["key"] and first["fingerprint"] == committed["fingerprint"], first
    script = tree / "algos" / "ppo_recurrent.py"
    # comments, docstrings and formatting: the same code key, nothing rerun
    script.write_text("# a comment\n" + script.read_text().replace('"""', '"""An edited docstring. ', 1))
    again = fingerprint_of(tree, "ppo_line_none")
    assert again["key"] == first["key"] and "tiny runs" not in again["out"], again
    # a refactor that computes the same numbers: another key, the same fingerprint
    edit(script, "    clip_coef: float = 0.2\n", "    clip_coef: float = 0.1 + 0.1\n")
    refactor = fingerprint_of(tree, "ppo_line_none")
    assert refactor["key"] != first["key"] and refactor["fingerprint"] == first["fingerprint"], refactor
    assert "ppo_line_none: code changed, fingerprint the same" in refactor["out"]
    # an edit that changes the numbers: another fingerprint
    edit(script, "    clip_coef: float = 0.1 + 0.1\n", "    clip_coef: float = 0.19\n")
    changed = fingerprint_of(tree, "ppo_line_none")
    assert changed["fingerprint"] != first["fingerprint"], changed
    assert "ppo_line_none: code changed, fingerprint CHANGED" in changed["out"]


def test_the_fingerprint_ignores_timings_and_hashes_rounded_values():
    a = agg()
    assert all(a["TIMING_RE"].search(t) for t in ("charts/SPS", "perf/learner_ms_per_update", "wall_time_s"))
    for kept in ("eval/episodic_return", "timestep/rl_steps_per_dialogue", "losses/value_loss", "charts/sps_free"):
        assert not a["TIMING_RE"].search(kept) or kept == "charts/sps_free", kept
    assert a["rounded"]({"x": [0.1234567891, 2, float("nan")]}) == {"x": ["0.123457", 2, "nan"]}


def test_report_seeds_are_drawn_per_group_of_lines_compared_on_a_seed(tmp_path):
    a = agg()
    lines, table = tables(tmp_path)
    experiments = a["read_benchmark_lines"](lines)
    groups = a["seed_groups"](experiments)
    assert groups["cql_utterance"] == groups["ilql"] == ["cql_utterance", "ilql", "ilql_filtered_bc"]
    assert "rlhf_kl_sweep0.1" in groups["rlhf_kl_sweep0.0"] and "ppo_cartpole_none" in groups["ppo_cartpole_lstm"]
    assert groups["ppo_tmaze_none"] == ["ppo_tmaze_gru", "ppo_tmaze_none"]  # a negative control with its pair
    fps = {e["id"]: "f" + e["id"] for e in experiments}
    seeds = a["drawn_seeds"](experiments, fps, groups["ilql"], 5)
    assert len(set(seeds)) == 5 and all(1000 <= s <= 9999 for s in seeds), seeds
    assert a["drawn_seeds"](experiments, fps, groups["ilql"], 3) == seeds[:3]  # fewer seeds: the first of the draw
    assert a["drawn_seeds"](experiments, fps, groups["ppo_tmaze_gru"], 5) != seeds  # another group, another draw
    assert a["drawn_seeds"](experiments, fps | {"ilql": "other"}, groups["ilql"], 5) != seeds  # new code, new seeds
    changed = [e | {"check_as_written": e["check_as_written"] + " "} if e["id"] == "cql_utterance" else e
               for e in experiments]  # fmt: skip
    assert a["drawn_seeds"](changed, fps, groups["ilql"], 5) != seeds  # a changed bar, new seeds


def published_tree(tmp_path: Path) -> tuple[Path, dict, dict]:
    """A copy of the repository whose results.json publishes ppo_line_none with its fingerprint and drawn seeds."""
    tree = copy_tree(tmp_path)
    a = agg()
    lines, _ = tables(tmp_path)
    experiments = a["read_benchmark_lines"](lines)
    fps = {
        i: v["fingerprint"] for i, v in json.loads((ROOT / "docs" / "fingerprints.json").read_text())["lines"].items()
    }
    drawn = a["drawn_seeds"](experiments, fps, a["seed_groups"](experiments)["ppo_line_none"], 5)
    data = json.loads((tree / "docs" / "results.json").read_text())
    for claim in data["claims"]:
        if claim["id"] == "ppo_line_none":
            claim.update(fingerprint=fps["ppo_line_none"], seeds=drawn)
    return tree, data, {"fps": fps, "drawn": drawn, "agg": a}


def publish_json(tree: Path, data: dict, a: dict):
    (tree / "docs" / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (tree / "docs" / "results.md").write_text(a["render_page"](data))
    for h in data["headlines"]:  # the script pages' results blocks
        page = tree / "docs" / f"{h['script']}.md"
        page.write_text(a["page_with_results"](page.read_text(), data, h["script"]))


def stale(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("benchmark.sh: stale: ")]


def test_check_published_fails_on_a_fingerprint_or_seeds_that_head_would_not_give(tmp_path):
    tree, data, got = published_tree(tmp_path)
    publish_json(tree, data, got["agg"])
    proc = bench(tree, "--check-published")
    assert proc.returncode == 0, proc.stderr
    assert "54 published experiments carry no fingerprint" in proc.stdout  # ppo_line_none carries one
    assert "experiments with a fingerprint: 1 of" in (tree / "docs" / "results.md").read_text()
    for change, reason in (
        ({"fingerprint": "0123456789abcdef"}, "published from code whose fingerprint is 0123456789abcdef"),
        ({"seeds": [1, 2, 3, 4, 5]}, "was published on seeds [1, 2, 3, 4, 5], not its drawn report seeds"),
    ):
        wrong = json.loads(json.dumps(data))
        for claim in wrong["claims"]:
            if claim["id"] == "ppo_line_none":
                claim.update(change)
        publish_json(tree, wrong, got["agg"])
        proc = bench(tree, "--check-published")
        assert proc.returncode == 1 and len(stale(proc)) == 1 and reason in stale(proc)[0], proc.stderr
    # the code changed without --fingerprint: docs/fingerprints.json no longer says what it computes
    publish_json(tree, data, got["agg"])
    edit(tree / "algos" / "ppo_recurrent.py", "    clip_coef: float = 0.2\n", "    clip_coef: float = 0.19\n")
    proc = bench(tree, "--check-published")
    assert proc.returncode == 1 and "lacks the fingerprints of the code as it is for ppo_line_none" in proc.stderr


def test_a_drawn_report_run_runs_each_group_on_its_seeds_from_committed_code(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "envs", tree / "envs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "algos", tree / "algos", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "algos" / "fake.py").write_text(FAKE_SCRIPT)
    text = (ROOT / "benchmark.sh").read_text()
    lines = (
        "quick: fake_base | the base | fake --value 5 | eval/x | 5 | eval/x >= 5\n"
        "quick: fake_child | the child | fake --read {run:fake_base} | eval/x | 6 | eval/x > fake_base:eval/x\n"
        "quick: fake_alone | alone | fake --value 7 | eval/x | 7 | eval/x >= 7\n"
    )
    for table, row in (
        ("EXPERIMENTS", lines),
        ("UNTRAINED_TABLE", "fake | --value 0 | -\n"),
        ("HEADLINES", "fake | fake_child | eval/x | -\n"),
        ("FINGERPRINT_TABLE", "fake | --sleep 0\n"),
    ):
        text = text.replace(f"{table}=$(cat <<'EOF'\n", f"{table}=$(cat <<'EOF'\n{row}", 1)  # fmt: skip
    (tree / "benchmark.sh").write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tree)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    proc = bench(tree, "--quick", "--only", "^fake_", "--seeds", "drawn:2", "--jobs", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = next((tree / "results").iterdir())
    seeds = {line.split()[0]: line.split()[1:] for line in (out / "seeds.txt").read_text().splitlines()}
    assert seeds["fake_base"] == seeds["fake_child"] != seeds["fake_alone"] and len(seeds["fake_alone"]) == 2
    for exp_id, got in seeds.items():
        assert sorted(p.name for p in (out / "runs" / exp_id).iterdir()) == sorted(f"seed{s}" for s in got)
        assert all(1000 <= int(s) <= 9999 for s in got)
    fps = json.loads((out / "fingerprints.json").read_text())
    assert set(fps) == {"fake_base", "fake_child", "fake_alone"} and "claims holding: 3 of 3" in proc.stdout
    (tree / "algos" / "fake.py").write_text(FAKE_SCRIPT + "# edited\n")  # uncommitted code: no report run
    proc = bench(tree, "--quick", "--only", "^fake_", "--seeds", "drawn")
    assert proc.returncode == 2 and "commit algos/, envs/ and benchmark.sh first" in proc.stderr
