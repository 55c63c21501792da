"""docs/results.md and docs/results.json, written by `benchmark.sh --publish`, carry every claim line of benchmark.sh
as it is (id, command after the *_ARGS substitution, check): `benchmark.sh --check-published` says so, and fails with
one line per reason when a claim line is edited, added or removed, or the page is edited by hand. Runs the tools on
copies of benchmark.sh and of the published files, and publishes hand-made results folders (no training)."""

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT
from test_benchmark import make_folder

BEGIN = "<!-- BEGIN results table: written by benchmark.sh --publish -->"
END = "<!-- END results table -->"
PAGE_BEGIN = "<!-- BEGIN results: written by benchmark.sh --publish -->"
SCRIPTS = sorted(path.stem for path in (ROOT / "algos").glob("*.py"))


def run(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(tree / "benchmark.sh"), *args], cwd=tree, capture_output=True, text=True, timeout=120
    )


def stale(proc: subprocess.CompletedProcess) -> list[str]:
    prefix = "benchmark.sh: stale: "
    return [line.removeprefix(prefix) for line in proc.stderr.splitlines() if line.startswith(prefix)]


def copy_tree(tmp_path: Path) -> Path:
    """benchmark.sh, the published page and the fingerprints, as in the repository (algos/ and envs/ linked: the
    fingerprints' keys read them)."""
    tree = tmp_path / "tree"
    (tree / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "benchmark.sh", tree / "benchmark.sh")
    for name in ("results.md", "results.json", "fingerprints.json", *(f"{s}.md" for s in SCRIPTS)):
        shutil.copy(ROOT / "docs" / name, tree / "docs" / name)
    for name in ("algos", "envs"):
        (tree / name).symlink_to(ROOT / name)
    return tree


def edit(tree: Path, old: str, new: str):
    text = (tree / "benchmark.sh").read_text()
    assert text.count(old) == 1, old
    (tree / "benchmark.sh").write_text(text.replace(old, new))


def experiment_line(tree: Path, exp_id: str) -> str:
    """The first experiment line of benchmark.sh with this id."""
    return next(
        line
        for line in (tree / "benchmark.sh").read_text().splitlines()
        if line.startswith((f"quick: {exp_id} |", f"full: {exp_id} |"))
    )


def test_the_published_page_carries_every_claim_line_of_benchmark_sh():
    proc = run(ROOT, "--check-published")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((ROOT / "docs" / "results.json").read_text())
    page = (ROOT / "docs" / "results.md").read_text()
    ids = list(dict.fromkeys(claim["id"] for claim in data["claims"]))
    assert all(page.count(f'<a id="{exp_id}"></a>') == 1 for exp_id in ids)  # one anchor per id
    assert all(claim["check"] and claim["command"] for claim in data["claims"])
    for row in data["headlines"]:  # README's headline of a script that ran has its values
        assert not row["folder"] or len(row["values"][row["metric"]]) == len(row["seeds"]), row
    for figure in data["figures"]:  # a figure the page shows is in docs/figures/
        assert not figure["folder"] or (ROOT / "docs" / "figures" / f"{figure['name']}.png").is_file()


def test_an_edited_check_is_stale(tmp_path):
    tree = copy_tree(tmp_path)
    assert run(tree, "--check-published").returncode == 0
    edit(tree, "eval/episodic_length <= 2.3", "eval/episodic_length <= 2.4")
    proc = run(tree, "--check-published")
    reasons = stale(proc)
    assert proc.returncode == 1 and len(reasons) == 2, proc.stderr  # the new line missing, the old one left over
    assert "(id ppo_line_none) is not on the published page" in reasons[0] and "<= 2.4" in reasons[0]
    assert "published claim of id ppo_line_none" in reasons[1] and "<= 2.3" in reasons[1]


