#!/usr/bin/env bash
# benchmark.sh: run the experiments that reproduce the lecture's claims and write a results table and plots.
#
#   bash benchmark.sh --quick          # 1 seed, every experiment (well under 30 minutes on 2 CPU cores)
#   bash benchmark.sh                  # full: 3 seeds
#   bash benchmark.sh --seeds "1 2 3 4 5" --only tmaze --jobs 2
#
# Each run is `python algos/<script>.py --seed S --runs-dir <out>/runs/<id>/seed<S> <args>`; its summary.json is
# read back. Output goes to a new folder results/<timestamp>/ (never overwriting earlier results):
#   results.md  the table: claim, command, metric, mean ± std over seeds, what the lecture predicts, status
#   *.png       learning curves and sweep figures (matplotlib, read from the runs' tensorboard logs)
#   log.txt     one line per run; runs/<id>/seed<S>/... the runs themselves, logs/<id>_seed<S>.log their output
# A failed run is reported in the table (status column), never silently dropped.
set -uo pipefail
cd "$(dirname "$0")"

QUICK=0
SEEDS=""
ONLY=""
JOBS=$(nproc 2>/dev/null || echo 2)
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --seeds) SEEDS="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "benchmark.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$SEEDS" ] || { [ "$QUICK" = 1 ] && SEEDS="1" || SEEDS="1 2 3"; }

# The experiments, one per line:  id | claim | script and arguments | metrics (comma-separated) | lecture predicts
# Lines starting with `quick:` run in --quick mode too; `full:` lines only in full mode.
EXPERIMENTS=$(cat <<'EOF'
EOF
)

OUT="results/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT/runs" "$OUT/logs"
echo "# id | claim | command | metrics | prediction" >"$OUT/experiments.txt"
printf '%s\n' "$EXPERIMENTS" | grep -v '^\s*$' | while IFS= read -r line; do
  mode="${line%%:*}"; spec="${line#*:}"
  if [ "$mode" = full ] && [ "$QUICK" = 1 ]; then continue; fi
  id=$(echo "$spec" | cut -d'|' -f1 | xargs)
  if [ -n "$ONLY" ] && [[ "$id" != *"$ONLY"* ]]; then continue; fi
  echo "$spec" >>"$OUT/experiments.txt"
done
N_EXP=$(($(wc -l <"$OUT/experiments.txt") - 1))
N_SEEDS=$(echo $SEEDS | wc -w)
TOTAL=$((N_EXP * N_SEEDS))
echo "benchmark: $N_EXP experiments x $N_SEEDS seed(s) = $TOTAL runs, $JOBS at a time -> $OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1

run_one() {  # id seed args... ; prints one progress line
  local id="$1" seed="$2"; shift 2
  local script="$1"; shift
  local start=$SECONDS rc
  python3 "algos/$script.py" --seed "$seed" --runs-dir "$OUT/runs/$id/seed$seed" --exp-name "$id" "$@" \
    </dev/null >"$OUT/logs/${id}_seed${seed}.log" 2>&1
  rc=$?
  local status="ok"; [ $rc -eq 0 ] || status="FAILED (exit $rc, see logs/${id}_seed${seed}.log)"
  echo "[$(date +%H:%M:%S)] $id seed=$seed $status in $((SECONDS - start))s" | tee -a "$OUT/log.txt"
}

