#!/usr/bin/env bash
# benchmark.sh: run the experiments that reproduce the lecture's claims and write a results table and plots.
#
#   bash benchmark.sh --quick          # 1 seed, every experiment (well under 30 minutes on 2 CPU cores)
#   bash benchmark.sh                  # full: 3 seeds
#   bash benchmark.sh --seeds "1 2 3 4 5" --only 'tmaze|tiger' --jobs 2   # --only: a regex over experiment ids
#   bash benchmark.sh --aggregate results/<timestamp>   # rebuild the table and plots of an earlier run
#
# Each run is `python algos/<script>.py --seed S --runs-dir <out>/runs/<id>/seed<S> <args>`; its summary.json is
# read back. Output goes to a new folder results/<timestamp>/ (never overwriting earlier results):
#   results.md  the table: claim, command, metric, mean ± std over seeds, what the lecture predicts, status
#   *.png       learning curves and sweep figures (matplotlib, read from the runs' tensorboard logs)
#   log.txt     one line per run; runs/<id>/seed<S>/... the runs themselves, logs/<id>_seed<S>.log their output
# A failed run is reported in the table (status column), never silently dropped.
set -uo pipefail
cd "$(dirname "$0")"
{  # the whole script is one block, parsed before it runs, so editing this file mid-run cannot change a run

QUICK=0
SEEDS=""
ONLY=""
AGGREGATE=""  # --aggregate results/<timestamp>: only rebuild that folder's table and plots from its runs
JOBS=$(nproc 2>/dev/null || echo 2)
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --seeds) SEEDS="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --aggregate) AGGREGATE="$2"; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "benchmark.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$SEEDS" ] || { [ "$QUICK" = 1 ] && SEEDS="1" || SEEDS="1 2 3"; }