def test_an_added_or_removed_line_is_stale(tmp_path):
    tree = copy_tree(tmp_path)
    line = experiment_line(tree, "ppo_line_gru")
    edit(tree, line, line + "\n" + line.replace("ppo_line_gru |", "ppo_line_gru_copy |"))
    reasons = stale(run(tree, "--check-published"))
    assert len(reasons) == 2 and "(id ppo_line_gru_copy) is not on the published page" in reasons[0], reasons
    assert "fingerprints.json lacks the fingerprints of the code as it is for ppo_line_gru_copy " in reasons[1]
    tree = copy_tree(tmp_path / "removed")
    edit(tree, experiment_line(tree, "ppo_cartpole_v1") + "\n", "")
    reasons = stale(run(tree, "--check-published"))
    assert len(reasons) == 1 and "published claim of id ppo_cartpole_v1:" in reasons[0], reasons


def test_a_changed_command_is_stale_also_through_a_substituted_args_variable(tmp_path):
    tree = copy_tree(tmp_path)
    edit(tree, 'PPO_CARTPOLE_ARGS="--num-envs 8 ', 'PPO_CARTPOLE_ARGS="--num-envs 16 ')
    reasons = stale(run(tree, "--check-published"))
    users = [line for line in (ROOT / "benchmark.sh").read_text().splitlines() if "PPO_CARTPOLE_ARGS |" in line]
    assert "lacks the fingerprints of the code as it is for ppo_cartpole_gru ppo_cartpole_lstm ppo_cartpole_none" in (
        reasons.pop()  # a changed command is another key: its fingerprint is not computed yet
    )
    assert len(reasons) == 2 * len(users), reasons  # each line missing as it is now, and left over as published
    assert {re.search(r"id ([\w.]+)", r)[1] for r in reasons} == {
        "ppo_cartpole_gru",
        "ppo_cartpole_lstm",
        "ppo_cartpole_none",
    }


def test_a_hand_edited_page_or_a_missing_one_is_stale(tmp_path):
    tree = copy_tree(tmp_path)
    page = tree / "docs" / "results.md"
    page.write_text(page.read_text().replace("claims holding", "claims holding (edited)"))
    reasons = stale(run(tree, "--check-published"))
    assert len(reasons) == 1 and "docs/results.md is not what docs/results.json renders" in reasons[0], reasons
    (tree / "docs" / "results.json").unlink()
    reasons = stale(run(tree, "--check-published"))
    assert len(reasons) == 1 and "docs/results.json not found" in reasons[0]


def test_the_headline_table_must_name_an_experiment_and_a_metric_of_its_script(tmp_path):
    tree = copy_tree(tmp_path)
    edit(
        tree, "ilql_per_token | ilql | eval/episodic_return |", "ilql_per_token | ilql_nothere | eval/episodic_return |"
    )
    proc = run(tree, "--validate")
    assert (
        proc.returncode == 2 and "HEADLINES row ilql_per_token: no experiment line has id 'ilql_nothere'" in proc.stderr
    )
    tree = copy_tree(tmp_path / "metric")
    edit(tree, "ilql_per_token | ilql | eval/episodic_return |", "ilql_per_token | ilql | eval/nothere |")
    proc = run(tree, "--validate")
    assert proc.returncode == 2 and "ilql shows no metric 'eval/nothere'" in proc.stderr, proc.stderr


def published_folders(tmp_path: Path, tree: Path) -> tuple[Path, Path]:
    """A trained folder that ran ppo_cartpole_gru and ppo_cartpole_none (2 seeds) with benchmark.sh's commands, and
    an untrained control of the same runs in which the GRU claim holds (every seed and the mean)."""
    data = json.loads((tree / "docs" / "results.json").read_text())
    claims = [c for c in data["claims"] if c["id"] in ("ppo_cartpole_gru", "ppo_cartpole_none")]
    lines = [
        " | ".join([c["id"], c["claim"], c["command"], ",".join(c["metrics"]), c["prediction"], c["check"]])
        for c in claims
    ]
    trained = {
        "ppo_cartpole_gru": {
            1: {"eval/episodic_return": 500.0, "charts/late_episodic_return": 490.0},
            2: {"eval/episodic_return": 480.0, "charts/late_episodic_return": 470.0},
        },
        "ppo_cartpole_none": {1: {"eval/episodic_return": 40.0}, 2: {"eval/episodic_return": 45.0}},
    }
    untrained = {
        "ppo_cartpole_gru": {1: {"eval/episodic_return": 450.0}, 2: {"eval/episodic_return": 480.0}},
        "ppo_cartpole_none": {1: {"eval/episodic_return": 20.0}, 2: {"eval/episodic_return": 20.0}},
    }
    folders = []
    for name, metrics, is_untrained in [
        ("20260101-120000", trained, False),
        ("20260101-130000-untrained", untrained, True),
    ]:
        out = make_folder(tmp_path, lines, metrics, untrained=is_untrained).rename(tmp_path / name)
        for seed_dir in (out / "runs").glob("*/seed*/*"):
            summary = json.loads((seed_dir / "summary.json").read_text())
            (seed_dir / "summary.json").write_text(json.dumps(summary | {"wall_time_s": 90.0}))
        folders.append(out)
    (folders[0] / "maskedcartpole.png").write_bytes(b"png")
    return folders[0], folders[1]