T0=$SECONDS
i=0
while IFS='|' read -r id claim cmd metrics prediction; do
  [[ "$id" == \#* ]] && continue
  id=$(echo "$id" | xargs)
  for seed in $SEEDS; do
    i=$((i + 1))
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    echo "[$(date +%H:%M:%S)] start $i/$TOTAL: $id seed=$seed"
    eval "run_one \"\$id\" \"\$seed\" $cmd" &  # eval: the command's quoted arguments stay whole
  done
done <"$OUT/experiments.txt"
wait
echo "benchmark: all runs finished in $((SECONDS - T0))s; aggregating"

python3 - "$OUT" <<'PY'
"""Aggregate every run's summary.json into results.md, and plot learning curves and sweeps."""

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

out = Path(sys.argv[1])
rows, sweeps = [], defaultdict(lambda: defaultdict(dict))
experiments = []
for line in (out / "experiments.txt").read_text().splitlines()[1:]:
    exp_id, claim, cmd, metrics, prediction = (f.strip() for f in line.split("|"))
    experiments.append((exp_id, claim, cmd, [m.strip() for m in metrics.split(",")], prediction))


def mean_std(values):
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, s


seeds_by_exp = {}
for exp_id, claim, cmd, metrics, prediction in experiments:
    summaries, failed = [], []
    for seed_dir in sorted((out / "runs" / exp_id).glob("seed*")):
        found = list(seed_dir.glob("*/summary.json"))
        if found:
            summaries.append(json.loads(found[0].read_text()))
        else:
            failed.append(seed_dir.name)
    seeds_by_exp[exp_id] = summaries
    status = f"ok {len(summaries)}/{len(summaries) + len(failed)}"
    if failed:
        status = f"**FAILED** {', '.join(failed)} (see logs/) · {status}"
    for metric in metrics:
        values = [s["metrics"][metric] for s in summaries if metric in s["metrics"]]
        cell = "—"
        if values:
            m, s = mean_std(values)
            cell = f"{m:.3f} ± {s:.3f} (n={len(values)})"
        elif summaries:
            status += f"; metric {metric} missing"
        rows.append(f"| {claim} | `python algos/{cmd}` | `{metric}` | {cell} | {prediction} | {status} |")
        # sweeps: ids like `<name>_sweep<X>` are plotted as metric against X
        if "_sweep" in exp_id and values:
            name, x = exp_id.rsplit("_sweep", 1)
            sweeps[(name, metric)][float(x)] = mean_std(values)

seeds = sorted({s["args"]["seed"] for ss in seeds_by_exp.values() for s in ss})
table = [
    "# seqrl benchmark results",
    "",
    f"Seeds: {seeds}. Mean ± sample std over seeds. Generated by `benchmark.sh` into `{out}`.",
    "",
    "| claim | command (plus `--seed S`) | metric | measured | lecture predicts | status |",
    "|---|---|---|---|---|---|",
    *rows,
]
(out / "results.md").write_text("\n".join(table) + "\n")
print("\n".join(table))

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("matplotlib missing: no plots")
    sys.exit(0)

# Sweep figures: one per sweep name, metric against the swept value.
for (name, metric), points in sweeps.items():
    xs = sorted(points)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar(xs, [points[x][0] for x in xs], yerr=[points[x][1] for x in xs], marker="o", capsize=3)
    ax.set_xlabel(name.split("_")[-1] if "_" in name else "x")
    ax.set_ylabel(metric)
    ax.set_title(name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"sweep_{name}_{metric.replace('/', '_')}.png", dpi=120)
    plt.close(fig)

# Learning curves from the tensorboard logs: one panel per experiment, seeds overlaid.
try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    EventAccumulator = None
curves = {}
if EventAccumulator is not None:
    for exp_id, *_ in experiments:
        for summary in seeds_by_exp[exp_id]:
            acc = EventAccumulator(summary["run_dir"], size_guidance={"scalars": 0})
            acc.Reload()
            tags = acc.Tags().get("scalars", [])
            tag = next((t for t in ("charts/episodic_return", "eval/gold_reward", "losses/loss") if t in tags), None)
            if tag:
                events = acc.Scalars(tag)
                curves.setdefault(exp_id, (tag, []))[1].append(([e.step for e in events], [e.value for e in events]))
if curves:
    n = len(curves)
    cols = min(4, n)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(4 * cols, 3 * math.ceil(n / cols)), squeeze=False)
    for ax, (exp_id, (tag, runs)) in zip(axes.flat, curves.items()):
        for steps, values in runs:
            ax.plot(steps, values, alpha=0.7)
        ax.set_title(exp_id, fontsize=9)
        ax.set_ylabel(tag, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=100)
    plt.close(fig)

# RLHF over-optimization (Gao et al. 2022): gold and proxy reward against KL(pi || pi_SFT), from curve.jsonl.
curve_files = sorted((out / "runs").glob("*/seed*/*/curve.jsonl"))
if curve_files:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for path in curve_files:
        points = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        label = path.parts[-4] + " " + path.parts[-3]
        kl = [p["kl"] for p in points]
        axes[0].plot(kl, [p["gold_reward"] for p in points], marker=".", label=label)
        axes[1].plot(kl, [p["proxy_reward"] for p in points], marker=".", label=label)
    for ax, name in zip(axes, ["gold reward (hidden utility)", "proxy reward (learned RM)"]):
        ax.set_xlabel("KL(pi || pi_SFT)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "rlhf_overoptimization.png", dpi=120)
    plt.close(fig)
print(f"\nwrote {out / 'results.md'} and {len(list(out.glob('*.png')))} plot(s)")
PY
