"""The design card: each script in algos/ imports only the stdlib, the declared packages and this repo's `envs`."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"torch", "numpy", "gymnasium", "transformers", "tyro", "tensorboard", "tokenizers", "safetensors", "envs"}
SCRIPTS = [
    "ppo_recurrent",
    "dqn_framestack",
    "r2d2_rnnstate",
    "ssm_vae_q",
    "rlhf_reward_model",
    "rlhf_ppo_kl",
    "ilql_per_token",
    "dialogue_cql_utterance",
    "r2d2_trxl_memory",
]


def imported_top_level_names(path: Path) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append((node.lineno, "." if node.level else (node.module or "").split(".")[0]))
    return names


def test_algos_holds_exactly_the_nine_scripts():
    present = sorted(p.stem for p in (ROOT / "algos").glob("*.py"))
    assert set(present) == set(SCRIPTS), (
        f"algos/ differs: extra {set(present) - set(SCRIPTS)}, missing {set(SCRIPTS) - set(present)}"
    )


@pytest.mark.parametrize("script", sorted((ROOT / "algos").glob("*.py")), ids=lambda p: p.name)
def test_script_imports_only_allowed_modules(script):
    bad = [
        f"{script.name}:{line} imports {name}"
        for line, name in imported_top_level_names(script)
        if name not in ALLOWED and name not in sys.stdlib_module_names
    ]
    assert not bad, bad


def test_envs_never_import_algos():
    for path in (ROOT / "envs").glob("*.py"):
        assert all(name != "algos" for _, name in imported_top_level_names(path)), path