# The experiments, one per line:  id | claim | script and arguments | metrics (comma-separated) | lecture predicts
# Lines starting with `quick:` run in --quick mode too; `full:` lines only in full mode (the dialogue runs take
# about 10 CPU-minutes each and would push --quick past 30 minutes).
EXPERIMENTS=$(cat <<'EOF'
quick: ppo_line_none | ThreeStateLine (Problem 21.1): the best memoryless policy is stochastic, p(right)=1/2, 2 steps | ppo_recurrent --env-id seqrl/ThreeStateLine-v0 --rnn none --total-timesteps 30000 --eval-episodes 1000 | eval/p_right_first_step,eval/episodic_length | 0.5 and 2.0
quick: ppo_line_none | ThreeStateLine: the greedy version of that policy is deterministic and fails half the episodes | ppo_recurrent --env-id seqrl/ThreeStateLine-v0 --rnn none --total-timesteps 30000 --eval-episodes 1000 | eval/greedy_episodic_length | about 10.5 (half the episodes hit the 20-step limit)
quick: ppo_line_gru | ThreeStateLine with memory (GRU): reverse after a wall bump, 1.5 steps | ppo_recurrent --env-id seqrl/ThreeStateLine-v0 --rnn gru --total-timesteps 30000 --eval-episodes 1000 | eval/episodic_length,eval/p_reverse_second_step | 1.5 and 1.0
quick: ppo_tmaze_gru | TMaze (corridor 10) with a GRU | ppo_recurrent --env-id seqrl/TMaze-v0 --rnn gru | eval/success_rate,eval/episodic_return | success >= 0.95 (optimal return 3.0)
quick: ppo_tmaze_none | TMaze (corridor 10), memoryless | ppo_recurrent --env-id seqrl/TMaze-v0 --rnn none | eval/success_rate,eval/episodic_return | success 0.5 (return 0.5)
quick: ppo_cartpole_gru | MaskedCartPole with a GRU | ppo_recurrent --env-id seqrl/MaskedCartPole-v0 --rnn gru --reward-scale 0.01 --total-timesteps 300000 | eval/episodic_return | >= 475
quick: ppo_cartpole_none | MaskedCartPole, memoryless | ppo_recurrent --env-id seqrl/MaskedCartPole-v0 --rnn none --reward-scale 0.01 --total-timesteps 300000 | eval/episodic_return | far below 475
quick: ppo_tiger_gru | Tiger with a GRU: listens before opening, positive return | ppo_recurrent --env-id seqrl/Tiger-v0 --rnn gru --reward-scale 0.1 --no-bootstrap-truncated --total-timesteps 150000 --eval-episodes 1000 | eval/episodic_return,eval/listens_per_episode,eval/success_rate | > 0 (optimum 5.01), >= 2 listens
quick: ppo_tiger_none | Tiger, memoryless | ppo_recurrent --env-id seqrl/Tiger-v0 --rnn none --reward-scale 0.1 --no-bootstrap-truncated --total-timesteps 150000 --eval-episodes 1000 | eval/episodic_return,eval/listens_per_episode | < 0 (best memoryless -7.5)
full: ppo_tmaze_gru_mc | TMaze (corridor 10), GRU, Monte Carlo returns (gae-lambda 1): MC policy gradients stay valid | ppo_recurrent --env-id seqrl/TMaze-v0 --rnn gru --gae-lambda 1.0 | eval/success_rate | >= 0.95
quick: ssm_twodoors | TwoDoors (Problem 21.2): after a failed try the latent model predicts retry-same ~0, other ~1 | ssm_vae_q --env-id seqrl/TwoDoors-v0 | model/p_pass_retry_same_door,model/p_pass_other_door | 0 and 1
quick: ssm_twodoors | TwoDoors (Problem 21.2): a Markovian model of p(o' given o, a) predicts the same for both doors | ssm_vae_q --env-id seqrl/TwoDoors-v0 | model/markov_p_pass_same_door,model/markov_p_pass_other_door | 0.5 and 0.5
quick: ssm_twodoors | TwoDoors: Q-learning on the latent belief is memory-optimal | ssm_vae_q --env-id seqrl/TwoDoors-v0 | eval/episodic_return | 0.95 (memoryless best 0.90)
quick: ssm_tmaze5 | TMaze (corridor 5): Q-learning on the latent belief remembers the cue | ssm_vae_q --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 5}' --seq-len 16 --total-timesteps 30000 | eval/success_rate,eval/one_step_obs_error | success 1 (memoryless 0.5)
full: ssm_maskedcartpole | MaskedCartPole: latent-belief DQN within a ~10 min CPU budget (30k steps) | ssm_vae_q --env-id seqrl/MaskedCartPole-v0 --total-timesteps 30000 --seq-len 16 --obs-std 0.05 --learning-starts 5000 --exploration-fraction 0.2 --target-network-frequency 250 --eval-episodes 10 | eval/episodic_return | 500 with memory (budget-limited here)
quick: dqn_cartpole_k4 | MaskedCartPole: a 4-frame stack recovers the velocities | dqn_framestack --frame-stack 4 | eval/episodic_return | >= 475
quick: dqn_cartpole_k1 | MaskedCartPole: Q-learning on single observations fails | dqn_framestack --frame-stack 1 --total-timesteps 40000 | eval/episodic_return | far below 475
quick: dqn_line_k1 | ThreeStateLine (Problem 21.1): the greedy Q policy on o is deterministic and fails half the episodes | dqn_framestack --env-id seqrl/ThreeStateLine-v0 --frame-stack 1 --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/failure_rate,eval/episodic_return | failure 0.5 (stochastic optimum: 0, return -2)
quick: dqn_tmaze_k4_corridor_sweep1 | TMaze, 4-frame stack, corridor 1 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 1}' --frame-stack 4 --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 1 (cue inside the window)
quick: dqn_tmaze_k4_corridor_sweep2 | TMaze, 4-frame stack, corridor 2 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 2}' --frame-stack 4 --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 1 (cue inside the window)
quick: dqn_tmaze_k4_corridor_sweep3 | TMaze, 4-frame stack, corridor 3 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 3}' --frame-stack 4 --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 1 only on the shortest path (window edge)
quick: dqn_tmaze_k4_corridor_sweep4 | TMaze, 4-frame stack, corridor 4 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 4}' --frame-stack 4 --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 0.5 (cue out of the window)
quick: dqn_tmaze_k4_corridor_sweep6 | TMaze, 4-frame stack, corridor 6 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 6}' --frame-stack 4 --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 0.5 (chance)
quick: dqn_tmaze_k4_corridor_sweep8 | TMaze, 4-frame stack, corridor 8 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 8}' --frame-stack 4 --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 0.5 (chance)
quick: r2d2_tmaze20 | TMaze (corridor 20): R2D2 with stored LSTM state + burn-in solves it (a 4-frame DQN is at chance) | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' | eval/success_rate,eval/episodic_return | success >= 0.95 (optimal return 2.0)
quick: r2d2_tmaze20 | R2D2 ablation, stored state + burn-in 10: Q discrepancy at the last trained step | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' | model/delta_q_first,model/delta_q_last | smallest of the three (burn-in repairs stale states)
quick: r2d2_tmaze20_stored_noburnin | R2D2 ablation, stored state, no burn-in | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --burn-in 0 | model/delta_q_first,model/delta_q_last,eval/success_rate | between zero state and stored + burn-in
quick: r2d2_tmaze20_zero | R2D2 ablation, zero initial state, no burn-in | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --state-init zero --burn-in 0 | model/delta_q_first,model/delta_q_last,eval/success_rate | largest Q discrepancy, less reliable success
quick: r2d2_cartpole | MaskedCartPole: the LSTM recovers the velocities (network of the best evaluation during training kept) | r2d2_rnnstate --env-id seqrl/MaskedCartPole-v0 --total-timesteps 150000 --eval-episodes 20 --select-frequency 10000 --keep-best | eval/episodic_return,eval/last_network_episodic_return | >= 475 (kept network; last network reported too)
quick: rlhf_rm | Bradley-Terry reward model from pairwise preferences reaches the labeler's Bayes-optimal accuracy | rlhf_reward_model | eval/preference_accuracy,eval/bayes_accuracy | accuracy within 3 points of the ceiling
quick: rlhf_rm | The reward model orders completions like the hidden gold utility (within a prompt; BT fixes rewards only up to a per-prompt constant, Problem 21.3b) | rlhf_reward_model | eval/spearman_gold_within_prompt,eval/spearman_gold_centered,eval/spearman_gold | >= 0.8 (within prompt and prompt-centered; raw pooled reported)
quick: rlhf_rm | sigma(r1 - r2) is calibrated against the labeler's true preference probabilities | rlhf_reward_model | eval/calibration_error | small
quick: rlhf_kl_sweep0.0 | RLHF without a KL penalty (beta=0): proxy reward rises, gold reward peaks then falls (over-optimization) | rlhf_ppo_kl --kl-coef 0.0 | eval/gold_reward,eval/max_gold_reward,eval/proxy_reward,eval/kl,eval/sft_gold_reward | final gold below its peak and below SFT
quick: rlhf_kl_sweep0.1 | RLHF with a KL penalty (beta=0.1): gold reward ends well above SFT, no collapse | rlhf_ppo_kl --kl-coef 0.1 | eval/gold_reward,eval/sft_gold_reward,eval/kl,eval/bon_gold_reward,eval/bon_n | gold well above SFT; best-of-n at matched KL comparable
full: rlhf_kl_sweep0.01 | RLHF, beta=0.01 | rlhf_ppo_kl --kl-coef 0.01 | eval/gold_reward,eval/kl | between beta=0 and beta=0.1
full: rlhf_kl_sweep0.03 | RLHF, beta=0.03 | rlhf_ppo_kl --kl-coef 0.03 | eval/gold_reward,eval/kl | between beta=0 and beta=0.1
full: rlhf_kl_sweep0.3 | RLHF, beta=0.3 | rlhf_ppo_kl --kl-coef 0.3 | eval/gold_reward,eval/kl | small KL, gold above SFT
full: rlhf_bandit | RLHF, sequence-level (bandit) advantages instead of per-token GAE | rlhf_ppo_kl --advantage bandit | eval/gold_reward,eval/sft_gold_reward,eval/kl | about the same as GAE
full: ilql | GuessTheImage: per-token ILQL beats BC and filtered BC, approaching the optimal questioner | ilql_per_token | eval/episodic_return,eval/success_rate,eval/episodic_length,eval/normalized_score | > filtered BC >= BC (about 0.41), toward 0.783
full: ilql | GuessTheImage: BC on all data (the same model decoded with beta = 0) | ilql_per_token | eval/bc_episodic_return,eval/bc_success_rate | about the dataset mixture (0.412)
full: ilql | GuessTheImage: the behavior mixture and the optimal questioner (anchors) | ilql_per_token | dataset/mean_return,ref/optimal_episodic_return | 0.412 and 0.783
full: ilql_filtered_bc | GuessTheImage: filtered BC, top 20% of dialogues by return | ilql_per_token --bc-only --filter-top-frac 0.2 | eval/episodic_return,eval/success_rate | about 0.41 (premature lucky guesses dominate the top)
full: cql_utterance | GuessTheImage: per-utterance CQL (CHAI-style) beats BC and filtered BC | dialogue_cql_utterance | eval/episodic_return,eval/success_rate,eval/episodic_length,eval/normalized_score,eval/bc_proposer_episodic_return | > filtered BC >= BC, toward 0.783
EOF
)
# Settings shared by the small discrete-observation DQN runs (TMaze, ThreeStateLine), substituted above.
DQN_SMALL_ARGS="--learning-rate 5e-4 --train-frequency 1 --gradient-steps 1 --batch-size 128 --exploration-fraction 0.5 --end-e 0.05 --hidden-size 128 --target-network-frequency 500"
EXPERIMENTS="${EXPERIMENTS//DQN_SMALL_ARGS/$DQN_SMALL_ARGS}"

