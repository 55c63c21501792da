"""One torch thread by default (issue 38): every script takes `--threads` (default 1) and sets it before any torch work,
so that two runs side by side share the cores instead of spinning against each other. Static checks of every script,
and (slow: it times whole runs, so the machine must be otherwise idle) two runs at once against one alone."""

import ast
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT

SCRIPTS = sorted(p.stem for p in (ROOT / "algos").glob("*.py"))


def main_calls(name: str) -> list[str]:
    """The dotted names main() calls, in source order."""
    tree = ast.parse((ROOT / "algos" / f"{name}.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = sorted((n for n in ast.walk(main) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    return [ast.unparse(call.func) for call in calls]


@pytest.mark.parametrize("name", SCRIPTS)
def test_args_take_threads_with_default_1(name):
    tree = ast.parse((ROOT / "algos" / f"{name}.py").read_text())
    args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    fields = {f.target.id: f.value for f in args.body if isinstance(f, ast.AnnAssign)}
    assert "threads" in fields, f"{name}: Args has no threads field"
    assert ast.literal_eval(fields["threads"]) == 1, f"{name}: --threads defaults to 1"


@pytest.mark.parametrize("name", SCRIPTS)
def test_main_sets_the_threads_right_after_parsing_the_args(name):
    calls = main_calls(name)
    assert "torch.set_num_threads" in calls, f"{name}: main() never calls torch.set_num_threads(args.threads)"
    before = calls[: calls.index("torch.set_num_threads")]
    tree = ast.parse((ROOT / "algos" / f"{name}.py").read_text())
    own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)} - {"parse_args"}
    torch_work = [c for c in before if (c.startswith("torch.") and c != "torch.manual_seed") or c.split(".")[0] in own]
    assert not torch_work, f"{name}: main() calls {torch_work} before torch.set_num_threads"


def bad_threads(name: str, tmp_path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "algos" / f"{name}.py"), "--threads", "0", "--runs-dir", str(tmp_path)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", SCRIPTS)
def test_threads_below_1_is_a_one_line_error(name, tmp_path):
    proc = bad_threads(name, tmp_path)
    assert proc.returncode != 0 and "error: --threads" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


# A run of a few seconds at the script's defaults but its length; no OMP_NUM_THREADS: the script's own default decides
TIMED_RUN = ["ssm_vae_q.py", "--env-id", "seqrl/TwoDoors-v0", "--total-timesteps", "3000", "--learning-starts", "1000"]


def start_timed_run(tmp_path, tag: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    cmd = [sys.executable, str(ROOT / "algos" / TIMED_RUN[0]), *TIMED_RUN[1:], "--runs-dir", str(tmp_path / tag)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def timed(procs: list[subprocess.Popen]) -> list[float]:
    start, ends = time.perf_counter(), {}
    while len(ends) < len(procs):
        for i, proc in enumerate(procs):
            if i not in ends and proc.poll() is not None:
                assert proc.returncode == 0
                ends[i] = time.perf_counter() - start
        time.sleep(0.05)
    return [ends[i] for i in range(len(procs))]


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two runs at once need two cores")
def test_two_default_runs_at_once_take_about_as_long_as_one_alone(tmp_path):
    alone = min(timed([start_timed_run(tmp_path, f"alone{i}")])[0] for i in range(2))
    together = timed([start_timed_run(tmp_path, "a"), start_timed_run(tmp_path, "b")])
    print(f"alone {alone:.1f} s; two at once {together[0]:.1f} s and {together[1]:.1f} s")
    assert max(together) <= 1.5 * alone, f"two at once took {together} s against {alone:.1f} s alone"
