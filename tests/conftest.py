"""Shared test helpers: smoke-run a script in a subprocess, or import a script as a module."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `import envs` from the tests
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n auto`: a worker per core, so one torch thread per worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (read when torch is first imported, after this file)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: learning tests that take minutes (deselect with -m 'not slow')")


def load_script(name: str):
    """Import `algos/<name>.py` as a module (its `if __name__ == "__main__"` block does not run)."""
    path = ROOT / "algos" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"algos_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def subprocess_env() -> dict:
    """The environment of a script run: this one's (read at call time, so monkeypatch.setenv reaches it), one thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def gloo_threads(grace_s: float = 2.0) -> list[str]:
    """The names of this process's gloo threads once those that are exiting are gone (Linux; [] elsewhere). After
    destroy_process_group there must be none: a group kept alive keeps them running into interpreter exit, where one
    can abort the process (SIGABRT). A joined thread can still be listed for a moment (the kernel clears the joined
    thread's id before it removes its /proc entry), hence the grace period."""
    tasks = Path("/proc/self/task")
    if not tasks.exists():
        return []
    deadline = time.monotonic() + grace_s
    while True:
        names = []
        for task in tasks.iterdir():
            try:
                names.append((task / "comm").read_text().strip())
            except OSError:  # the thread ended while we listed it
                continue
        names = [n for n in names if "gloo" in n]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.01)


def scalar_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps at which `tag` was logged in RUN_DIR's tensorboard event files (all of them, in file order)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for events in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            steps += [e.step for e in acc.Scalars(tag)]
    return steps


def script_command(script: str, *args: str) -> list[str]:
    """`python algos/<script>.py ARGS...` as an argument list."""
    return [sys.executable, str(ROOT / "algos" / f"{script}.py"), *args]


def start_script(script: str, log_path: Path, *args: str) -> subprocess.Popen:
    """Start `algos/<script>.py ARGS...` in the background (e.g. to kill it later), its output going to `log_path`
    (a file, not a pipe: a full pipe would block the run)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            script_command(script, *args), cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT
        )


def run_script(script: str, *args: str, runs_dir: Path, timeout: float = 300, expect_fail: bool = False):
    """Run `python algos/<script>.py --runs-dir RUNS_DIR ARGS...` and return its summary.json as a dict.

    With `expect_fail=True` the run must exit non-zero; the CompletedProcess is returned instead.
    """
    cmd = script_command(script, "--runs-dir", str(runs_dir), *args)
    before = set(Path(runs_dir).glob("*")) if Path(runs_dir).exists() else set()
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if expect_fail:
        assert proc.returncode != 0, f"expected a failure, got exit 0:\n{proc.stdout[-2000:]}"
        return proc
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    new_dirs = sorted(set(Path(runs_dir).glob("*")) - before)
    assert len(new_dirs) == 1, f"expected one new run dir, got {new_dirs}"
    summary = json.loads((new_dirs[0] / "summary.json").read_text())
    assert summary["script"] == script
    return summary


def run_in_process(module, runs_dir, *args: str) -> dict:
    """`module.main()` (a script loaded with load_script) in this process on `--runs-dir RUNS_DIR ARGS...`: no
    interpreter start and no second import of torch and transformers, for runs whose test is not about the command
    line; returns the run's summary.json. What main changes in the process (torch's thread count, as --threads sets it
    in a subprocess run; the Ctrl-C / SIGTERM handlers) is put back."""
    import signal

    import torch

    runs_dir, handlers = Path(runs_dir), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads, before = torch.get_num_threads(), set(runs_dir.glob("*/summary.json"))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", [f"{module.SCRIPT}.py", "--runs-dir", str(runs_dir), *args])
            module.main()
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    (summary,) = set(runs_dir.glob("*/summary.json")) - before  # the run's own
    summary = json.loads(summary.read_text())
    assert summary["script"] == module.SCRIPT
    return summary


def parse_error(monkeypatch, module, *argv: str) -> str:
    """The one-line error `module.parse_args()` stops with for ARGV, before any work: a SystemExit message, which the
    command line prints as it is (each script's tests keep one subprocess that shows that route)."""
    monkeypatch.setattr(sys, "argv", [f"{module.SCRIPT}.py", *argv])
    with pytest.raises(SystemExit) as err:
        module.parse_args()
    message = str(err.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.fixture
def runs_dir(tmp_path):
    return tmp_path / "runs"


@pytest.fixture(scope="session", params=["gpt2", "llama", "gpt_neox"])
def hf_checkpoint(request, tmp_path_factory):
    """A tiny saved GPT-2 / Llama / GPT-NeoX checkpoint with a byte-level BPE tokenizer and no pad token
    (tests/hf_tiny.py): the directory a user's `--model-name-or-path` would point at."""
    from hf_tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(f"hf_{request.param}"))