if [ -n "$AGGREGATE" ]; then
  OUT="${AGGREGATE%/}"
  [ -f "$OUT/experiments.txt" ] || { echo "benchmark.sh: $OUT/experiments.txt not found" >&2; exit 2; }
else
OUT="results/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT/runs" "$OUT/logs"
echo "# id | claim | command | metrics | prediction" >"$OUT/experiments.txt"
printf '%s\n' "$EXPERIMENTS" | grep -v '^\s*$' | while IFS= read -r line; do
  mode="${line%%:*}"; spec="${line#*:}"
  if [ "$mode" = full ] && [ "$QUICK" = 1 ]; then continue; fi
  id=$(echo "$spec" | cut -d'|' -f1 | xargs)
  if [ -n "$ONLY" ] && ! [[ "$id" =~ $ONLY ]]; then continue; fi
  echo "$spec" >>"$OUT/experiments.txt"
done
N_EXP=$(tail -n +2 "$OUT/experiments.txt" | cut -d'|' -f1 | sort -u | wc -l)
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
declare -A SEEN=()
while IFS='|' read -r id claim cmd metrics prediction; do
  [[ "$id" == \#* ]] && continue
  id=$(echo "$id" | xargs)
  [ -z "${SEEN[$id]:-}" ] || continue  # several claims (lines) may read the same run
  SEEN[$id]=1
  for seed in $SEEDS; do
    i=$((i + 1))
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    echo "[$(date +%H:%M:%S)] start $i/$TOTAL: $id seed=$seed"
    eval "run_one \"\$id\" \"\$seed\" $cmd" &  # eval: the command's quoted arguments stay whole
  done
done <"$OUT/experiments.txt"
wait
echo "benchmark: all runs finished in $((SECONDS - T0))s; aggregating"
fi

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
    fields = [f.strip() for f in line.split("|")]
    if len(fields) != 5:
        sys.exit(f"benchmark.sh: experiment line needs 5 '|'-separated fields, got {len(fields)}: {line}")
    exp_id, claim, cmd, metrics, prediction = fields
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
        script, _, script_args = cmd.partition(" ")
        command = f"python algos/{script}.py {script_args}"
        rows.append(f"| {claim} | `{command}` | `{metric}` | {cell} | {prediction} | {status} |")
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
exit $?
}