def test_publish_writes_the_page_the_json_the_figures_and_the_readme_table(tmp_path):
    tree = copy_tree(tmp_path)
    (tree / "README.md").write_text(f"# seqrl\n\n{BEGIN}\nold table\n{END}\n\nthe rest\n")
    trained, control = published_folders(tmp_path, tree)
    assert stale(run(tree, "--check-published")) == [
        "the results table of README.md is not what docs/results.json renders"
    ]
    proc = run(tree, "--publish", str(trained), str(control))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tree / "docs" / "results.json").read_text())
    gru = next(c for c in data["claims"] if c["id"] == "ppo_cartpole_gru")
    assert gru["folder"] == trained.name and gru["values"]["eval/episodic_return"] == [500.0, 480.0]
    assert gru["status"] == "holds" and gru["wall_time_s"] == [90.0, 90.0]
    assert next(c for c in data["claims"] if c["id"] == "ppo_line_none")["status"] == "not run"
    page = (tree / "docs" / "results.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| MaskedCartPole with a GRU"))
    assert "500.000 / 480.000 · mean 490.000, range 480.000 to 500.000" in row and "holds 2/2 seeds" in row
    assert "not run in the published runs" in page and "| `20260101-120000` | 2026-01-01 12:00 |" in page
    assert "**positive claims failing untrained: 0 of 1**" in page  # the GRU claim holds untrained
    assert "ppo_cartpole_gru: MaskedCartPole with a GRU" in page.split("they cannot fail):", 1)[1]
    assert (tree / "docs" / "figures" / "maskedcartpole.png").read_bytes() == b"png"
    assert "![MaskedCartPole: PPO's memory recovers the velocities](figures/maskedcartpole.png)" in page
    ppo_page = (tree / "docs" / "ppo_recurrent.md").read_text()  # its own claims and figure, between the markers
    block = ppo_page.split(PAGE_BEGIN, 1)[1]
    assert "[ppo_cartpole_gru](results.md#ppo_cartpole_gru)" in block and "`eval/episodic_return` 490" in block
    assert "(figures/maskedcartpole.png)" in block and "dqn_cartpole" not in block
    readme = (tree / "README.md").read_text()
    assert readme.startswith("# seqrl\n\n" + BEGIN + "\n| script |") and readme.endswith(f"{END}\n\nthe rest\n")
    ppo = next(line for line in readme.splitlines() if line.startswith("| [ppo_recurrent](docs/ppo_recurrent.md)"))
    assert (
        "`eval/episodic_return` 490 (480 to 500, 2 seeds): [ppo_cartpole_gru](docs/results.md#ppo_cartpole_gru)" in ppo
    )
    assert "| 90 s | `python algos/ppo_recurrent.py --env-id seqrl/MaskedCartPole-v0 --rnn gru --num-envs 8" in ppo
    assert "fails" not in ppo  # a headline whose claim holds; one that fails says "**fails on k of n seeds**"
    assert run(tree, "--check-published").returncode == 0
    # a folder run with another command for an experiment has not run the current line
    edit(tree, 'PPO_CARTPOLE_ARGS="--num-envs 8 ', 'PPO_CARTPOLE_ARGS="--num-envs 16 ')
    assert run(tree, "--publish", str(trained)).returncode == 0
    data = json.loads((tree / "docs" / "results.json").read_text())
    assert {c["status"] for c in data["claims"]} == {"not run"}


