"""The reading shape of every script (issue 25): the algorithm above a `# === RUN MANAGEMENT` marker, run management
below it; the algorithm reaches run management only through `parse_args`, `start_run` and the methods of the `run`
object; the training loop talks to it in at most 8 lines; the pieces of run management that several scripts share
are the same text in each (a script added later joins these lists). Static checks: nothing is run."""

import ast
import re

import pytest
from conftest import ROOT

MARKER = "# === RUN MANAGEMENT"
ANALYSIS = "# === ANALYSIS"  # an optional section between evaluation and the marker
ENTRY_POINTS = {"parse_args", "start_run"}  # the only names below the marker that main() calls directly
MAX_LOOP_LINES = 8  # lines of a training loop that call run management
READING_PATH = {  # lines above the marker (or above `# === ANALYSIS`), at most
    "ppo_recurrent": 600, "dqn_framestack": 600, "ssm_vae_q": 750, "r2d2_rnnstate": 750, "r2d2_trxl_memory": 750,
    "rlhf_reward_model": 950, "rlhf_ppo_kl": 950, "ilql_per_token": 950, "dialogue_cql_utterance": 950,
}  # fmt: skip
SCRIPTS = sorted(READING_PATH)
RUN_MANAGEMENT = {  # lines below the marker, at most: issue 54's budget (nanoGPT resumes and runs DDP in about 45)
    "ppo_recurrent": 120, "dqn_framestack": 120, "ssm_vae_q": 120, "r2d2_rnnstate": 150, "r2d2_trxl_memory": 150,
    "rlhf_reward_model": 200, "rlhf_ppo_kl": 200, "ilql_per_token": 200, "dialogue_cql_utterance": 200,
}  # fmt: skip
# Not reached yet by the six checkpointing scripts, whose verbatim shared texts (checkpoint, stop handlers, torchrun)
# take 90-105 of those lines: their sizes today, a ceiling that only goes down until they fit the budget.
RUN_MANAGEMENT_NOW = {
    "r2d2_rnnstate": 285, "r2d2_trxl_memory": 329, "rlhf_reward_model": 307, "rlhf_ppo_kl": 370,
    "ilql_per_token": 385, "dialogue_cql_utterance": 303,
}  # fmt: skip
CHECKPOINTING = [
    "dialogue_cql_utterance",
    "ilql_per_token",
    "r2d2_rnnstate",
    "r2d2_trxl_memory",
    "rlhf_ppo_kl",
    "rlhf_reward_model",
]
TORCHRUN = ["ilql_per_token", "rlhf_ppo_kl", "rlhf_reward_model"]
ENV_SCRIPTS = ["dqn_framestack", "ppo_recurrent", "r2d2_rnnstate", "r2d2_trxl_memory", "ssm_vae_q"]  # gymnasium envs
NO_CHECKPOINTS = ["dqn_framestack", "ppo_recurrent", "ssm_vae_q"]  # run management of one screen: the Run they share
SHARED = {  # name -> the scripts that hold the same text of it
    "TRAIN_STATE": CHECKPOINTING, "save_train_state": CHECKPOINTING, "read_train_state": CHECKPOINTING,
    "rng_state": CHECKPOINTING, "set_rng_state": CHECKPOINTING, "resume_args": CHECKPOINTING,
    "STOP_EXIT_CODE": CHECKPOINTING, "install_stop_handlers": CHECKPOINTING, "restore_signal_handlers": CHECKPOINTING,
    "init_torchrun": TORCHRUN, "DIST_TIMEOUT": TORCHRUN,
    "SCRIPT": SCRIPTS,
    "flattenable": ENV_SCRIPTS,
    "check_env": ENV_SCRIPTS,
    "load_checkpoint": ENV_SCRIPTS,
    "Run": NO_CHECKPOINTS,
    "start_run": NO_CHECKPOINTS,
    "save_models": ["rlhf_ppo_kl", "rlhf_reward_model"],
    "TASK_ID": ["rlhf_ppo_kl", "rlhf_reward_model"],
    "check_dataset": ["dialogue_cql_utterance", "ilql_per_token"],
}  # fmt: skip


def source(name: str) -> str:
    return (ROOT / "algos" / f"{name}.py").read_text()


def marker_line(text: str) -> int:
    """1-based line number of the marker (the first line starting with it)."""
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if line.startswith(MARKER)]
    assert len(lines) == 1, f"expected one line starting with {MARKER!r}, found {len(lines)}"
    return lines[0]


