"""The docs read like CleanRL's: each script page (docs/<script>.md) is at most 150 lines and keeps its generated
results under `## Results`, and no doc outside the lab log (docs/results.md, docs/tuning.md) carries lab-log
passages: result-folder stamps, issue numbers or session history. Text that `benchmark.sh --publish` writes between
its markers is the generator's, so it is left out of the lab-log check."""

import re

import pytest
from conftest import ROOT

SCRIPTS = sorted(path.stem for path in (ROOT / "algos").glob("*.py"))
MAX_LINES = 150  # a CleanRL docs page per script variant: overview, papers, usage, metrics, details, results
PAGE_BEGIN = "<!-- BEGIN results: written by benchmark.sh --publish -->"
PAGE_END = "<!-- END results -->"
README_BEGIN = "<!-- BEGIN results table: written by benchmark.sh --publish -->"
README_END = "<!-- END results table -->"
LAB_LOG_PAGES = {"results.md", "tuning.md"}  # where run folders, seeds and tuning history belong
LAB_LOG = {
    "a results-folder stamp": re.compile(r"(?<!\d)\d{8}-\d{6}(?!\d)"),
    "an issue number": re.compile(r"\bissues?\s*(?:#\s*)?\d+\b|\bissues?\s+(?:no\.?|number)\s*\d+\b", re.IGNORECASE),
    "session history": re.compile(r"\b(?:earlier|this|previous|last|an?\s+other|other)\s+sessions?\b", re.IGNORECASE),
}


def without_generated(text: str) -> str:
    """`text` with every block that `benchmark.sh --publish` writes (a script page's results, the README's table)
    blanked, its lines kept so that line numbers stay those of the file."""
    for begin, end in ((PAGE_BEGIN, PAGE_END), (README_BEGIN, README_END)):
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        text = pattern.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return text


def lab_log_passages(text: str) -> list[str]:
    """'line N: <kind>: <match>' for every lab-log passage outside the generated blocks."""
    found = []
    for number, line in enumerate(without_generated(text).splitlines(), 1):
        for kind, pattern in LAB_LOG.items():
            found += [f"line {number}: {kind}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def reader_docs() -> list:
    """README.md and every docs/*.md but the lab log."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in LAB_LOG_PAGES)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_page_is_short_and_ends_with_its_generated_results(script):
    text = (ROOT / "docs" / f"{script}.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"docs/{script}.md: {len(lines)} lines, at most {MAX_LINES}"
    assert text.count(PAGE_BEGIN) == 1 and text.count(PAGE_END) == 1, f"docs/{script}.md: one generated block"
    begin, end = lines.index(PAGE_BEGIN), lines.index(PAGE_END)
    assert begin < end
    headings = [line for line in lines[:begin] if line.startswith("## ")]
    assert headings and headings[-1] == "## Results", f"docs/{script}.md: the generated block is not under ## Results"
    for section in ("## Overview", "## Original papers", "## Usage", "## Logged metrics", "## Implementation details"):
        assert section in headings, f"docs/{script}.md has no {section}"
    assert not any(line.startswith("## ") for line in lines[end:]), f"docs/{script}.md: a section after ## Results"


@pytest.mark.parametrize("path", reader_docs(), ids=lambda p: p.name)
def test_no_lab_log_outside_results_and_tuning(path):
    passages = lab_log_passages(path.read_text())
    assert not passages, f"{path.relative_to(ROOT)} (move these to docs/tuning.md or drop them):\n" + "\n".join(
        passages
    )


@pytest.mark.parametrize(
    "passage",
    [
        "Runs of `20261206-082410` on the 2-core machine.",
        "the folder results/20261207-030838/ holds them",
        "The same command took 1151 s before issue 38's changes.",
        "as Issues #56 asks",
        "the bars of issue56",
        "measured in an earlier session on the 2-core machine",
        "This session reran it.",
        "the previous session's folder",
        "set in the last session",
    ],
)
def test_the_lab_log_check_finds_each_kind(passage):
    page = f"# a page\n\nSome text.\n{passage}\n"
    assert lab_log_passages(page), passage
    assert lab_log_passages(page)[0].startswith("line 4: ")


@pytest.mark.parametrize(
    "passage",
    [
        "`python algos/ppo_recurrent.py --seed 1 --total-timesteps 100000`",
        "tuning seeds 101-120 and seeds 1000-9999",
        "a session of torchrun: `torchrun --nproc_per_node 2`",
        "the issue of stale memory, 2 layers x 64 floats",
        "results/<stamp>/ and runs/RUN_NAME",
    ],
)
def test_the_lab_log_check_passes_ordinary_text(passage):
    assert not lab_log_passages(f"# a page\n\n{passage}\n"), passage


def test_generated_blocks_are_left_to_the_generator():
    page = f"# p\n\n## Results\n\n{PAGE_BEGIN}\nRuns of `20261206-082410`.\n{PAGE_END}\n\nissue 38\n"
    assert lab_log_passages(page) == ["line 9: an issue number: 'issue 38'"]
    readme = f"{README_BEGIN}\n| 20261206-082410 |\n{README_END}\n"
    assert lab_log_passages(readme) == []
