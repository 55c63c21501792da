"""Stopping and writing safely (issue 24): Ctrl-C (SIGINT) and SIGTERM (what torchrun's agent and job schedulers send)
stop the five checkpointing scripts alike, through one handler whose text is the same in every script; summary.json
(what marks a run finished for --resume and what benchmark.sh reads) is never written in place, so a kill mid-write
cannot leave half a file. The end-to-end stops are in the resume tests (SIGINT: r2d2, dialogue CQL, ILQL, PPO-KL;
SIGTERM: the reward model in one process and PPO-KL under torchrun)."""

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from conftest import ROOT, load_script

CHECKPOINTING = [
    "r2d2_rnnstate", "r2d2_trxl_memory", "dialogue_cql_utterance", "ilql_per_token", "rlhf_ppo_kl", "rlhf_reward_model"
]  # fmt: skip
NO_CHECKPOINTS = ["dqn_framestack", "ppo_recurrent", "ssm_vae_q"]  # Run.finish renames summary.json into place
SCRIPTS = sorted(p.stem for p in (ROOT / "algos").glob("*.py"))
WITH_WRITE_JSON_ATOMIC = [n for n in SCRIPTS if "def write_json_atomic(" in (ROOT / "algos" / f"{n}.py").read_text()]


# The handlers are one text in every checkpointing script: tests/test_run_management.py diffs the copies.


@pytest.mark.parametrize("name", CHECKPOINTING)
def test_sigterm_stops_like_sigint(name):
    """The first SIGTERM or SIGINT only sets the flag (training checkpoints at the end of its step and exits); a
    repeated SIGTERM changes nothing; a second Ctrl-C stops at once; the handlers before come back afterwards."""
    M = load_script(name)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert M.STOP_EXIT_CODE == 130
    for first in (signal.SIGTERM, signal.SIGINT):
        interrupt = M.install_stop_handlers()
        try:
            assert interrupt["signal"] is None
            os.kill(os.getpid(), first)  # CPython runs the handler before the next bytecode of this thread
            assert interrupt["signal"] == first.name
            os.kill(os.getpid(), signal.SIGTERM)
            assert interrupt["signal"] == first.name
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            M.restore_signal_handlers(interrupt)
        assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("name", SCRIPTS)
def test_summary_json_is_written_by_a_rename(name):
    """Every script writes summary.json to a temporary file and renames it into place (os.replace, or
    write_json_atomic where a script keeps that helper)."""
    text = (ROOT / "algos" / f"{name}.py").read_text()
    assert '"summary.json").write_text' not in text
    renamed = r'os\.replace\([^()]*summary\.json"\)|write_json_atomic\([^()]*"summary\.json"'
    assert re.search(renamed, text), "summary.json is renamed into place"


@pytest.mark.parametrize("name", CHECKPOINTING)
def test_train_state_round_trip_and_a_save_cut_half_way_leaves_the_previous_one(name, tmp_path, monkeypatch):
    """save_train_state / read_train_state (one text in the six scripts): tensors, arrays, an optimizer's int keys,
    RNG states and plain values come back; a save killed mid-write leaves the checkpoint before it; a checkpoint of
    another script is a one-line error."""
    import numpy as np
    import torch

    M = load_script(name)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"step": 7, "model": layer.state_dict(), "optimizer": optimizer.state_dict(), "rng": M.rng_state()}
    state |= {"replay": {"obs": np.arange(6, dtype=np.float32).reshape(3, 2), "done": np.array([True, False])}}
    M.save_train_state(tmp_path, state)
    drawn = torch.rand(3)
    back = M.read_train_state(tmp_path)
    M.set_rng_state(back["rng"])
    assert torch.equal(torch.rand(3), drawn)
    assert back["step"] == 7 and isinstance(back["replay"]["done"], np.ndarray) and back["replay"]["done"][0]
    assert all(torch.equal(back["model"][k], v) for k, v in layer.state_dict().items())
    torch.optim.Adam(layer.parameters()).load_state_dict(back["optimizer"])  # int keys of its state survived

    def cut_save(tensors, path, metadata=None):  # a kill half-way through the write
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(M, "save_file", cut_save)
    with pytest.raises(KeyboardInterrupt):
        M.save_train_state(tmp_path, {**state, "step": 8})
    monkeypatch.undo()
    assert M.read_train_state(tmp_path)["step"] == 7
    monkeypatch.setattr(M, "SCRIPT", "another_script")
    with pytest.raises(SystemExit, match=f"^error: {tmp_path} is a run of {name}.py, not of another_script.py$"):
        M.read_train_state(tmp_path)


@pytest.mark.parametrize("name", WITH_WRITE_JSON_ATOMIC)
def test_write_json_atomic_leaves_the_old_file_when_the_write_is_cut(name, tmp_path, monkeypatch):
    M = load_script(name)
    path = tmp_path / "summary.json"
    M.write_json_atomic(path, {"old": 1})
    real_write_text = Path.write_text

    def cut_write(self, data, *args, **kwargs):  # a kill half-way through the write
        real_write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", cut_write)
    with pytest.raises(KeyboardInterrupt):
        M.write_json_atomic(path, {"new": 2, "padding": "x" * 100})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"old": 1}


def cut_write_text(monkeypatch):
    """Path.write_text killed half-way through its write."""
    real_write_text = Path.write_text

    def cut_write(self, data, *args, **kwargs):
        real_write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", cut_write)


@pytest.mark.parametrize("name", NO_CHECKPOINTS)
def test_finish_renames_summary_json_into_place(name, tmp_path, monkeypatch):
    """The scripts without checkpoints write summary.json in Run.finish: to a temporary file, then renamed, so a kill
    mid-write leaves the summary before it (or none), never half of one."""
    M = load_script(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--runs-dir", str(tmp_path)])
    run = M.start_run(M.parse_args())
    run.finish({"eval/x": 1.0}, {}, 0)
    assert json.loads((run.run_dir / "summary.json").read_text())["metrics"] == {"eval/x": 1.0}
    cut_write_text(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run.finish({"eval/x": 2.0, "padding": "x" * 100}, {}, 0)
    monkeypatch.undo()
    assert json.loads((run.run_dir / "summary.json").read_text())["metrics"] == {"eval/x": 1.0}