def top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions, classes and assigned constants by name."""
    nodes = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            nodes[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            nodes.update({t.id: node for t in targets if isinstance(t, ast.Name)})
    return nodes


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_reading_path_ends_at_the_marker_within_its_length(name):
    """The reading path: the lines above the marker, less an analysis section just above it (measurements for the
    docs that training does not need, e.g. the Delta-Q ablation: a reader of the algorithm skips it too)."""
    text = source(name)
    lines = text.splitlines()
    above = marker_line(text) - 1
    analysis = [i for i, line in enumerate(lines) if line.startswith(ANALYSIS)]
    assert len(analysis) <= 1, f"{name}: one analysis section at most"
    if analysis:
        above = analysis[0]
    assert above <= READING_PATH[name], f"{name}: {above} lines above the marker, at most {READING_PATH[name]}"
    assert text.rstrip().endswith('if __name__ == "__main__":\n    main()'), "the script ends by calling main()"


@pytest.mark.parametrize("name", SCRIPTS)
def test_run_management_fits_its_budget_below_the_marker(name):
    text = source(name)
    below, limit = len(text.splitlines()) - marker_line(text), RUN_MANAGEMENT_NOW.get(name, RUN_MANAGEMENT[name])
    assert below <= limit, f"{name}: {below} lines below the marker, at most {limit} (budget {RUN_MANAGEMENT[name]})"


def test_formatting_is_left_to_ruff_but_for_a_few_aligned_tables():
    """ruff's format-skip comment only for a table whose alignment carries meaning: at most 10 in the repo."""
    skips = {
        str(path.relative_to(ROOT)): path.read_text().count("# fmt" + ": skip")
        for folder in ("algos", "envs", "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    assert sum(skips.values()) <= 10, {path: n for path, n in skips.items() if n}


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_algorithm_reaches_run_management_only_through_the_run_object(name):
    text = source(name)
    tree, marker = ast.parse(text), marker_line(text)
    nodes = top_level(tree)
    constants = ast.Assign | ast.AnnAssign
    below = {n for n, node in nodes.items() if node.lineno > marker and not isinstance(node, constants)}
    assert "main" in nodes and nodes["main"].lineno < marker, "main() is above the marker"
    assert ENTRY_POINTS <= below, f"parse_args and start_run are defined below the marker ({ENTRY_POINTS - below})"
    bad = []
    for node in tree.body:
        if node.lineno > marker or not isinstance(node, ast.FunctionDef | ast.ClassDef):
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in below:
                if call.func.id not in ENTRY_POINTS or node.name != "main":
                    bad.append(f"{node.name} calls {call.func.id} (line {call.lineno})")
    assert not bad, f"{name}: above the marker, calls into run management other than through `run`: {bad}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_training_loop_calls_run_management_in_at_most_8_lines(name):
    """main() has a top-level training loop; in every outermost loop of a function above the marker (main's, and a
    training phase written as its own function, e.g. supervised fine-tuning), at most 8 lines use `run.`."""
    text = source(name)
    tree, marker = ast.parse(text), marker_line(text)
    main = top_level(tree)["main"]
    assert any(isinstance(node, ast.For | ast.While) for node in main.body), f"{name}: main() has no top-level loop"
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef) or function.lineno > marker:
            continue
        outermost = [node for node in ast.walk(function) if isinstance(node, ast.For | ast.While)]
        inner = {id(sub) for node in outermost for sub in ast.walk(node) if sub is not node}
        for loop in (node for node in outermost if id(node) not in inner):
            lines = {
                node.lineno
                for node in ast.walk(loop)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "run"
            }
            assert len(lines) <= MAX_LOOP_LINES, (
                f"{name}.{function.name}: the loop at line {loop.lineno} calls run "
                f"management in {len(lines)} lines ({sorted(lines)})"
            )


@pytest.mark.parametrize("shared", sorted(SHARED))
def test_shared_run_management_is_the_same_text_in_every_script(shared):
    texts = {}
    for name in SHARED[shared]:
        text = source(name)
        node = top_level(ast.parse(text)).get(shared)
        assert node is not None, f"{name} has no {shared}"
        assert node.lineno > marker_line(text), f"{name}: {shared} belongs below the marker"
        texts[name] = ast.get_source_segment(text, node)
    first = SHARED[shared][0]
    drifted = [name for name, text in texts.items() if text != texts[first]]
    assert not drifted, f"{shared} differs from {first}'s copy in {drifted}"


def test_the_shared_lists_name_every_script_that_has_the_feature():
    for name in SCRIPTS:
        text = source(name)
        assert ("--save-every" in text or "save_every" in text) == (name in CHECKPOINTING), name
        assert bool(re.search(r"\bdist\.init_process_group\b", text)) == (name in TORCHRUN), name


# --- One vocabulary (issue 37): the API table of docs/run_management.md, and algorithm copies across scripts ---
API_DOC = ROOT / "docs" / "run_management.md"
RENAMED = {  # old spellings that must not come back: one name per concept
    "RESUME_FREE_ARGS": "RESUME_FREE_FIELDS", "RESUME_FREE": "RESUME_FREE_FIELDS", "load_models": "load_model",
    "load_reward_model": "load_pretrained", "restore_phases": "restore", "log_losses": "log",
}  # fmt: skip
# Names above the marker that every script may define in its own way: the shape every script shares, not a copy
OWN_IN_EACH = {"Args", "main", "evaluate", "TrainState"}


def api_methods() -> dict[str, list[str]]:
    """run.<method>(params) rows of the API table: method -> parameter names."""
    methods = {}
    for match in re.finditer(r"^\| `run\.(\w+)\(([^)]*)\)", API_DOC.read_text(), flags=re.M):
        methods[match.group(1)] = [p.strip().lstrip("*") for p in match.group(2).split(",") if p.strip()]
    return methods


def run_methods(text: str) -> dict[str, list[str]]:
    """The public methods of a script's `class Run`: name -> parameter names (self left out)."""
    run_class = top_level(ast.parse(text)).get("Run")
    assert run_class is not None, "no class Run"
    methods = {}
    for node in run_class.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            params = node.args.posonlyargs + node.args.args
            names = [a.arg for a in params[1:]]
            if node.args.vararg:
                names.append(node.args.vararg.arg)
            methods[node.name] = names
    return methods


def test_the_api_table_lists_each_method_once():
    rows = re.findall(r"^\| `run\.(\w+)\(", API_DOC.read_text(), flags=re.M)
    assert rows and len(rows) == len(set(rows)), f"methods listed more than once: {rows}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_run_methods_are_the_api_tables_with_its_signatures(name):
    text, api = source(name), api_methods()
    methods = run_methods(text)
    unknown = sorted(set(methods) - set(api))
    assert not unknown, f"{name}: Run has public methods the API table does not list: {unknown} (or make them _private)"
    wrong = {m: params for m, params in methods.items() if params != api[m]}
    assert not wrong, (
        f"{name}: signatures differ from docs/run_management.md: {wrong} (table: {[api[m] for m in wrong]})"
    )
    start_run = top_level(ast.parse(text))["start_run"]
    assert [a.arg for a in start_run.args.args] == ["args"], f"{name}: start_run takes (args) only"


@pytest.mark.parametrize("name", SCRIPTS)
def test_one_spelling_for_each_shared_name(name):
    tree = ast.parse(source(name))
    defined = set(top_level(tree)) | {
        n
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for n in [f.name for f in node.body if isinstance(f, ast.FunctionDef)]
    }
    old = sorted(defined & set(RENAMED))
    assert not old, f"{name} still spells {[(o, RENAMED[o]) for o in old]}"
    if name in CHECKPOINTING:
        for constant in ("RESUME_FREE_FIELDS", "STOP_EXIT_CODE", "SCRIPT"):
            assert constant in top_level(tree), f"{name}: no {constant}"
        assert "resuming" not in run_methods(source(name)), f"{name}: run.resuming is an attribute, not a method"


def algorithm_copies(texts: dict[str, str]) -> dict[str, dict[str, str]]:
    """name -> {script: source} for every function or class defined above the marker of two scripts or more."""
    copies = {}
    for script, text in texts.items():
        marker = marker_line(text)
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.lineno < marker:
                copies.setdefault(node.name, {})[script] = ast.get_source_segment(text, node)
    return {name: by_script for name, by_script in copies.items() if len(by_script) > 1 and name not in OWN_IN_EACH}


def drifted(texts: dict[str, str]) -> list[str]:
    """The algorithm copies whose text differs between scripts (one name, one text: where two scripts need different
    code, the names differ)."""
    out = []
    for name, by_script in sorted(algorithm_copies(texts).items()):
        if len(set(by_script.values())) > 1:
            out.append(f"{name} in {sorted(by_script)}")
    return out


def test_algorithm_functions_shared_by_scripts_are_the_same_text():
    texts = {name: source(name) for name in SCRIPTS}
    assert len(algorithm_copies(texts)) >= 10, "the check sees the shared algorithm functions"
    assert not drifted(texts), f"one name, different texts: {drifted(texts)}"


@pytest.mark.parametrize("shared", ["utterance_budget", "polyak_update", "value_rescale", "nstep_rescaled_targets"])
def test_the_drift_check_fails_on_a_one_character_edit_of_one_copy(shared):
    texts = {name: source(name) for name in SCRIPTS}
    script = sorted(algorithm_copies(texts)[shared])[-1]
    copy = algorithm_copies(texts)[shared][script]
    i = re.search(r"\d", copy[copy.index("\n") :]).start() + copy.index("\n")  # the first digit of the body
    edited = copy[:i] + str((int(copy[i]) + 1) % 10) + copy[i + 1 :]  # one character, still valid Python
    texts[script] = texts[script].replace(copy, edited)
    assert any(line.startswith(f"{shared} in") for line in drifted(texts)), f"{shared}: the edit went unnoticed"
