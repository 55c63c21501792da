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

CHECKPOINTING = ["r2d2_rnnstate", "dialogue_cql_utterance", "ilql_per_token", "rlhf_ppo_kl", "rlhf_reward_model"]
NO_CHECKPOINTS = ["dqn_framestack", "ppo_recurrent", "ssm_vae_q"]  # Run.finish renames summary.json into place
WITH_WRITE_JSON_ATOMIC = sorted({p.stem for p in (ROOT / "algos").glob("*.py")} - set(NO_CHECKPOINTS))


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


@pytest.mark.parametrize("name", WITH_WRITE_JSON_ATOMIC)
def test_summary_json_is_written_by_a_rename(name):
    """Every script writes summary.json to a temporary file and renames it into place (write_json_atomic)."""
    text = (ROOT / "algos" / f"{name}.py").read_text()
    assert '"summary.json").write_text' not in text
    assert re.search(r'write_json_atomic\([^()]*"summary\.json"', text), "summary.json goes through write_json_atomic"


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