def test_a_figure_comes_from_the_folder_that_the_claims_use_for_most_of_its_series(tmp_path):
    """Each figure is copied from one folder: the one that the published claims use for most of its series (the
    first given on a tie), never one whose runs no published claim uses (an older command)."""
    tree = copy_tree(tmp_path)
    data = json.loads((tree / "docs" / "results.json").read_text())
    ids = ("ppo_cartpole_gru", "ppo_cartpole_lstm", "ppo_cartpole_none")  # series of the maskedcartpole figure
    line = {
        c["id"]: " | ".join([c["id"], c["claim"], c["command"], ",".join(c["metrics"]), c["prediction"], c["check"]])
        for c in data["claims"]
        if c["id"] in ids
    }
    values = {1: {"eval/episodic_return": 500.0, "charts/late_episodic_return": 500.0}}
    stale_line = line["ppo_cartpole_gru"].replace("--rnn gru", "--rnn gru --ent-coef 0.5")
    specs = [  # (folder, its lines, the ids it ran): listed in this order
        ("20260101-100000", [stale_line, line["ppo_cartpole_none"]], ("ppo_cartpole_gru",)),
        ("20260101-110000", [line["ppo_cartpole_none"]], ("ppo_cartpole_none",)),
        ("20260101-120000", list(line.values()), ids),
    ]
    folders = []
    for name, lines, ran in specs:
        out = make_folder(tmp_path, lines, {i: values for i in ran}, seeds=(1,)).rename(tmp_path / name)
        (out / "maskedcartpole.png").write_bytes(name.encode())
        folders.append(str(out))
    assert run(tree, "--publish", *folders).returncode in (0, 1)
    assert (tree / "docs" / "figures" / "maskedcartpole.png").read_bytes() == b"20260101-120000"  # 2 series of 3
    assert run(tree, "--publish", *folders[:2]).returncode in (0, 1)
    assert (tree / "docs" / "figures" / "maskedcartpole.png").read_bytes() == b"20260101-110000"  # not the stale one


def test_every_command_on_the_results_page_and_the_readme_runs_when_pasted():
    """The commands the pages print (runs table, experiment headings, README table) are valid bash as printed: each
    word quoted where the shell needs it (a regex of --only, a JSON of --env-kwargs)."""
    commands = []
    for path in (ROOT / "docs" / "results.md", ROOT / "README.md"):
        for code in re.findall(r"`([^`]+)`", path.read_text()):
            code = code.replace("\\|", "|")  # a | escaped inside a markdown table cell
            if code.startswith(("bash benchmark.sh ", "python algos/")):
                commands.append(code)
    assert len(commands) > 60
    for command in commands:
        proc = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert proc.returncode == 0, f"{command}: {proc.stderr}"
        assert shlex.join(shlex.split(command)) == command, f"not quoted as bash reads it: {command}"


def test_every_script_page_carries_its_generated_results_block():
    """Each docs/<script>.md shows its own claims between the markers that --publish rewrites (no hand-copied
    numbers): --check-published fails when a block is edited."""
    data = json.loads((ROOT / "docs" / "results.json").read_text())
    for script in SCRIPTS:
        block = (ROOT / "docs" / f"{script}.md").read_text().split(PAGE_BEGIN, 1)[1]
        ids = {c["id"] for c in data["claims"] if c["command"].split()[0] == script}
        assert ids and all(f"(results.md#{i})" in block for i in ids), script


def test_an_edited_script_page_block_is_stale(tmp_path):
    tree = copy_tree(tmp_path)
    page = tree / "docs" / "ssm_vae_q.md"
    page.write_text(page.read_text().replace("seeds 1 2 3 4 5", "seeds 1 2 3 4 6", 1))
    assert "the results block of docs/ssm_vae_q.md is not what docs/results.json renders" in stale(
        run(tree, "--check-published")
    )
