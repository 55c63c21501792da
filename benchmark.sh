#!/usr/bin/env bash
# benchmark.sh: run the experiments behind the lecture's claims, check every claim's prediction, write results + plots.
#
#   bash benchmark.sh --quick                       # 1 seed, the quick experiments (parts 1 and 2)
#   bash benchmark.sh --quick --seeds "1 2 3 4 5"   # the same on 5 seeds (what docs/results.md publishes)
#   bash benchmark.sh                               # full: quick + full-mode experiments (dialogue, ...), 3 seeds
#   bash benchmark.sh --only 'tmaze|tiger' --jobs 2 # --only: a regex over experiment ids
#   bash benchmark.sh --aggregate results/<stamp>   # re-check and re-plot an earlier run's folder
#   bash benchmark.sh --validate                    # parse every experiment line and check, run nothing
#   bash benchmark.sh --quick --untrained           # control: the same runs with learning cut to nothing (UNTRAINED
#                                                   # below); every positive claim must fail there
#   bash benchmark.sh --publish results/<a> results/<b> ...  # publish runs: docs/results.md, docs/results.json,
#                                                   # docs/figures/, README's results table (between its markers)
#   bash benchmark.sh --check-published             # exit 1, a line per reason, if docs/results.* is stale
#   bash benchmark.sh --fingerprint                 # docs/fingerprints.json: what each line's code computes (below)
#   bash benchmark.sh --seeds drawn                 # report run: each line on its group's 5 drawn seeds (committed
#                                                   # code only; `drawn:3` for the first 3)
#
# Each run is `python algos/<script>.py --seed S --runs-dir <out>/runs/<id>/seed<S> <args>`; its summary.json is read
# back. Output goes to a new folder results/<timestamp>/ (never overwriting earlier results):
#   results.md  "claims holding: X of Y", then per claim: per-seed values, mean ± std, the prediction, its machine
#               check and the verdict (holds k/N seeds, or FAILS); run status (finished or crashed) separately
#   *.png       one figure per claim group (smoothed curves, mean and band over seeds, the prediction dashed)
#   log.txt, logs/<id>_seed<S>.log, runs/<id>/seed<S>/...: the runs, their output and their run dirs
# --untrained writes results/<timestamp>-untrained/ (no figures): results.md opens with "positive claims failing
# untrained: X of Y" and lists the positive claims that hold untrained (they cannot fail: a check to redesign), the
# errors (a crashed run or a missing metric: nothing to judge), the negative controls and the rows left out (why).
# --publish reads one or more results folders (e.g. a 5-seed --quick run, a full-mode run, an -untrained control; a
# relative path from the current directory or the repository) and writes, for every claim line of this file in its
# order: its command, per-seed values, mean and range, check and verdict, from the first folder given that ran its
# experiment with its command (else "not run in the published runs"); an anchor per experiment id
# (docs/results.md#<id>); the folders' date, machine, command, commit, seeds and wall times; the untrained control's
# line; each figure from the folder that its claims use for most of its series (the first given on a tie).
# docs/results.json holds the same, and the page and README's table are rendered from it alone:
# --check-published re-renders them and compares every claim line's id, command and check with this file.
# Exit status: 0 if every run finished and every checked claim holds (--untrained: every positive claim fails), 1
# otherwise (written after everything), 2 for bad usage or a malformed experiment line.
set -uo pipefail
CALLER_DIR=$PWD  # --publish folders may be given relative to it
cd "$(dirname "$0")"
{  # the whole script is one block, parsed before it runs, so editing this file mid-run cannot change a run

QUICK=0
SEEDS=""
ONLY=""
AGGREGATE=""
VALIDATE=0
UNTRAINED=0
PUBLISH=()
CHECK_PUBLISHED=0
FINGERPRINT=0
JOBS=$(nproc 2>/dev/null || echo 2)
ARGV=$(python3 -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' "$@")  # as pasted: quoted where bash needs it
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --seeds) SEEDS="${2:?--seeds needs a value}"; shift ;;
    --only) ONLY="${2:?--only needs a regex}"; shift ;;
    --jobs) JOBS="${2:?--jobs needs a number}"; shift ;;
    --aggregate) AGGREGATE="${2:?--aggregate needs a results folder}"; shift ;;
    --validate) VALIDATE=1 ;;
    --untrained) UNTRAINED=1 ;;
    --publish)
      while [ $# -gt 1 ] && [[ "$2" != --* ]]; do PUBLISH+=("$2"); shift; done
      [ ${#PUBLISH[@]} -gt 0 ] || { echo "benchmark.sh: --publish needs results folders" >&2; exit 2; } ;;
    --check-published) CHECK_PUBLISHED=1 ;;
    --fingerprint) FINGERPRINT=1 ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    *) echo "benchmark.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$SEEDS" ] || { [ "$QUICK" = 1 ] && SEEDS="1" || SEEDS="1 2 3"; }
if [[ "$SEEDS" =~ ^drawn(:[1-9][0-9]*)?$ ]]; then  # report seeds: committed code and checks only
  DIRTY=$(git status --porcelain -- algos envs benchmark.sh 2>/dev/null) || {
    echo "benchmark.sh: --seeds drawn needs a git checkout (report seeds are drawn from committed code)" >&2; exit 2
  }
  [ -z "$DIRTY" ] || {
    echo "benchmark.sh: --seeds drawn runs committed code: commit algos/, envs/ and benchmark.sh first" >&2; exit 2
  }
else
  for s in $SEEDS; do
    [[ "$s" =~ ^[0-9]+$ ]] || { echo "benchmark.sh: --seeds takes integers or drawn[:N], got '$s'" >&2; exit 2; }
  done
fi
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "benchmark.sh: --jobs takes a positive integer, got '$JOBS'" >&2; exit 2; }

# The experiments, one claim per line:
#   mode: id | claim | script and arguments | metrics shown | prediction in words | check
# `quick:` lines run in --quick mode too, `full:` lines only in full mode. Several lines may share an id (one run,
# several claims; their commands must be the same: only the first line's runs). `{run:<id>}` in a command is the run
# dir of an earlier experiment's run of the same seed (the run waits for it; `--only` must select both). The check is
# evaluated by the
# aggregation on every seed: conditions separated by ` ; `, each a comparison (chains allowed: 0.45 <= x <= 0.55) of
# arithmetic (+ - * and abs/min/max) over numbers and metric refs, `metric/name` (this experiment's summary.json) or
# `other_id:metric/name` (another experiment, same seed). A condition prefixed `mean:` is judged once, on the means over
# seeds (used for "A beats B on average" orderings). `info` instead of a check marks an anchor or a fact of the data:
# reported, not judged. A check prefixed `negative(<id>):` is a negative control: it predicts a failure (memoryless at
# chance), so it holds untrained by nature and is left out of the --untrained count; <id> names the experiment of the
# positive claim on the same task (same --env-id) that it pairs with. A check prefixed `consistency:` compares a run's
# training curve with its own evaluation (the figure agrees with the claim): it is judged in a trained run like any
# claim, and left out of the --untrained count (an untrained run has no training curve to compare), reason stated.
EXPERIMENTS=$(cat <<'EOF'
quick: ppo_line_none | ThreeStateLine (Problem 21.1): the best memoryless policy is stochastic; started at p(right) = 0.95 (10.5 steps), memoryless PPO learns p(right) = 1/2, 2 steps | ppo_recurrent --env-id seqrl/ThreeStateLine-v0 --rnn none --init-action-bias 0 3 --total-timesteps 30000 --eval-episodes 1000 | eval/p_right_first_step,eval/episodic_length | 0.5 and 2.0 (tuning seeds 101-105: 0.48-0.49) | 0.42 <= eval/p_right_first_step <= 0.58 ; eval/episodic_length <= 2.3
quick: ppo_line_none | ThreeStateLine: the greedy version of that policy is deterministic and fails half the episodes | ppo_recurrent --env-id seqrl/ThreeStateLine-v0 --rnn none --init-action-bias 0 3 --total-timesteps 30000 --eval-episodes 1000 | eval/greedy_episodic_length | about 10.5 (half the episodes hit the 20-step limit) | negative(ppo_line_none): eval/greedy_episodic_length >= 8
quick: ppo_line_gru | ThreeStateLine with memory (GRU): reverse after a wall bump, 1.5 steps | ppo_recurrent --env-id seqrl/ThreeStateLine-v0 --rnn gru --total-timesteps 30000 --eval-episodes 1000 | eval/episodic_length,eval/p_reverse_second_step | 1.5 and 1.0 | eval/episodic_length <= 1.6 ; eval/p_reverse_second_step >= 0.95
quick: ppo_corridor_mc | ShortCorridor (Sutton & Barto 13.1): started at p(right) = 0.12 (return -35.6), memoryless PPO with Monte Carlo returns learns the stochastic optimum | ppo_recurrent --env-id seqrl/ShortCorridor-v0 --rnn none --returns mc --num-steps 100 --init-action-bias 0 -2 --total-timesteps 500000 --eval-episodes 10000 --greedy-eval-episodes 1000 | eval/p_right_first_step,eval/episodic_return | p(right) = 2 - sqrt(2) = 0.586, return -11.66 (tuning seeds 101-108 at 500k steps: 0.56-0.63, return -11.5 to -11.8) | 0.50 <= eval/p_right_first_step <= 0.68 ; eval/episodic_return >= -13
quick: ppo_corridor_mc | ShortCorridor, Monte Carlo: the training curve (the first episodes of each rollout, the ones trained on) agrees with the evaluation | ppo_recurrent --env-id seqrl/ShortCorridor-v0 --rnn none --returns mc --num-steps 100 --init-action-bias 0 -2 --total-timesteps 500000 --eval-episodes 10000 --greedy-eval-episodes 1000 | charts/late_episodic_return,eval/episodic_return | mean training return over the last 20% of the steps within 0.5 of the evaluation's (10000 episodes; tuning seeds 101-108 at 500k steps: differences -0.35 to +0.23; at 1M -0.22 to +0.21; at 100k -0.89 to +0.33) | consistency: abs(charts/late_episodic_return - eval/episodic_return) <= 0.5
quick: ppo_corridor_td | ShortCorridor: the same PPO from the same start with a bootstrapped critic on o (one-step TD advantages) overshoots to a deterministic policy and stalls | ppo_recurrent --env-id seqrl/ShortCorridor-v0 --rnn none --gae-lambda 0 --init-action-bias 0 -2 --total-timesteps 100000 --eval-episodes 1000 | eval/p_right_first_step,eval/episodic_return | p(right) -> 1, episodes run into the 100-step limit (tuning seeds 101-105: p 0.99-1.00) | eval/p_right_first_step >= 0.95 ; eval/episodic_return <= ppo_corridor_mc:eval/episodic_return - 30
quick: ppo_tmaze_gru | TMaze (corridor 10) with a GRU (one torso for actor and critic: the value loss also trains the memory) | ppo_recurrent --env-id seqrl/TMaze-v0 --rnn gru --shared-torso --total-timesteps 200000 --ent-coef 0.03 --eval-episodes 400 | eval/success_rate,eval/episodic_return | success ~1 (optimal return 3.0; tuning seeds 111-130: 0.99-1.00) | eval/success_rate >= 0.9
quick: ppo_tmaze_none | TMaze (corridor 10), memoryless (same recipe) | ppo_recurrent --env-id seqrl/TMaze-v0 --rnn none --shared-torso --total-timesteps 200000 --ent-coef 0.03 --eval-episodes 400 | eval/success_rate,eval/episodic_return | success 0.5 (chance at the junction; tuning seeds 111-130: 0.37-0.56 on 100 episodes) | negative(ppo_tmaze_gru): 0.35 <= eval/success_rate <= 0.65
full: ppo_cartpole_v1 | CartPole-v1 (fully observed), memoryless, CleanRL ppo.py's settings: as good as CleanRL ppo.py (mean 491.6 over its last 20 episodes, seeds 101-105 on this machine) | ppo_recurrent --env-id CartPole-v1 --rnn none --num-envs 4 --num-steps 128 --learning-rate 2.5e-4 --total-timesteps 500000 | eval/episodic_return | within 5% of CleanRL: >= 467 | eval/episodic_return >= 467
full: ppo_cartpole_gru | MaskedCartPole with a GRU: memory recovers the velocities, and the network PPO ends with keeps the pole up (RL Zoo's RecurrentPPO recipe with rewards normalized by the return's running std instead of per-minibatch advantage normalization, gamma 0.99, lambda 0.95) | ppo_recurrent --env-id seqrl/MaskedCartPole-v0 --rnn gru PPO_CARTPOLE_ARGS | eval/episodic_return,eval/greedy_episodic_return | about 500: on every seed >= 250 and 3x memoryless (~43), on average >= 400, as the LSTM (tuning seeds 111-116: 496-500; at lambda 0.8, 101-112: 491-500; the plain RL Zoo recipe ended at 164-500) | eval/episodic_return >= 250 ; eval/episodic_return >= 3 * ppo_cartpole_none:eval/episodic_return ; mean: eval/episodic_return >= 400
full: ppo_cartpole_gru | MaskedCartPole, GRU: the training curve stays at the top to the end (no late collapse): training episodes of the last 20% of the steps | ppo_recurrent --env-id seqrl/MaskedCartPole-v0 --rnn gru PPO_CARTPOLE_ARGS | charts/late_episodic_return,eval/episodic_return | on every seed >= 250, on average >= 400 (tuning seeds 111-116: 469-500; the plain recipe 380 on seed 101) | consistency: charts/late_episodic_return >= 250 ; mean: charts/late_episodic_return >= 400
quick: ppo_cartpole_lstm | MaskedCartPole with an LSTM, the same recipe: the network PPO ends with keeps the pole up | ppo_recurrent --env-id seqrl/MaskedCartPole-v0 --rnn lstm PPO_CARTPOLE_ARGS | eval/episodic_return,eval/greedy_episodic_return | about 500, now and then a seed whose cart drifts off: on every seed >= 250 and 3x memoryless (~43), on average >= 400 (tuning seeds 101-120: >= 475 on 19 of 20, 104: 298) | eval/episodic_return >= 250 ; eval/episodic_return >= 3 * ppo_cartpole_none:eval/episodic_return ; mean: eval/episodic_return >= 400
quick: ppo_cartpole_lstm | MaskedCartPole, LSTM: the training curve stays at the top to the end (training episodes of the last 20% of the steps) | ppo_recurrent --env-id seqrl/MaskedCartPole-v0 --rnn lstm PPO_CARTPOLE_ARGS | charts/late_episodic_return,eval/episodic_return | on every seed >= 250, on average >= 400 (tuning seeds 111-120: 430-500) | consistency: charts/late_episodic_return >= 250 ; mean: charts/late_episodic_return >= 400
quick: ppo_cartpole_none | MaskedCartPole, memoryless (same recipe) | ppo_recurrent --env-id seqrl/MaskedCartPole-v0 --rnn none PPO_CARTPOLE_ARGS | eval/episodic_return | ~45 (the pole falls without velocities) | negative(ppo_cartpole_lstm): eval/episodic_return <= 100
quick: ppo_tiger_gru | Tiger with a GRU: listens before opening, positive return | ppo_recurrent --env-id seqrl/Tiger-v0 --rnn gru --no-bootstrap-truncated --total-timesteps 100000 --eval-episodes 1000 | eval/episodic_return,eval/listens_per_episode,eval/success_rate | > 0 (optimum 5.01), >= 2 listens (tuning seeds 101-110: return 3.14-4.96, 2.72-2.95 listens) | eval/episodic_return >= 2.5 ; eval/listens_per_episode >= 2
quick: ppo_tiger_none | Tiger, memoryless | ppo_recurrent --env-id seqrl/Tiger-v0 --rnn none --no-bootstrap-truncated --total-timesteps 100000 --eval-episodes 1000 | eval/episodic_return,eval/listens_per_episode | < 0 (best memoryless -7.5; tuning seeds 101-110: -10.3 to -5.2) | negative(ppo_tiger_gru): eval/episodic_return <= -2
quick: ssm_twodoors | TwoDoors (Problem 21.2): after a failed try the latent model predicts retry-same ~0, other ~1 | ssm_vae_q --env-id seqrl/TwoDoors-v0 | model/p_pass_retry_same_door,model/p_pass_other_door | 0 and 1 (tuning seeds: same <= 0.001, other 0.88-1.00) | model/p_pass_retry_same_door <= 0.1 ; model/p_pass_other_door >= 0.75
quick: ssm_twodoors | TwoDoors (Problem 21.2): a Markovian model of p(o' given o, a) predicts the same for both doors | ssm_vae_q --env-id seqrl/TwoDoors-v0 | model/markov_p_pass_same_door,model/markov_p_pass_other_door | 0.5 and 0.5 | negative(ssm_twodoors): 0.4 <= model/markov_p_pass_same_door <= 0.6 ; 0.4 <= model/markov_p_pass_other_door <= 0.6
quick: ssm_twodoors | TwoDoors: Q-learning on the latent belief beats the best memoryless policy | ssm_vae_q --env-id seqrl/TwoDoors-v0 | eval/episodic_return | 0.95 (memoryless best 0.90; tuning seeds 0.943-0.953) | eval/episodic_return >= 0.92
quick: ssm_twodoors | Problem 21.2(b): p(pass within k = 5 tries of the same door) after a failed try: the Markovian count model predicts 1 - 0.5^5 = 0.97, the latent model about the truth 0.5 | ssm_vae_q --env-id seqrl/TwoDoors-v0 | model/markov_p_pass_within_5_tries,model/p_pass_within_5_tries,model/true_p_pass_within_5_tries | Markov ~0.97, latent near 0.5 (tuning seeds: Markov 0.968-0.972, latent 0.49-0.68) | model/markov_p_pass_within_5_tries >= 0.9 ; model/p_pass_within_5_tries <= model/markov_p_pass_within_5_tries - 0.15
quick: ssm_tmaze5 | TMaze (corridor 5): Q-learning on the latent belief remembers the cue (network of the best evaluation during training kept) | ssm_vae_q --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 5}' --seq-len 16 --total-timesteps 30000 --select-frequency 3000 --keep-best | eval/success_rate,eval/last_network_success_rate,eval/one_step_obs_error | success ~1 (memoryless 0.5); last network reported | eval/success_rate >= 0.9
quick: dqn_cartpole_k4 | MaskedCartPole: a 4-frame stack recovers the velocities, and the network DQN ends with keeps the pole up (10-step targets; the network also reads the frame differences) | dqn_framestack --frame-stack 4 --select-frequency 2000 | eval/episodic_return,select/late_episodic_return | >= 475 on every seed, far above k = 1 (~45) (tuning seeds 101-110: 10 of 10 at 500; with zoo's 128 gradient steps a phase 101-115: 15 of 15; without the differences 9 of 10, 110: 462) | eval/episodic_return >= 475 ; eval/episodic_return >= dqn_cartpole_k1:eval/episodic_return + 100
quick: dqn_cartpole_k4 | MaskedCartPole, DQN k = 4: the greedy evaluations during the last 10% of training stay at the top (no late collapse) | dqn_framestack --frame-stack 4 --select-frequency 2000 | select/late_episodic_return,eval/episodic_return | >= 450 (tuning seeds 101-110: 500) | consistency: select/late_episodic_return >= 450
quick: dqn_cartpole_k1 | MaskedCartPole: Q-learning on single observations fails | dqn_framestack --frame-stack 1 --total-timesteps 40000 | eval/episodic_return | ~45 (tuning seeds 101-103: 42-43) | negative(dqn_cartpole_k4): eval/episodic_return <= 100
quick: dqn_line_k1 | ThreeStateLine (Problem 21.1): the greedy Q policy on o is deterministic and fails half the episodes | dqn_framestack --env-id seqrl/ThreeStateLine-v0 --frame-stack 1 --total-timesteps 20000 DQN_SMALL_ARGS --gamma 0.99 | eval/failure_rate,eval/episodic_return | failure 0.5 (stochastic optimum: 0, return -2; tuning seeds 101-105: 0.42-0.56) | negative(ppo_line_gru): 0.35 <= eval/failure_rate <= 0.65
quick: dqn_tmaze_k4_corridor_sweep1 | TMaze, 4-frame stack, corridor 1 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 1}' --frame-stack 4 --total-timesteps 20000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 1 (cue inside the window; tuning seeds 101-105: 1.00) | eval/success_rate >= 0.95
quick: dqn_tmaze_k4_corridor_sweep2 | TMaze, 4-frame stack, corridor 2 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 2}' --frame-stack 4 --total-timesteps 20000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 1 (cue inside the window; tuning seeds 101-105: 1.00) | eval/success_rate >= 0.95
quick: dqn_tmaze_k4_actions_corridor3 | TMaze corridor 3: with the previous actions in the stack a wall bump and a step east differ, and the cue stays in the window | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 3}' --frame-stack 4 --stack-actions --total-timesteps 30000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate,eval/episodic_length | success 1, 4 steps (tuning seeds 101-105: 1.00, 4.0; frames alone 0.5 / 0.5 / 1.0) | eval/success_rate >= 0.95
quick: dqn_tmaze_k4_corridor_sweep4 | TMaze, 4-frame stack, corridor 4 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 4}' --frame-stack 4 --total-timesteps 20000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 0.5 (cue out of the window; tuning seeds 101-105: 0.49-0.62) | negative(dqn_tmaze_k4_corridor_sweep2): 0.3 <= eval/success_rate <= 0.7
quick: dqn_tmaze_k4_corridor_sweep8 | TMaze, 4-frame stack, corridor 8 | dqn_framestack --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 8}' --frame-stack 4 --total-timesteps 20000 DQN_SMALL_ARGS --gamma 0.99 | eval/success_rate | 0.5 (chance; tuning seeds 101-105: 0.50-0.62) | negative(dqn_tmaze_k4_corridor_sweep2): 0.3 <= eval/success_rate <= 0.7
quick: r2d2_tmaze20 | TMaze (corridor 20): R2D2 with stored LSTM state + burn-in solves it (a 4-frame DQN is at chance) | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --buffer-size 30000 --total-timesteps 150000 | eval/success_rate,eval/episodic_return,replay/full_histories_ratio | success ~1 (optimal return 2.0; tuning seeds 111-130 learn the cue by 46k-124k steps: at 100k 18 of 20 solve it, at 150k 20 of 20) | eval/success_rate >= 0.95
quick: r2d2_tmaze20 | R2D2 ablation on one network (the last): Q discrepancy at the last trained row of replayed sequences started from zeros > from the stored state > from the stored state + burn-in | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --buffer-size 30000 --total-timesteps 150000 | model/final_delta_q_last_zero,model/final_delta_q_last_stored,model/final_delta_q_last_stored_burn_in | zero > stored on every seed, and the zero-state error is large once Q depends on the memory: at least 0.1, 5% of the optimal return 2 (untrained: 0.0001); burn-in smaller still, judged on the mean (tuning seeds 111-115 at 150k: zero 1.00-1.18, stored 0.036-0.107, stored + burn-in 0.020-0.059, below stored on 5 of 5) | model/final_delta_q_last_zero >= 0.1 ; model/final_delta_q_last_zero > model/final_delta_q_last_stored ; mean: model/final_delta_q_last_stored_burn_in < model/final_delta_q_last_stored
full: r2d2_tmaze20_stored_noburnin | R2D2 ablation run, stored state, no burn-in (trains its own network) | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --buffer-size 30000 --total-timesteps 150000 --burn-in 0 | model/delta_q_first,model/delta_q_last,eval/success_rate | solves it on most seeds | info
full: r2d2_tmaze20_zero | R2D2 ablation run, zero initial state, no burn-in (trains its own network) | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --buffer-size 30000 --total-timesteps 150000 --state-init zero --burn-in 0 | model/delta_q_first,model/delta_q_last,eval/success_rate | varies by seed: a sequence from the episode start holds the cue and the junction in its 30 trained rows, where a zero state is exact, so the zero state can learn the cue too (tuning seeds 101-105: 0.5 / 0.5 / 1 / 0 / 0.38) | info
full: trxl_tmaze20 | TMaze (corridor 20, longer than every replayed window: burn-in 4 + 10 trained + 5 target rows, and than the DTQN window of 16): R2D2 with a gated Transformer-XL whose memory (the layer inputs of the last 32 steps, 2 layers) is stored in replay and refreshed by a burn-in solves it | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' | eval/success_rate,eval/episodic_return,replay/bytes_per_row | success ~1 (optimal return 2.0; tuning seeds 101-105: 1.00, the cue learned after 79k-85k of the 150k steps) | eval/success_rate >= 0.95
full: trxl_tmaze20 | Transformer-XL ablation on one network (the last): Q discrepancy at the last trained row of replayed sequences started from an empty memory > from the stored memory; and at the same burn-in of 4 rows, where modes (a) and (c) start the trained rows, from an empty memory + burn-in > from the stored memory + burn-in | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' | model/final_delta_q_last_zero,model/final_delta_q_last_stored,model/final_delta_q_last_zero_burn_in,model/final_delta_q_last_stored_burn_in | zero > stored on every seed and at least 0.1 (untrained, seed 101: 0.015; tuning seeds 101-105: zero 0.79-1.17, stored 0.05-0.11); empty + burn-in > stored + burn-in on every seed and at least 0.1 (tuning seeds 101, 102: 0.80 / 0.79 against 0.023 / 0.014) | model/final_delta_q_last_zero >= 0.1 ; model/final_delta_q_last_zero > model/final_delta_q_last_stored ; model/final_delta_q_last_zero_burn_in >= 0.1 ; model/final_delta_q_last_zero_burn_in > model/final_delta_q_last_stored_burn_in
full: trxl_tmaze20 | The stored memory is stale (older networks wrote it), and the burn-in of 4 rows repairs at most a part of that: it recomputes only the 4 newest of the 32 entries and keeps the other 28 as stored (Q discrepancy at the last trained row from the stored memory, and with the burn-in; no comparison with the LSTM's burn-in: the two recipes differ in burn-in, trained length, learning rate and steps) | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' | model/final_delta_q_last_stored,model/final_delta_q_last_stored_burn_in | stale: at least 0.005 on every seed (an untrained network's is exact: 3e-7; tuning seeds 101, 102: 0.023, 0.013); the burn-in's ratio is shown, not checked (tuning seeds 101, 102: 1.00, 1.11; 101-105 at an earlier commit: 0.63-0.83) | model/final_delta_q_last_stored >= 0.005
full: trxl_tmaze20_zero | TMaze-20, the same transformer trained from an empty memory at every replayed sequence (acting still carries the memory): the cue never enters a trained window | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --memory zero | eval/success_rate,eval/episodic_return | chance 0.5 (tuning seed 101: 0.50) | negative(trxl_tmaze20): eval/success_rate <= 0.65
full: trxl_tmaze20_window | TMaze-20, DTQN-style: the same transformer without memory, acting on its last 16 steps, trained on windows of 15 steps from their first step | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --memory window | eval/success_rate,eval/episodic_return | chance 0.5 (tuning seeds 101, 102: 0.50) | negative(trxl_tmaze20): eval/success_rate <= 0.65
full: trxl_tmaze20_exact | TMaze-20 with (f) exact recompute: an empty memory L x M = 64 rows before t0 (capped at the episode start: TMaze-20's episodes are about 22 steps) and a burn-in of those rows, nothing stored: the cue is inside every recompute | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --memory exact | eval/success_rate,eval/episodic_return,perf/learner_ms_per_update,replay/bytes_per_row | success ~1, as the stored memory | eval/success_rate >= 0.95
full: trxl_tmaze20_exact | TMaze-20, at equal success: the exact recompute's learner step costs more than the stored memory's (its burn-in runs through the online and the target network; TMaze-20's episodes are short, so it recomputes about 20 rows, not L x M = 64) while its replay row is 13 times smaller | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --memory exact | perf/learner_ms_per_update,replay/bytes_per_row | above 1.3 times (c)'s learner time on every seed (tuning seeds 101, 102: 64-65 ms against (c)'s 33-35, about 1.9 times) | perf/learner_ms_per_update > 1.3 * trxl_tmaze20:perf/learner_ms_per_update
full: trxl_tmaze20_window32 | TMaze-20, DTQN with a window longer than the cue's distance: acting on the last 32 steps, trained on windows of 27 + 5 rows from their first step (a loss at each of the 27), so the windows from an episode's start hold the cue and the junction | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --memory window --window 32 --seq-len 27 | eval/success_rate,eval/episodic_return,perf/learner_ms_per_update,replay/bytes_per_row | success ~1: a window past the cue needs no memory | eval/success_rate >= 0.95
full: trxl_tmaze20_fresh0 | TMaze-20, (c) with layer 0 recomputed: the replay stores only the layer-1 inputs, and layer 0's entries (embeddings of rows the window gathers anyway) are recomputed with the current network before the burn-in | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 20}' --no-store-layer0 | eval/success_rate,eval/episodic_return,perf/learner_ms_per_update,replay/bytes_per_row | success ~1 as (c), at 299 bytes a row instead of 555 (tuning seeds 101-103: 1.00; learner 33-38 ms an update against (c)'s 33-35) | eval/success_rate >= 0.95
full: trxl_tmaze50 | TMaze with a 50-step corridor, past the default memory (M = 32 steps, two attention hops to the cue): with M = 64 one hop reaches the cue (reach M x 2 layers = 128 steps) and the stored memory + burn-in solves it | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 50}' --memory-length 64 --buffer-size 60000 --total-timesteps 400000 | eval/success_rate,eval/episodic_return | success ~1 (optimal return -1.0; tuning seeds 101, 102: 1.00, the cue learned after ~136k and ~240k steps; with the default M = 32, seed 101 stayed at chance, 0.50, after 500k steps) | eval/success_rate >= 0.95
full: trxl_tmaze50_m32 | Limitation, the learnable reach: TMaze-50 with the default M = 32. The cue, 51 steps before the junction, is within the reach L x M = 64 but two attention hops away: the junction must read a layer-1 entry that read the cue. That entry is written without gradient (detail 5), and no loss asks the corridor steps that could write it to carry the cue, so the stored memory + burn-in stays at chance where M = 64 (one hop) solves it: what is learnable reaches about M, not L x M | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 50}' --buffer-size 60000 --total-timesteps 400000 | eval/success_rate,eval/episodic_return | chance 0.5 (tuning seeds: 101 0.50 after 500k steps, 102 0.50 after 400k) | negative(trxl_tmaze50): eval/success_rate <= 0.65
full: trxl_tmaze50_m32_exact | The learnable reach with staleness ruled out: TMaze-50, M = 32, (f) exact recompute, whose memory at t0 is exactly the episode's (never stale) but, like the stored one, is computed without gradient (the burn-in), so nothing trains the first hop either: at chance like the stored memory | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 50}' --memory exact --buffer-size 60000 --total-timesteps 400000 | eval/success_rate,eval/episodic_return,perf/learner_ms_per_update | chance 0.5 (not tuned: the settings of trxl_tmaze50_m32; predicted from the probe TMaze-40 with 4 layers and M = 16, where (f) stayed at chance on tuning seed 101) | negative(trxl_tmaze50): eval/success_rate <= 0.65
full: cost_stored_layers2 | Store or recompute, learner cost along the attention reach L x M (TMaze corridor 200: episodes longer than every L x M; M = 32, L = 2 layers, L x M = 64): (c) the stored memory + burn-in, 19 rows a sequence that read the M stored entries of every layer | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --num-layers 2 COST_ARGS | perf/learner_ms_per_update,replay/bytes_per_row | the rows per sequence the same at every L x M; the stored bytes a row grow with L (555 at L = 2; (f) 43) | info
full: cost_exact_layers2 | Store or recompute, L x M = 64 (L = 2): (f) exact recompute, an empty memory 64 rows before t0 and a burn-in of those rows, 79 rows a sequence, nothing stored | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --memory exact --num-layers 2 COST_ARGS | perf/learner_ms_per_update,replay/bytes_per_row | dearer than (c) by a factor that grows with L x M: above 1.5 times (c)'s learner time (tuning seed 101: 71 ms against 32, 2.2 times) | perf/learner_ms_per_update > 1.5 * cost_stored_layers2:perf/learner_ms_per_update
full: cost_stored_layers4 | Store or recompute, learner cost along the attention reach L x M (TMaze corridor 200: episodes longer than every L x M; M = 32, L = 4 layers, L x M = 128): (c) the stored memory + burn-in, 19 rows a sequence that read the M stored entries of every layer | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --num-layers 4 COST_ARGS | perf/learner_ms_per_update,replay/bytes_per_row | the rows per sequence the same at every L x M; the stored bytes a row grow with L (1067 at L = 4; (f) 43) | info
full: cost_exact_layers4 | Store or recompute, L x M = 128 (L = 4): (f) exact recompute, an empty memory 128 rows before t0 and a burn-in of those rows, 143 rows a sequence, nothing stored | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --memory exact --num-layers 4 COST_ARGS | perf/learner_ms_per_update,replay/bytes_per_row | dearer than (c) by a factor that grows with L x M: above 1.5 times (c)'s learner time (tuning seed 101: 216 ms against 81, 2.7 times) | perf/learner_ms_per_update > 1.5 * cost_stored_layers4:perf/learner_ms_per_update
full: cost_stored_layers6 | Store or recompute, learner cost along the attention reach L x M (TMaze corridor 200: episodes longer than every L x M; M = 32, L = 6 layers, L x M = 192): (c) the stored memory + burn-in, 19 rows a sequence that read the M stored entries of every layer | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --num-layers 6 COST_ARGS | perf/learner_ms_per_update,replay/bytes_per_row | the rows per sequence the same at every L x M; the stored bytes a row grow with L (1579 at L = 6; (f) 43) | info
full: cost_exact_layers6 | Store or recompute, L x M = 192 (L = 6): (f) exact recompute, an empty memory 192 rows before t0 and a burn-in of those rows, 207 rows a sequence, nothing stored | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --memory exact --num-layers 6 COST_ARGS | perf/learner_ms_per_update,replay/bytes_per_row | dearer than (c) by a factor that grows with L x M: above 3 times (c)'s learner time (tuning seed 101: 508 ms against 96, 5.3 times) | perf/learner_ms_per_update > 3 * cost_stored_layers6:perf/learner_ms_per_update
full: cost_exact_layers6 | Store or recompute: the exact recompute's price grows with the reach, the stored memory's does not: the learner-time ratio (f) / (c) at L x M = 192 is above 1.5 times the ratio at L x M = 64 | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --memory exact --num-layers 6 COST_ARGS | perf/learner_ms_per_update | ratio (f)/(c) 192 over ratio 64 above 1.5 (tuning seed 101: 5.3 / 2.2 = 2.4) | perf/learner_ms_per_update * cost_stored_layers2:perf/learner_ms_per_update > 1.5 * cost_stored_layers6:perf/learner_ms_per_update * cost_exact_layers2:perf/learner_ms_per_update
full: cost_episode_layers2 | Store or recompute, L = 2: (e) every replayed sequence re-encoded from its episode's first step (AMAGO-style), hundreds of rows on this corridor | r2d2_trxl_memory --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --memory episode --num-layers 2 COST_ARGS | perf/learner_ms_per_update,replay/bytes_per_row,charts/mean_episodic_length | dearer than (f) at the same L: its cost grows with the episode, not with L x M (tuning seed 101: 448 ms, episodes of ~400 steps) | info
full: cost_lstm | Store or recompute, the recurrent reference at matched rows: r2d2_rnnstate's stored LSTM state with the same replay, batch and updates, and (c)'s rows: a burn-in of 4, 10 trained rows overlapping by 5, 5 target rows | r2d2_rnnstate --env-id seqrl/TMaze-v0 --env-kwargs '{"corridor_length": 200}' --delta-q-frequency 1000000000 --seq-len 10 --seq-overlap 5 --burn-in 4 COST_ARGS | perf/learner_ms_per_update,replay/bytes | the cheapest: one (h, c) a row, no attention | info
full: r2d2_cartpole | MaskedCartPole: the LSTM recovers the velocities, and the network R2D2 ends with keeps the pole up (scaled inputs, gamma 0.995 with 10-step returns, a faster annealed rate, a 128-unit LSTM) | r2d2_rnnstate R2D2_CARTPOLE_ARGS | eval/episodic_return,select/late_episodic_return | >= 475 on every seed (a memoryless agent ~45; tuning seeds 101-115: 15 of 15, 495-500; with 64 units 14 of 15, 109: 428; the TMaze settings: 185-500) | eval/episodic_return >= 475
full: r2d2_cartpole | MaskedCartPole, R2D2: the greedy evaluations during the last 10% of training stay at the top (no late collapse) | r2d2_rnnstate R2D2_CARTPOLE_ARGS | select/late_episodic_return,eval/episodic_return | >= 450 (tuning seeds 101-115: 489-500) | consistency: select/late_episodic_return >= 450
full: r2d2_cartpole | Storing every step's full history costs O(T^2) memory, stored RNN states O(T): the ratio grows with the episode length (MaskedCartPole, episodes of hundreds of steps, against TMaze-20, ~22) | r2d2_rnnstate R2D2_CARTPOLE_ARGS | replay/bytes,replay/bytes_full_histories,replay/full_histories_ratio | full histories / stored larger on MaskedCartPole than on TMaze-20 | replay/full_histories_ratio > r2d2_tmaze20:replay/full_histories_ratio
quick: rlhf_rm | Bradley-Terry reward model from pairwise preferences gets close to the labeler's Bayes-optimal accuracy | rlhf_reward_model | eval/preference_accuracy,eval/bayes_accuracy | within 5 points of the ceiling on 12,000 held-out pairs (label noise 0.35 points, 1 SD; tuning seeds 101-103: 1.7-4.0 points below, every setting tried on 101-110 up to 4.1: facts not carried over to held-out phrasings, not overfitting) | eval/preference_accuracy >= eval/bayes_accuracy - 0.05
quick: rlhf_rm | The reward model orders completions like the hidden gold utility on held-out phrasings (within a prompt; BT fixes rewards only up to a per-prompt constant, Problem 21.3b) | rlhf_reward_model | eval/spearman_gold_within_prompt,eval/spearman_gold_centered,eval/spearman_gold | >= 0.6 on every seed (tuning seeds 101-103: 0.76-0.88); raw pooled reported | eval/spearman_gold_within_prompt >= 0.6 ; eval/spearman_gold_centered >= 0.65
quick: rlhf_rm | sigma(r1 - r2) is calibrated against the labeler's true preference probabilities | rlhf_reward_model | eval/calibration_error | small (tuning seeds 101-103: 0.017-0.037) | eval/calibration_error <= 0.05
full: rlhf_rm_budget | With 4x the preference data (12,000 ranked comparisons instead of 3,000) the reward model reaches the labeler's ceiling on average | rlhf_reward_model --n-train-prompts 12000 | eval/preference_accuracy,eval/bayes_accuracy,eval/spearman_gold_within_prompt,eval/calibration_error | within 1 point of the ceiling on average, within 3.5 on every seed; within-prompt Spearman >= 0.8, calibration error <= 0.03 (tuning seeds 101-105: 2.4 / 1.0 / 0.24 points below on average at 3,000 / 6,000 / 12,000 comparisons, at most 4.5 / 2.6 / 2.4; Spearman at 12,000 0.87-0.96, calibration 0.006-0.023) | mean: eval/preference_accuracy >= eval/bayes_accuracy - 0.01 ; eval/preference_accuracy >= eval/bayes_accuracy - 0.035 ; eval/spearman_gold_within_prompt >= 0.8 ; eval/calibration_error <= 0.03
quick: rlhf_kl_sweep0.0 | RLHF without a KL penalty (beta=0): the proxy reward rises while the gold reward peaks and falls back, below SFT on average (over-optimization) | rlhf_ppo_kl --kl-coef 0.0 --num-updates 200 | eval/late_gold_reward,eval/gold_reward,eval/max_gold_reward,eval/sft_gold_reward,eval/proxy_reward,eval/sft_proxy_reward,eval/kl | on every seed the late gold (mean of the evaluations in the last 20% of the updates) at least 0.4 below its peak and the proxy up by >= 0.3; on average the late gold 0.5 below SFT (tuning seeds 111-120: peak - late 0.65-2.77, proxy +0.52 to +1.41, late - SFT -1.89 to +0.16, mean -0.97; the last evaluation alone was 0.30 below the peak on 115) | eval/late_gold_reward <= eval/max_gold_reward - 0.4 ; eval/proxy_reward >= eval/sft_proxy_reward + 0.3 ; mean: eval/late_gold_reward <= eval/sft_gold_reward - 0.5
quick: rlhf_kl_sweep0.1 | RLHF with a KL penalty (beta=0.1): gold reward ends well above SFT at a small KL, no collapse | rlhf_ppo_kl --kl-coef 0.1 RLHF_SHARED_SETUP | eval/gold_reward,eval/sft_gold_reward,eval/kl,eval/eos_rate | on average gold >= SFT + 0.6 at KL <= 4; on every seed gold >= SFT + 0.2 at KL <= 6 (tuning seeds 111-120: gold - SFT 0.66-1.13, mean 0.88; KL 1.1-3.0, mean 1.8) | eval/gold_reward >= eval/sft_gold_reward + 0.2 ; eval/kl <= 6 ; eval/eos_rate >= 0.95 ; mean: eval/gold_reward >= eval/sft_gold_reward + 0.6 ; mean: eval/kl <= 4
quick: rlhf_kl_sweep0.1 | Best-of-n from SFT at the PPO policy's KL (n from log n - (n-1)/n, same objective) is about as good as PPO | rlhf_ppo_kl --kl-coef 0.1 RLHF_SHARED_SETUP | eval/bon_gold_reward,eval/bon_n,eval/gold_reward,eval/sft_gold_reward | on average well above SFT; on every seed above it and within 0.4 of PPO's gold (tuning seeds 111-120: best-of-n - SFT 0.72-1.38, mean 1.02; best-of-n - PPO +0.03 to +0.27) | eval/bon_gold_reward >= eval/sft_gold_reward + 0.15 ; abs(eval/bon_gold_reward - eval/gold_reward) <= 0.4 ; mean: eval/bon_gold_reward >= eval/sft_gold_reward + 0.5
full: rlhf_kl_offset | Problem 21.3(c): a per-prompt constant c(s) ~ U(-2, 2) added to r_psi leaves the optimum unchanged; the value baseline absorbs it once learned, so learning still works but the final gold is never better and usually lower | rlhf_ppo_kl --kl-coef 0.1 --reward-offset 2 RLHF_SHARED_SETUP | eval/gold_reward,eval/sft_gold_reward,eval/kl | gold still >= SFT + 0.3 and not above the no-offset run + 0.1 (tuning seeds 111-120: gold - SFT 0.58-1.08; -0.49 to +0.05 against the no-offset run, mean -0.13, lower on 8 of 10; 101-105 at an earlier commit: 0.02-0.68 lower) | eval/gold_reward >= eval/sft_gold_reward + 0.3 ; eval/gold_reward <= rlhf_kl_sweep0.1:eval/gold_reward + 0.1
full: rlhf_kl_sweep0.01 | RLHF, beta=0.01 | rlhf_ppo_kl --kl-coef 0.01 RLHF_SHARED_SETUP | eval/gold_reward,eval/kl | between beta=0 and beta=0.1 | info
full: rlhf_kl_sweep0.03 | RLHF, beta=0.03 | rlhf_ppo_kl --kl-coef 0.03 RLHF_SHARED_SETUP | eval/gold_reward,eval/kl | between beta=0 and beta=0.1 | info
full: rlhf_kl_sweep0.3 | RLHF, beta=0.3 | rlhf_ppo_kl --kl-coef 0.3 RLHF_SHARED_SETUP | eval/gold_reward,eval/kl | small KL, gold above SFT | info
full: rlhf_bandit | RLHF, sequence-level (bandit) advantages instead of per-token GAE | rlhf_ppo_kl --advantage bandit RLHF_SHARED_SETUP | eval/gold_reward,eval/sft_gold_reward,eval/kl | about the same as GAE | info
full: ilql | GuessTheImage: per-token ILQL beats BC (the beta = 0 head of the ILQL network, `eval/bc_episodic_return`) and filtered BC, approaching the optimal questioner | ilql_per_token | eval/episodic_return,eval/bc_episodic_return,eval/success_rate,eval/episodic_length,eval/normalized_score | > filtered BC >= BC (the beta = 0 head, about 0.41), toward 0.783 | eval/episodic_return >= ilql_filtered_bc:eval/episodic_return + 0.1 ; eval/episodic_return >= eval/bc_episodic_return + 0.1
full: ilql | GuessTheImage: the behavior mixture and the optimal questioner (anchors) | ilql_per_token | dataset/mean_return,ref/optimal_episodic_return | 0.412 and 0.783 | info
full: ilql | Problem 21.4: per token the RL horizon is several times longer and each step chooses among ~10^2 tokens; per utterance the horizon is the number of turns and the action space is astronomically large (the data's numbers, the same on every seed) | ilql_per_token | timestep/rl_steps_per_dialogue,timestep/action_space_log10 | per token ~28 steps of ~10^2 actions (per utterance: the cql_utterance row below) | info
full: ilql_filtered_bc | GuessTheImage: filtered BC, top 20% of dialogues by return | ilql_per_token --bc-only --filter-top-frac 0.2 | eval/episodic_return,eval/success_rate | about 0.41 (premature lucky guesses dominate the top) | info
full: cql_utterance | GuessTheImage: per-utterance CQL (CHAI-style) beats BC (the beta = 0 head of the ILQL network, `ilql:eval/bc_episodic_return`) and filtered BC | dialogue_cql_utterance | eval/episodic_return,eval/success_rate,eval/episodic_length,eval/normalized_score,eval/bc_proposer_episodic_return | > filtered BC >= BC (the beta = 0 head of the ILQL network), toward 0.783 | eval/episodic_return >= ilql_filtered_bc:eval/episodic_return + 0.1 ; eval/episodic_return >= ilql:eval/bc_episodic_return + 0.1
full: cql_utterance | Problem 21.4, per utterance: the horizon is the number of turns, each step chooses among every utterance the tokenizer can write (the data's numbers) | dialogue_cql_utterance | timestep/rl_steps_per_dialogue,timestep/action_space_log10,timestep/distinct_data_utterances | ~5 steps of ~10^24 actions (per token: the ilql row above) | info
EOF
)
# RL Zoo's RecurrentPPO (ppo_lstm) recipe for CartPoleNoVel, substituted above: 8 envs x 32 steps, 20 epochs on the
# whole batch, no entropy bonus, normalized observations; changed (ppo_recurrent detail 7): rewards over the running
# std of the return instead of per-minibatch advantage normalization, gamma 0.99 (zoo 0.98), lambda 0.95 (0.8).
PPO_CARTPOLE_ARGS="--num-envs 8 --num-steps 32 --num-minibatches 1 --update-epochs 20 --gamma 0.99 --gae-lambda 0.95 --ent-coef 0 --norm-obs --norm-reward --no-norm-adv --total-timesteps 100000"
EXPERIMENTS="${EXPERIMENTS//PPO_CARTPOLE_ARGS/$PPO_CARTPOLE_ARGS}"
# R2D2 on MaskedCartPole (r2d2_rnnstate's implementation details): inputs over their bounds, gamma 0.995 with 10-step
# returns, learning rate 2e-3 annealed to 0, 64 sequences an update every 3 vector steps, a 128-unit LSTM; greedy
# checks every 5000 steps.
R2D2_CARTPOLE_ARGS="--env-id seqrl/MaskedCartPole-v0 --total-timesteps 150000 --eval-episodes 20 --select-frequency 5000 --scale-obs --gamma 0.995 --n-step 10 --learning-rate 2e-3 --anneal-lr --batch-size 64 --train-frequency 3 --hidden-size 128"
EXPERIMENTS="${EXPERIMENTS//R2D2_CARTPOLE_ARGS/$R2D2_CARTPOLE_ARGS}"
# The cost study's runs: the same replay size, batch and updates for every method and L x M; 125 updates after 8000
# acted steps (each env past its first episode), timed, not trained to convergence (run them alone, --jobs 1, on an
# otherwise idle machine).
COST_ARGS="--buffer-size 30000 --batch-size 32 --total-timesteps 12000 --learning-starts 8000 --eval-episodes 1 --final-delta-q-sequences 64 --save-every 0"
EXPERIMENTS="${EXPERIMENTS//COST_ARGS/$COST_ARGS}"
# The RLHF PPO runs after beta = 0 load its SFT policy and reward model (same seed: STEP 4 re-seeds, so the run is
# the one that makes its own, as the tests check), instead of repeating STEPS 1-3 (about 45 s a run).
RLHF_SHARED_SETUP="--sft-model-path {run:rlhf_kl_sweep0.0}/sft_model --reward-model-path {run:rlhf_kl_sweep0.0}/reward_model"
EXPERIMENTS="${EXPERIMENTS//RLHF_SHARED_SETUP/$RLHF_SHARED_SETUP}"
# Settings shared by the small discrete-observation DQN runs (TMaze, ThreeStateLine), substituted above.
DQN_SMALL_ARGS="--n-step 1 --difference-scale 0 --learning-rate 5e-4 --train-frequency 1 --gradient-steps 1 --batch-size 128 --exploration-fraction 0.5 --end-e 0.05 --hidden-size 128 --target-network-frequency 500"
EXPERIMENTS="${EXPERIMENTS//DQN_SMALL_ARGS/$DQN_SMALL_ARGS}"

# --untrained: per script, the arguments appended to each of its commands (the last value of a flag wins) that cut
# its learning to nothing, the evaluation unchanged:  script | arguments | what is left
UNTRAINED_TABLE=$(cat <<'EOF'
ppo_recurrent | --total-timesteps 0 | no rollout, the initial network evaluated
dqn_framestack | --total-timesteps 0 | no env step, the initial network evaluated; --keep-best keeps nothing
ssm_vae_q | --total-timesteps 4000 --learning-starts 1000000000 | the 4000 random warm-up steps that a trained run fits its Markov count model to, no gradient step
r2d2_rnnstate | --total-timesteps 30000 --learning-starts 1000000000 | 30000 steps acted by the initial network fill the replay that the replay and Delta-Q metrics read, no gradient step
r2d2_trxl_memory | --total-timesteps 30000 --learning-starts 1000000000 | 30000 steps acted by the initial network fill the replay that the Delta-Q metrics read, no gradient step
rlhf_reward_model | --sft-epochs 0 --epochs 1 --learning-rate 0 | a random backbone, one pass at learning rate 0 that leaves the weights as initialized (the script rejects --epochs 0)
rlhf_ppo_kl | --sft-epochs 0 --rm-epochs 0 --num-updates 0 | random SFT policy and reward model (their 10 + 6 epochs cost ~1 min a run), no PPO update: the policy is the SFT policy
ilql_per_token | --num-steps 0 | no gradient step, every beta head of the initial network evaluated
dialogue_cql_utterance | --bc-epochs 0 --critic-steps 0 | the initial proposer and critic (its candidate generation and evaluation still take ~5 min)
EOF
)

# --fingerprint: per script, the arguments appended to each of its commands (the last value of a flag wins) for the
# seconds-long run whose numbers are a line's fingerprint (AGG_PY, Fingerprints): small sizes, every periodic step
# (selection, target updates, logging, evaluation) reached at least once, no periodic checkpoints (run management, not
# numbers):  script | arguments
FINGERPRINT_TABLE=$(cat <<'EOF'
ppo_recurrent | --total-timesteps 512 --num-envs 2 --num-minibatches 2 --update-epochs 2 --eval-episodes 8 --greedy-eval-episodes 4
dqn_framestack | --total-timesteps 600 --learning-starts 128 --buffer-size 1000 --batch-size 32 --num-envs 2 --train-frequency 16 --gradient-steps 4 --target-network-frequency 64 --select-frequency 300 --select-episodes 2 --eval-episodes 4
ssm_vae_q | --total-timesteps 400 --learning-starts 200 --num-envs 4 --deter-size 16 --hidden-size 16 --target-network-frequency 50 --log-every 20 --select-frequency 200 --select-episodes 2 --eval-episodes 6
r2d2_rnnstate | --total-timesteps 2400 --learning-starts 800 --num-envs 4 --buffer-size 2000 --batch-size 8 --hidden-size 16 --target-network-frequency 20 --delta-q-frequency 5 --final-delta-q-sequences 16 --select-frequency 800 --select-episodes 2 --eval-episodes 4 --save-every 0
r2d2_trxl_memory | --total-timesteps 4000 --learning-starts 3200 --num-envs 4 --buffer-size 4000 --batch-size 8 --d-model 16 --ff-size 32 --target-network-frequency 20 --final-delta-q-sequences 16 --eval-episodes 2 --save-every 0
rlhf_reward_model | --n-train-prompts 48 --epochs 1 --eval-episodes 16 --n-norm-samples 64 --n-center-samples 16 --sft-epochs 1 --sft-examples 64 --save-every 0
rlhf_ppo_kl | --sft-examples 128 --sft-epochs 1 --pref-prompts 8 --rm-epochs 1 --num-updates 3 --batch-size 8 --num-minibatches 2 --update-epochs 1 --eval-every 1 --eval-episodes 8 --bon-max-n 4 --n-embd 16 --n-layer 1 --n-head 2 --save-every 0
ilql_per_token | --dataset-size 300 --log-every 10 --batch-size 16 --n-layer 1 --n-embd 32 --eval-episodes 36 --val-episodes 18 --betas 0 4 --num-steps 20 --warmup-steps 5 --save-every 0
dialogue_cql_utterance | --dataset-size 200 --bc-epochs 1 --critic-steps 4 --batch-size 16 --eval-episodes 18 --n-candidates 2 --n-embd 16 --critic-dim 16 --critic-hidden 16 --log-every 2 --val-episodes 18 --act-temperatures 1.0 0.5 --save-every 0
EOF
)

# README's results table (written by --publish): per script, the experiment and metric of its headline result
#   script | experiment id | metric | what it shows
HEADLINES=$(cat <<'EOF'
ppo_recurrent | ppo_cartpole_gru | eval/episodic_return | memory restores the Markov property: PPO with a GRU balances MaskedCartPole
dqn_framestack | dqn_cartpole_k4 | eval/episodic_return | a 4-frame stack recovers MaskedCartPole's velocities for DQN
r2d2_rnnstate | r2d2_cartpole | eval/episodic_return | R2D2: recurrent Q-learning from replay with stored states and a burn-in
r2d2_trxl_memory | trxl_tmaze20 | eval/success_rate | a Transformer-XL memory stored in replay carries the TMaze cue past its trained windows (so does an exact recompute)
ssm_vae_q | ssm_twodoors | eval/episodic_return | Q-learning on a latent belief state beats the best memoryless policy (TwoDoors)
rlhf_reward_model | rlhf_rm | eval/preference_accuracy | a Bradley-Terry reward model learns the labeler's preferences
rlhf_ppo_kl | rlhf_kl_sweep0.1 | eval/gold_reward | PPO with a KL penalty raises the hidden gold reward without over-optimizing
ilql_per_token | ilql | eval/episodic_return | offline RL per token (ILQL) beats behavior cloning on a dialogue task
dialogue_cql_utterance | cql_utterance | eval/episodic_return | offline RL per utterance (CQL) on the same dialogue task
EOF
)

# The figures, one per claim group:  kind | file | title | series | y | reference
#   curve    series `label=id, ...`; y a tensorboard tag, smoothed (rolling mean over SMOOTH_EPISODES episodes for
#            charts/ tags), mean over seeds with a ± std band, x in env steps; reference `value label` or -
#   bar      series `label=id:metric, ...`; one bar per series (mean over seeds), seeds as dots
#   overopt  series = the id prefix of the RLHF KL sweep; gold and proxy reward against KL, and gold against sqrt(KL)
FIGURES=$(cat <<'EOF'
curve | line | ThreeStateLine: PPO with a GRU vs memoryless (episode length) | GRU=ppo_line_gru, memoryless=ppo_line_none | charts/episodic_length | 1.5 optimum with memory
curve | corridor | ShortCorridor: memoryless PPO, Monte Carlo returns vs a bootstrapped critic | Monte Carlo=ppo_corridor_mc, one-step TD critic=ppo_corridor_td | charts/episodic_return | -11.66 best memoryless
curve | cartpole_v1 | CartPole-v1: memoryless PPO with CleanRL ppo.py's settings | PPO (ours)=ppo_cartpole_v1 | charts/episodic_return | 491.6 CleanRL ppo.py (last 20 episodes)
curve | tmaze_ppo | TMaze, corridor 10: PPO with a GRU vs memoryless | GRU=ppo_tmaze_gru, memoryless=ppo_tmaze_none | charts/episodic_return | 3.0 optimum
curve | maskedcartpole | MaskedCartPole: PPO's memory recovers the velocities | GRU=ppo_cartpole_gru, LSTM=ppo_cartpole_lstm, memoryless=ppo_cartpole_none | charts/episodic_return | 500 maximum
curve | maskedcartpole_dqn | MaskedCartPole: DQN on a 4-frame stack vs one frame | k=4=dqn_cartpole_k4, k=1=dqn_cartpole_k1 | charts/episodic_return | 500 maximum
curve | maskedcartpole_r2d2 | MaskedCartPole: R2D2, stored LSTM state and burn-in | R2D2=r2d2_cartpole | charts/episodic_return | 500 maximum
curve | tiger | Tiger: PPO with a GRU vs memoryless | GRU=ppo_tiger_gru, memoryless=ppo_tiger_none | charts/episodic_return | 5.01 optimum
curve | r2d2_ablation | R2D2 on TMaze-20: stored state + burn-in vs stored vs zero state | stored + burn-in=r2d2_tmaze20, stored=r2d2_tmaze20_stored_noburnin, zero state=r2d2_tmaze20_zero | charts/episodic_return | 2.0 optimum
curve | trxl_tmaze20 | TMaze-20, Transformer-XL Q: stored memory vs empty vs DTQN | stored memory + burn-in=trxl_tmaze20, empty memory=trxl_tmaze20_zero, window 16=trxl_tmaze20_window | charts/episodic_return | 2.0 optimum
curve | trxl_recompute | TMaze-20: stored memory vs exact recompute vs a DTQN window of 32 | stored memory + burn-in=trxl_tmaze20, exact recompute=trxl_tmaze20_exact, window 32=trxl_tmaze20_window32 | charts/episodic_return | 2.0 optimum
curve | twodoors | TwoDoors: Q-learning on the latent belief state | latent-belief Q=ssm_twodoors | charts/episodic_return | 0.90 best memoryless
curve | trxl_tmaze50 | TMaze-50, Transformer-XL Q, memory M = 64: stored memory + burn-in | M = 64=trxl_tmaze50 | charts/episodic_return | -1.0 optimum
bar | cost | Learner ms per update: (c) stored vs (f) exact recompute at L x M | c 64=cost_stored_layers2:perf/learner_ms_per_update, f 64=cost_exact_layers2:perf/learner_ms_per_update, c 128=cost_stored_layers4:perf/learner_ms_per_update, f 128=cost_exact_layers4:perf/learner_ms_per_update, c 192=cost_stored_layers6:perf/learner_ms_per_update, f 192=cost_exact_layers6:perf/learner_ms_per_update, e 2 layers=cost_episode_layers2:perf/learner_ms_per_update | ms per update | -
bar | tmaze_window | TMaze, 4-frame DQN: success against corridor length | 1=dqn_tmaze_k4_corridor_sweep1:eval/success_rate, 2=dqn_tmaze_k4_corridor_sweep2:eval/success_rate, 4=dqn_tmaze_k4_corridor_sweep4:eval/success_rate, 8=dqn_tmaze_k4_corridor_sweep8:eval/success_rate | success rate | 0.5 chance
bar | reward_model | Bradley-Terry reward model on held-out pairs: accuracy vs the labeler's Bayes ceiling, order, calibration | accuracy=rlhf_rm:eval/preference_accuracy, Bayes ceiling=rlhf_rm:eval/bayes_accuracy, centered Spearman=rlhf_rm:eval/spearman_gold_centered, calibration error=rlhf_rm:eval/calibration_error | value | -
bar | dialogue | GuessTheImage: offline RL vs behavior cloning (mean return) | ILQL=ilql:eval/episodic_return, BC=ilql:eval/bc_episodic_return, filtered BC=ilql_filtered_bc:eval/episodic_return, CQL=cql_utterance:eval/episodic_return, dataset=ilql:dataset/mean_return | mean return | 0.783 optimal questioner
overopt | rlhf_overoptimization | RLHF over-optimization: gold and proxy reward against the KL to the SFT policy | rlhf_kl_sweep | - | -
EOF
)

AGG_PY=$(cat <<'PY'
"""Check every claim of a benchmark folder, write results.md and the figures; publish folders to docs/.

Modes: validate, aggregate, publish, check-published (see the end of this file)."""

import ast
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SMOOTH_EPISODES = 20  # smallest rolling-mean window (episodes) of the charts/ curves in the figures ...
SMOOTH_FRACTION = 100  # ... which grows to 1/100 of a run's episodes (thousands of short episodes need more)
GRID_POINTS = 200  # curves of all seeds are interpolated onto this many env steps before the mean and band
REF_RE = re.compile(r"(?:(?P<exp>[A-Za-z_][\w.\-]*):)?(?P<metric>[A-Za-z_]\w*/\w+)")
CONSISTENCY_PREFIX = "consistency:"  # a figure-vs-evaluation check: judged when trained, left out untrained
NEGATIVE_RE = re.compile(r"negative\((?P<pair>[^)]*)\):(?P<check>.*)")  # `negative(<id>): <check>`
ID_RE = re.compile(r"[A-Za-z_][\w.\-]*")
RUN_REF_RE = re.compile(r"\{run:([^}]*)\}")  # in a command: the run dir of an earlier line's run, same seed
FUNCS = {"abs": abs, "min": min, "max": max}
ALLOWED = (
    ast.Expression,
    ast.Compare,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.Call,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.USub,
    ast.UAdd,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
)


class CheckError(ValueError):
    pass


def parse_condition(text: str) -> dict:
    """One condition of a check: {'mean', 'code', 'refs': [(exp or None, metric)], 'text'}; CheckError if malformed."""
    text = text.strip()
    mean = text.startswith("mean:")
    body = text[len("mean:") :].strip() if mean else text
    refs = []

    def name_ref(match):
        refs.append((match.group("exp"), match.group("metric")))
        return f"_r{len(refs) - 1}"

    expr = REF_RE.sub(name_ref, body)
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as err:
        raise CheckError(f"cannot parse {body!r} ({err.msg})") from None
    if not isinstance(tree.body, ast.Compare):
        raise CheckError(f"{body!r} is not a comparison (use <, <=, >, >=)")
    for node in ast.walk(tree):
        bad = not isinstance(node, ALLOWED)
        bad |= isinstance(node, ast.Constant) and not isinstance(node.value, (int, float))
        bad |= isinstance(node, ast.Name) and not (node.id.startswith("_r") or node.id in FUNCS)
        bad |= isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCS)
        if bad:
            raise CheckError(
                f"{body!r}: {type(node).__name__} is not allowed (numbers, metric refs, + - *, abs/min/max)"
            )
    if not refs:
        raise CheckError(f"{body!r} names no metric")
    return {"mean": mean, "code": compile(tree, "<check>", "eval"), "refs": refs, "text": text}


def parse_line(line: str, where: str) -> dict:
    fields = [f.strip() for f in line.split("|")]
    if len(fields) != 6:
        raise CheckError(
            f"{where}: needs 6 '|'-separated fields (id | claim | command | metrics | prediction | "
            f"check), got {len(fields)}"
        )
    exp_id, claim, cmd, metrics, prediction, check = fields
    if not ID_RE.fullmatch(exp_id):
        raise CheckError(f"{where}: bad experiment id {exp_id!r}")
    negative, body, consistency = None, check, check.startswith(CONSISTENCY_PREFIX)
    if consistency:
        body = check[len(CONSISTENCY_PREFIX) :].strip()
    if match := NEGATIVE_RE.fullmatch(check):
        negative, body = match.group("pair").strip(), match.group("check").strip()
        if not ID_RE.fullmatch(negative):
            raise CheckError(
                f"{where} (id {exp_id}): `negative(<id>):` must name the experiment of the positive "
                f"claim it pairs with, got {negative!r}"
            )
    if not body or ((negative or consistency) and body == "info"):
        raise CheckError(f"{where}: empty check (write a prediction the results can test, or `info`)")
    conditions = []
    if body != "info":
        for part in body.split(" ; "):
            try:
                conditions.append(parse_condition(part))
            except CheckError as err:
                raise CheckError(f"{where} (id {exp_id}): check {err}") from None
    return dict(
        id=exp_id,
        claim=claim,
        cmd=cmd,
        metrics=[m.strip() for m in metrics.split(",") if m.strip()],
        prediction=prediction,
        check=body,
        check_as_written=check,  # with its `negative(...)` or `consistency:` prefix
        negative=negative,
        consistency=consistency,
        conditions=conditions,
        where=where,
    )


def env_of(cmd: str):
    """The task a command runs: its `--env-id`, or the script's default env."""
    words = shlex.split(cmd)
    for i, word in enumerate(words):
        if word == "--env-id" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--env-id="):
            return word.split("=", 1)[1]
    return f"{words[0] if words else '?'}'s default env"


def parse_experiments(lines: list[tuple[str, str]], strict: bool = True) -> list[dict]:
    """strict: a check naming an experiment that no line defines is an error (validate: every line of benchmark.sh,
    so a typo stops the run before it starts); in a results folder it is an experiment `--only` left out, and the
    claim is reported as not checked."""
    experiments = [parse_line(line, where) for line, where in lines]
    if not strict:
        return experiments
    ids = {e["id"] for e in experiments}
    first = {}  # id -> its first line: the one whose command runs
    for e in experiments:
        for dep in RUN_REF_RE.findall(e["cmd"]):  # its run must have started (so finish) before this one waits on it
            if dep not in first or dep == e["id"]:
                raise CheckError(
                    f"{e['where']} (id {e['id']}): {{run:{dep}}} names no experiment of an earlier line (a command "
                    "may read the run dir of an earlier experiment's run of the same seed)"
                )
        f = first.setdefault(e["id"], e)
        if e["cmd"] != f["cmd"]:
            raise CheckError(
                f"{e['where']} (id {e['id']}): same id as {f['where']} but another command (only the first line's "
                "command runs: give the lines one command, or this line its own id)"
            )
        for cond in e["conditions"]:
            for exp, _ in cond["refs"]:
                if exp is not None and exp not in ids:
                    raise CheckError(f"{e['where']} (id {e['id']}): check refers to unknown experiment {exp!r}")
    for e in experiments:  # a negative control pairs with a positive claim on the same task
        if e["negative"] is None:
            continue
        positive = [x for x in experiments if x["id"] == e["negative"] and x["conditions"] and not x["negative"]]
        if not positive:
            raise CheckError(
                f"{e['where']} (id {e['id']}): negative control without a pair: no line with id "
                f"{e['negative']!r} states a positive claim (a check that is neither `info` nor "
                f"`negative(...)`)"
            )
        if env_of(e["cmd"]) != env_of(positive[0]["cmd"]):
            raise CheckError(
                f"{e['where']} (id {e['id']}): negative control on {env_of(e['cmd'])}, its pair "
                f"{e['negative']!r} on {env_of(positive[0]['cmd'])}: pair it with a claim on the same "
                f"task"
            )
    return experiments


def fmt(v) -> str:
    if v is None:
        return "—"
    return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"


def mean_std(values):
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, s


def evaluate_claim(e: dict, metric_of, seeds: list[int], ran: set) -> dict:
    """Verdict of one claim: per-seed conditions on every seed, `mean:` conditions on the means over seeds.

    Also returned, for --untrained: `seed_ok` (seed -> the claim holds there: every per-seed condition on that seed
    and every `mean:` condition), `absent` (the values a condition needed that no summary.json holds) and `held`
    (the conditions that hold on every seed)."""
    missing = sorted({exp for c in e["conditions"] for exp, _ in c["refs"] if exp is not None and exp not in ran})
    if missing:
        return {"status": "not checked", "text": f"not checked: {', '.join(missing)} not run"}
    per_seed, failures, mean_ok, absent, held = {}, [], True, [], []
    for cond in e["conditions"]:

        def values(seed, cond=cond):
            return [metric_of(exp or e["id"], metric, seed) for exp, metric in cond["refs"]]

        for seed in seeds:
            absent += [
                f"seed {seed}: {(x + ':') if x else ''}{m}"
                for (x, m), v in zip(cond["refs"], values(seed), strict=True)
                if v is None
            ]
        if cond["mean"]:
            columns = [values(s) for s in seeds]
            complete = [col for col in columns if None not in col]
            if not complete:
                mean_ok = False
                failures.append(f"`{cond['text']}`: no seed has all values")
                continue
            means = [sum(col[i] for col in complete) / len(complete) for i in range(len(cond["refs"]))]
            ok = bool(eval(cond["code"], {**FUNCS}, {f"_r{i}": v for i, v in enumerate(means)}))
            mean_ok &= ok
            if ok:
                held.append(cond["text"])
            else:
                shown = ", ".join(f"{m}={fmt(v)}" for (_, m), v in zip(cond["refs"], means, strict=True))
                failures.append(f"`{cond['text']}` false on the means ({shown})")
            continue
        all_ok = True
        for seed in seeds:
            vals = values(seed)
            ok = None not in vals and bool(eval(cond["code"], {**FUNCS}, {f"_r{i}": v for i, v in enumerate(vals)}))
            per_seed[seed] = per_seed.get(seed, True) and ok
            all_ok &= ok
            if not ok:
                shown = ", ".join(
                    f"{(x + ':') if x else ''}{m}={fmt(v)}" for (x, m), v in zip(cond["refs"], vals, strict=True)
                )
                failures.append(f"seed {seed}: `{cond['text']}` false ({shown})")
        if all_ok:
            held.append(cond["text"])
    n_hold = sum(per_seed.values()) if per_seed else len(seeds)
    holds = mean_ok and n_hold == len(seeds)
    has_seed_conds = any(not c["mean"] for c in e["conditions"])
    text = (f"holds {n_hold}/{len(seeds)} seeds" if has_seed_conds else "holds") if holds else "**FAILS**"
    if not holds and has_seed_conds:
        text += f" (holds on {n_hold}/{len(seeds)} seeds)"
    if any(c["mean"] for c in e["conditions"]):
        text += f"; mean over {len(seeds)} seeds"
    if failures:
        text += ": " + "; ".join(failures)
    seed_ok = {seed: mean_ok and per_seed.get(seed, True) for seed in seeds}
    return {
        "status": "holds" if holds else "fails",
        "text": text,
        "seed_ok": seed_ok,
        "absent": list(dict.fromkeys(absent)),
        "held": held,
    }


def untrained_verdict(e: dict, verdict: dict | None, seeds: list[int], pair_status: dict) -> tuple[str, str]:
    """--untrained: (kind, text) of one claim row. kind: `fails` (a positive claim that fails on every seed: its check
    can fail), `holds` (a positive claim that holds on some seed: it cannot fail), `error` (a value to judge is
    missing: a crashed run or a metric the script did not write), `negative` (a negative control, left out),
    `consistency` (left out), `info` and `not checked` (left out)."""
    if verdict is None:
        return "info", "left out: an anchor or a fact of the data (reported, not judged)"
    if verdict["status"] == "not checked":
        return "not checked", f"left out: {verdict['text']}"
    if e["consistency"]:
        return "consistency", (
            "left out: a consistency check (the training curve against the run's own evaluation), "
            "not a learning claim; an untrained run has no training curve"
        )
    if verdict["absent"]:
        return "error", f"**ERROR** (nothing to judge: no value for {', '.join(verdict['absent'])})"
    held_on = [seed for seed in seeds if verdict["seed_ok"][seed]]
    on = f" on seed{'s' if len(held_on) > 1 else ''} {', '.join(map(str, held_on))}" if len(seeds) > 1 else ""
    if e["negative"]:
        pair = pair_status.get(e["negative"], "not run")
        state = f"holds untrained{on} (by nature)" if held_on else "fails untrained (a prediction of failure)"
        return "negative", f"negative control, left out (pairs with {e['negative']}: {pair}): {state}"
    if held_on:
        return "holds", f"**holds untrained{on}: cannot fail**"
    text = "fails untrained (the check can fail)"
    if verdict["held"]:
        text += "; holding untrained anyway: " + " ; ".join(f"`{c}`" for c in verdict["held"])
    return "fails", text


@dataclass
class Folder:
    """A results folder as a run left it: its experiment lines (experiments.txt), meta.json, and per experiment id the
    summary.json of each seed that finished and the seeds whose run left none (crashed)."""

    out: Path
    experiments: list[dict]
    meta: dict
    summaries: dict  # id -> seed -> summary.json
    crashed: dict  # id -> seeds without a summary.json
    seeds: list[int]  # every seed that a run of the folder used
    seeds_by_id: dict  # id -> its seeds (seeds.txt: the drawn seeds of its group), where not all of `seeds`
    fingerprints: dict  # id -> the fingerprint of the code that ran it (fingerprints.json; none in older folders)

    def seeds_of(self, exp_id: str) -> list[int]:
        return self.seeds_by_id.get(exp_id, self.seeds)

    @property
    def untrained(self) -> bool:
        return str(self.meta.get("untrained", "0")) == "1"

    @property
    def ran(self) -> set:
        return set(self.summaries) | set(self.crashed)

    def metric_of(self, exp_id: str, metric: str, seed: int):
        value = self.summaries.get(exp_id, {}).get(seed, {}).get("metrics", {}).get(metric)
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

    def wall_times(self, exp_id: str) -> list[float]:
        runs = self.summaries.get(exp_id, {})
        return [runs[s]["wall_time_s"] for s in sorted(runs) if "wall_time_s" in runs[s]]

    def run_counts(self) -> tuple[int, int]:
        """(runs finished, runs started)."""
        n_ok = sum(len(runs) for runs in self.summaries.values())
        return n_ok, n_ok + sum(len(seeds) for seeds in self.crashed.values())


def read_folder(out: Path) -> Folder:
    lines = [
        (line, f"experiments.txt line {i}")
        for i, line in enumerate((out / "experiments.txt").read_text().splitlines(), start=1)
        if line.strip() and not line.startswith("#")
    ]
    experiments = parse_experiments(lines, strict=False)
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else {}
    summaries, crashed = defaultdict(dict), defaultdict(list)
    for exp_id in dict.fromkeys(e["id"] for e in experiments):
        for seed_dir in sorted((out / "runs" / exp_id).glob("seed*")):
            seed = int(seed_dir.name[len("seed") :])
            found = sorted(seed_dir.glob("*/summary.json"))
            if found:
                summaries[exp_id][seed] = json.loads(found[-1].read_text())
            else:
                crashed[exp_id].append(seed)
    seeds_by_id = {}
    if (out / "seeds.txt").is_file():
        for line in (out / "seeds.txt").read_text().splitlines():
            exp_id, *seeds_of = line.split()
            seeds_by_id[exp_id] = [int(s) for s in seeds_of]
    given = meta.get("seeds", "")
    seeds = sorted({s for v in seeds_by_id.values() for s in v}) or [int(s) for s in given.split() if s.isdigit()]
    seeds = seeds or sorted({s for d in summaries.values() for s in d} | {s for v in crashed.values() for s in v})
    fps = json.loads((out / "fingerprints.json").read_text()) if (out / "fingerprints.json").is_file() else {}
    return Folder(out, experiments, meta, dict(summaries), dict(crashed), seeds, seeds_by_id, fps)


def judge(experiments: list[dict], folder: Folder, ran: set) -> list[tuple[int, dict, dict | None]]:
    """(line number, experiment, verdict or None for `info`) of each line whose experiment is in `ran`."""
    return [
        (n, e, evaluate_claim(e, folder.metric_of, folder.seeds_of(e["id"]), ran) if e["conditions"] else None)
        for n, e in enumerate(experiments, start=1)
        if e["id"] in ran
    ]


def untrained_kinds(rows, seeds_of) -> dict:
    """--untrained: line number -> (kind, text) of each judged row (see untrained_verdict); a negative control shows
    the state of its pair."""
    kinds = {n: untrained_verdict(e, verdict, seeds_of(e["id"]), {}) for n, e, verdict in rows if not e["negative"]}
    pair_status = {}
    for n, e, _ in rows:
        if n in kinds and kinds[n][0] in ("fails", "holds", "error"):
            state = {"fails": "fails untrained", "holds": "HOLDS untrained", "error": "error untrained"}[kinds[n][0]]
            if pair_status.get(e["id"], "fails untrained") == "fails untrained":
                pair_status[e["id"]] = state
    for n, e, verdict in rows:
        if e["negative"]:
            kinds[n] = untrained_verdict(e, verdict, seeds_of(e["id"]), pair_status)
    return kinds


def untrained_summary(folder: Folder) -> tuple[str, dict, dict]:
    """The untrained control's head line ("positive claims failing untrained: X of Y ..."), its rows by kind, and the
    kind of each row."""
    rows = judge(folder.experiments, folder, folder.ran)
    kinds = untrained_kinds(rows, folder.seeds_of)
    by_kind = defaultdict(list)
    for n, e, _ in rows:
        by_kind[kinds[n][0]].append(f"- #{n} {e['id']}: {e['claim']} — {kinds[n][1]}")
    n_ok, n_runs = folder.run_counts()
    n_pos = len(by_kind["fails"]) + len(by_kind["holds"]) + len(by_kind["error"])
    head = f"**positive claims failing untrained: {len(by_kind['fails'])} of {n_pos}**"
    head += f" · holding untrained (cannot fail): {len(by_kind['holds'])}"
    head += f" · errors (nothing to judge): {len(by_kind['error'])} · runs finished: {n_ok} of {n_runs}"
    left_out = [
        f"{len(by_kind[k])} {label}"
        for k, label in [
            ("negative", "negative controls"),
            ("info", "info rows"),
            ("consistency", "consistency checks"),
            ("not checked", "not checked"),
        ]
        if by_kind[k]
    ]
    if left_out:
        head += f" · left out: {', '.join(left_out)}"
    return head, by_kind, kinds


def measured(values: list) -> str:
    """Per-seed values in seed order, then the mean ± sample std over the seeds that have one."""
    got = [v for v in values if v is not None]
    summary = f" (mean {fmt(mean_std(got)[0])} ± {fmt(mean_std(got)[1])})" if len(got) > 1 else ""
    return " / ".join(fmt(v) for v in values) + summary


def aggregate(out: Path) -> int:
    folder = read_folder(out)
    experiments, seeds, untrained = folder.experiments, folder.seeds, folder.untrained
    rows = judge(experiments, folder, folder.ran)
    verdicts = [v["status"] for _, _, v in rows if v is not None]
    if untrained:
        head, by_kind, kinds = untrained_summary(folder)

    claim_rows = []
    for n, e, verdict in rows:
        cells = [
            f"`{m}`: {measured([folder.metric_of(e['id'], m, s) for s in folder.seeds_of(e['id'])])}"
            for m in e["metrics"]
        ]
        check = "—" if not e["conditions"] else "`" + e["check"].replace("|", "\\|") + "`"
        if e["negative"]:
            check = f"negative control (pairs with {e['negative']}): {check}"
        text = verdict["text"] if verdict else "reported (anchor or fact of the data, not a claim)"
        untrained_cell = f" {kinds[n][1]} |" if untrained else ""
        claim_rows.append(
            f"| {n} | {e['claim']} | {'<br>'.join(cells)} | {e['prediction']} | {check} | {text} |{untrained_cell}"
        )

    run_rows = []
    for exp_id in dict.fromkeys(e["id"] for e in experiments):
        if exp_id not in folder.ran:
            continue
        e = next(x for x in experiments if x["id"] == exp_id)
        ok_seeds, bad = sorted(folder.summaries.get(exp_id, {})), folder.crashed.get(exp_id, [])
        times = folder.wall_times(exp_id)
        status = f"finished {len(ok_seeds)}/{len(ok_seeds) + len(bad)}"
        if bad:
            status = f"**CRASHED** seeds {', '.join(map(str, bad))} (see logs/) · " + status
        wall = f"{sum(times) / len(times):.0f}" if times else "—"
        seeds_of = " ".join(map(str, folder.seeds_of(exp_id)))
        fp = folder.fingerprints.get(exp_id) or "—"
        run_rows.append(f"| {exp_id} | `{python_command(e['cmd'])}` | {seeds_of} | {fp} | {status} | {wall} |")

    n_ok, n_runs = folder.run_counts()
    n_hold, n_fail = verdicts.count("holds"), verdicts.count("fails")
    n_checked, n_unchecked = n_hold + n_fail, verdicts.count("not checked")
    meta = folder.meta
    minutes = f"{meta['total_s'] / 60:.1f} min" if "total_s" in meta else "unknown"
    about = [
        f"- seeds: {' '.join(map(str, seeds)) if not folder.seeds_by_id else 'per experiment (Runs)'}; "
        f"command: `bash benchmark.sh {meta.get('argv', '')}`; "
        f"git: {meta.get('git', '?')}",
        f"- machine: {meta.get('cpu', '?')}, {meta.get('cores', '?')} cores; {meta.get('jobs', '?')} runs at a time, "
        "one torch thread each; total wall time " + minutes,
    ]
    table_head = "| # | claim | measured | lecture predicts | check | verdict |"
    if untrained:
        table_head += " untrained control |"
    table = [table_head, "|---" * (7 if untrained else 6) + "|", *claim_rows]
    runs = [
        "## Runs",
        "",
        "| experiment | command (plus `--seed S`) | seeds | fingerprint | status | wall time per run (s) |",
        "|---|---|---|---|---|---|",
        *run_rows,
    ]
    if not untrained:
        head = f"**claims holding: {n_hold} of {n_checked}**"
        if n_unchecked:
            head += f" ({n_unchecked} not checked: an experiment they compare with was not run)"
        head += f" · runs finished: {n_ok} of {n_runs}"
        doc = [
            "# seqrl benchmark results",
            "",
            head,
            "",
            *about,
            "- Single-seed numbers differ across CPUs (torch's CPU kernels round differently per instruction set); the "
            "checks are set with margin so that they hold on other seeds and machines.",
            "",
            "## Claims",
            "",
            "Measured: per-seed values in seed order (mean ± sample std over seeds). Check: evaluated on every seed "
            "(`mean:` conditions on the means over seeds).",
            "",
            *table,
            "",
            *runs,
        ]
        rc = 0 if n_fail == 0 and n_ok == n_runs else 1
    else:
        table_file = out / "untrained.txt"  # the UNTRAINED_TABLE rows of the scripts that ran
        cut_rows = (
            [[f.strip() for f in line.split("|")] for line in table_file.read_text().splitlines() if line.strip()]
            if table_file.is_file()
            else []
        )
        scripts = {e["cmd"].split()[0] for e in experiments if e["id"] in folder.ran and e["cmd"].split()}
        cut = [f"- `{r[0]}`: `{r[1]}`: {r[2]}" for r in cut_rows if len(r) == 3 and r[0] in scripts]
        sections = [
            ("holds", "Positive claims that hold untrained: they cannot fail (redesign the check)"),
            ("error", "Errors: no value to judge (a crashed run, see Runs, or a metric missing from summary.json)"),
            ("fails", "Positive claims that fail untrained (as they must)"),
            ("negative", "Negative controls (a prediction of failure holds untrained by nature: left out)"),
            ("info", "Info rows (anchors and facts of the data, not judged: left out)"),
            (
                "consistency",
                "Consistency checks (a training curve against its own evaluation: an untrained run has none, left out)",
            ),
            ("not checked", "Not checked (an experiment they compare with was not run: left out)"),
        ]
        doc = [
            "# seqrl benchmark results: untrained control",
            "",
            head,
            "",
            *about,
            "- Every run's learning is cut to nothing (the arguments below are appended to its command), the "
            "evaluation unchanged. A claim that something was learned must fail here; one that holds cannot fail.",
            *cut,
            "",
            "## Untrained control",
            "",
        ]
        for kind, title in sections:
            if by_kind[kind]:
                doc += [f"### {title}", "", *by_kind[kind], ""]
        doc += [
            "## Claims",
            "",
            "Measured untrained: per-seed values in seed order. Verdict: the check as in a trained run.",
            "",
            *table,
            "",
            *runs,
        ]
        rc = 0 if not by_kind["holds"] and not by_kind["error"] and n_ok == n_runs else 1
    (out / "results.md").write_text("\n".join(doc) + "\n")
    print("\n".join(doc))
    if not untrained:  # the figures show learning: none in the untrained control
        try:
            plot(out, folder.summaries, folder.seeds_of, folder.metric_of)
        except ImportError as err:  # matplotlib or tensorboard missing: the table is still complete
            print(f"no figures: {err}")
    print(f"\n{head.replace('**', '')}\nwrote {out / 'results.md'}")
    return rc


def read_curve(run_dir: str, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return None
    events = acc.Scalars(tag)
    return [e.step for e in events], [e.value for e in events]


def plot(out: Path, summaries, seeds_of, metric_of):
    import matplotlib

    matplotlib.use("Agg")
    figures = [
        [f.strip() for f in line.split("|")]
        for line in (out / "figures.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for fields in figures:
        try:
            draw(out, summaries, seeds_of, metric_of, *fields)
        except Exception as err:  # noqa: BLE001  a broken figure must not hide the checked table
            print(f"figure {fields[1] if len(fields) > 1 else fields}: not drawn ({type(err).__name__}: {err})")


def series_pairs(series: str) -> list[list[str]]:
    """A figure's series, "label=id, ..." (a bar: "label=id:metric, ..."), as [label, id or id:metric] pairs."""
    return [s.strip().rsplit("=", 1) for s in series.split(",")]


def draw(out: Path, summaries, seeds_of, metric_of, kind, name, title, series, ylabel, reference):
    """One figure of figures.txt (see FIGURES in benchmark.sh)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import EngFormatter

    pairs = series_pairs(series) if kind != "overopt" else []
    fig = None
    if kind == "curve":
        fig, ax = plt.subplots(figsize=(6.4, 4))
        drawn, windows = 0, []
        for label, exp_id in pairs:
            curves = []
            for seed in seeds_of(exp_id):
                summary = summaries.get(exp_id, {}).get(seed)
                got = summary and read_curve(summary["run_dir"], ylabel)
                if got and len(got[0]) > 1:
                    steps, values = np.array(got[0], float), np.array(got[1], float)
                    window = max(SMOOTH_EPISODES, len(values) // SMOOTH_FRACTION)
                    if ylabel.startswith("charts/") and len(values) >= window:
                        values = np.convolve(values, np.ones(window) / window, mode="valid")
                        steps = steps[window - 1 :]
                        windows.append(window)
                    curves.append((steps, values))
            if not curves:
                continue
            grid = np.linspace(max(c[0][0] for c in curves), min(c[0][-1] for c in curves), GRID_POINTS)
            stack = np.stack([np.interp(grid, s, v) for s, v in curves])
            mean, std = stack.mean(0), stack.std(0)
            line = ax.plot(grid, mean, label=f"{label} ({len(curves)} seeds)")[0]
            ax.fill_between(grid, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
            drawn += 1
        if not drawn:
            plt.close(fig)
            return
        smoothing = ""
        if windows:  # the window grows with the number of episodes: say its range
            low, high = min(windows), max(windows)
            smoothing = f"\n(rolling mean over {low}{'' if low == high else f'-{high}'} episodes)"
        ax.set_ylabel(ylabel.split("/")[-1].replace("_", " ") + smoothing)
        ax.set_xlabel("environment steps")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    elif kind == "bar":
        fig, ax = plt.subplots(figsize=(6.4, 4))
        xs, drawn = np.arange(len(pairs)), 0
        for x, (_, ref) in zip(xs, pairs, strict=True):
            exp_id, metric = ref.split(":", 1)
            vals = [v for v in (metric_of(exp_id, metric, s) for s in seeds_of(exp_id)) if v is not None]
            if vals:
                ax.bar(x, np.mean(vals), color="C0", alpha=0.5)
                ax.scatter(np.full(len(vals), x), vals, color="k", s=12, zorder=3)
                drawn += 1
        if not drawn:
            plt.close(fig)
            return
        ax.set_xticks(xs, [label for label, _ in pairs])
        ax.set_ylabel(f"{ylabel} (bar: mean, dots: seeds)")
    elif kind == "overopt":
        files = sorted((out / "runs").glob(f"{series}*/seed*/*/curve.jsonl"))
        if not files:
            return
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        colors = {}
        for path in files:
            exp_id = path.parts[-4]
            color = colors.setdefault(exp_id, f"C{len(colors)}")
            points = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            kl = np.array([p["kl"] for p in points])
            label = exp_id.replace(series, "beta=") if path.parts[-3] == f"seed{seeds_of(exp_id)[0]}" else None
            axes[0].plot(kl, [p["gold_reward"] for p in points], ".-", color=color, alpha=0.6, label=label)
            axes[1].plot(kl, [p["proxy_reward"] for p in points], ".-", color=color, alpha=0.6)
            axes[2].plot(np.sqrt(np.maximum(kl, 0)), [p["gold_reward"] for p in points], ".-", color=color, alpha=0.6)
        labels = [
            ("KL(pi || pi_SFT)", "gold reward (hidden utility)"),
            ("KL(pi || pi_SFT)", "proxy reward (learned RM)"),
            ("sqrt KL (Gao et al. 2022)", "gold reward"),
        ]
        for ax, (xl, yl) in zip(axes, labels, strict=True):
            ax.set_xlabel(xl)
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8, title="points in training order, one line per seed", title_fontsize=7)
        fig.suptitle(title)
    if fig is None:
        return
    if kind != "overopt":
        if reference != "-":
            value, _, ref_label = reference.partition(" ")
            ax.axhline(float(value), color="k", linestyle="--", linewidth=1, label=ref_label or None)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)


# --- Fingerprints and drawn report seeds. A line's fingerprint is what its code computes: the summary metrics,
# TensorBoard scalars and saved weights of a seconds-long run of its command with FINGERPRINT_TABLE's arguments
# appended (seed 1), on the code path that every x86 CPU takes (FINGERPRINT_ENV), timings left out, rounded and
# hashed, with the full-size values of the settings that the tiny run replaces (`settings`). So an edit that computes
# the same numbers (a refactor, a comment) keeps it; one that does not, or a changed recipe or default, changes it;
# and it is the same on AMD and Intel, whose fast kernels round differently. docs/fingerprints.json keeps each line's
# fingerprint under a key of its code (its script's and envs/'s syntax trees without docstrings, its command and
# tiny arguments): a line whose key is there is not rerun. The report seeds of a group (the lines compared on the
# same seed) are drawn from its lines' fingerprints and checks: nobody chooses them, and a new method or a changed
# bar gets new ones.
FINGERPRINT_ENV = {
    "ATEN_CPU_CAPABILITY": "default",  # torch's own kernels without AVX2 / AVX-512 vectors
    "MKL_CBWR": "COMPATIBLE",  # MKL's matrix products: one path on Intel and AMD
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # oneDNN's kernels (torch's CPU LSTM) likewise
    "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",  # numpy's baseline loops
    "OPENBLAS_CORETYPE": "Nehalem",  # numpy's matrix products
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
FINGERPRINT_DIGITS = 6  # significant digits a value is rounded to before hashing
FINGERPRINT_SEED = 1
TIMING_RE = re.compile(r"^perf/|sps|wall|time_s|_ms(_|$)", re.IGNORECASE)  # timings: left out of a fingerprint
# in every key: a change of how fingerprints are computed (raise the first number) recomputes them all
FINGERPRINT_PROCEDURE = [2, FINGERPRINT_ENV, FINGERPRINT_DIGITS, FINGERPRINT_SEED, TIMING_RE.pattern]
NUMERIC_PACKAGES = ("torch", "numpy", "gymnasium", "transformers", "tokenizers")  # recorded beside the fingerprints
REPORT_SEEDS = range(1000, 10000)  # drawn report seeds; 1-6 are development seeds, 101-999 tuning seeds
DRAWN_SEEDS = 5


def sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


@functools.cache
def code_digest(path: Path) -> str:
    """A source file's syntax tree without docstrings and string statements (comments are not in it)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            node.body = kept or [ast.Pass()]
    return sha(ast.dump(tree))


def first_lines(experiments: list[dict]) -> dict:
    """id -> its first line (the one whose command runs), in benchmark.sh's order."""
    first = {}
    for e in experiments:
        first.setdefault(e["id"], e)
    return first


def check_fingerprint_table(experiments: list[dict], tiny: dict) -> None:
    """Every line's script exists and has a FINGERPRINT_TABLE row whose flags are fields of its Args."""
    for exp_id, e in first_lines(experiments).items():
        script = e["cmd"].split()[0]
        if script not in tiny:
            raise CheckError(f"{e['where']} (id {exp_id}): script {script!r} has no FINGERPRINT_TABLE row")
        if not (Path("algos") / f"{script}.py").is_file():
            raise CheckError(f"{e['where']} (id {exp_id}): no algos/{script}.py")
        settings(e, tiny[script])


def line_keys(experiments: list[dict], tiny: dict) -> dict:
    """id -> the key of its code: script and envs/ syntax trees, command (a `{run:X}` as X's key), tiny arguments."""
    check_fingerprint_table(experiments, tiny)
    envs = [code_digest(p) for p in sorted(Path("envs").rglob("*.py"))]
    keys = {}
    for exp_id, e in first_lines(experiments).items():
        script = e["cmd"].split()[0]
        cmd = RUN_REF_RE.sub(lambda m: "{run:" + keys[m[1]] + "}", e["cmd"])
        code = code_digest(Path("algos") / f"{script}.py")
        keys[exp_id] = sha([FINGERPRINT_PROCEDURE, code, envs, cmd, tiny[script]])
    return keys


def rounded(value):
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{FINGERPRINT_DIGITS}g}"
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return [rounded(v) for v in value]


@functools.cache
def args_defaults(script: str) -> dict:
    """The default of each field of a script's `Args`, as written (from its syntax tree)."""
    tree = ast.parse((Path("algos") / f"{script}.py").read_text())
    args = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"), None)
    if args is None:
        return {}
    fields = [n for n in args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return {n.target.id: ast.unparse(n.value) if n.value else None for n in fields}


def flag_values(words: list[str]) -> dict:
    """`--flag value ...` words -> flag -> its last values (a flag given twice: the last one wins)."""
    values, flag = {}, None
    for word in words:
        if word.startswith("--"):
            flag, _, inline = word.partition("=")
            values[flag] = [inline] if inline else []
        elif flag is not None:
            values[flag].append(word)
    return values


def settings(e: dict, tiny: str) -> dict:
    """The full-size values of the settings that the tiny run replaces: flag -> the line's value, else the default."""
    script, *words = shlex.split(e["cmd"])
    defaults, given = args_defaults(script), flag_values(words)
    out = {}
    for flag in flag_values(shlex.split(tiny)):
        field = flag[2:].replace("-", "_")
        if defaults and field not in defaults:
            raise CheckError(f"FINGERPRINT_TABLE row {script}: {flag} is not a field of its Args")
        out[flag] = " ".join(given[flag]) if flag in given else defaults.get(field)
    return out


def weight_stats(run_dir: Path) -> dict:
    """Per saved tensor (file / name): the sums of |w| and w^2, in float64."""
    import numpy as np
    from safetensors.numpy import load_file

    stats = {}
    for path in sorted(run_dir.rglob("*.safetensors")):
        for name, w in sorted(load_file(path).items()):
            w = w.astype(np.float64)
            stats[f"{path.relative_to(run_dir)}/{name}"] = [float(np.abs(w).sum()), float((w * w).sum())]
    return stats


def fingerprint_run(e: dict, tiny: str, dep_dirs: dict, tmp: Path) -> tuple[str, str]:
    """(fingerprint, run dir) of one tiny run of line `e`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    words = shlex.split(RUN_REF_RE.sub(lambda m: dep_dirs[m[1]], e["cmd"]))
    out = tmp / e["id"]
    argv = [sys.executable, f"algos/{words[0]}.py", "--seed", str(FINGERPRINT_SEED), "--runs-dir", str(out)]
    argv += ["--exp-name", e["id"], *words[1:], *shlex.split(tiny)]
    proc = subprocess.run(
        argv, env={**os.environ, **FINGERPRINT_ENV}, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    found = sorted(out.glob("*/summary.json"))
    if proc.returncode != 0 or not found:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise CheckError(f"the fingerprint run of {e['id']} failed (exit {proc.returncode}): {' '.join(argv)}\n{tail}")
    run_dir = found[0].parent
    metrics = json.loads(found[0].read_text())["metrics"]
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {
        tag: [[ev.step, ev.value] for ev in acc.Scalars(tag)]
        for tag in sorted(acc.Tags().get("scalars", []))
        if not TIMING_RE.search(tag)
    }
    kept = {k: v for k, v in metrics.items() if not TIMING_RE.search(k)}
    numbers = rounded({"metrics": kept, "scalars": scalars, "weights": weight_stats(run_dir)})
    return sha({"numbers": numbers, "settings": settings(e, tiny)})[:16], str(run_dir)


def read_fingerprint_table(path: Path) -> dict:
    rows = read_table(path, 2, "FINGERPRINT_TABLE", "script | --arguments")
    return {script: args for script, args in rows}


def compute_fingerprints(experiments: list[dict], tiny: dict, ids: list[str], jobs: int, cache: dict) -> tuple:
    """(id -> fingerprint, id -> why its tiny run failed) for `ids`: from `cache` (id -> {key, fingerprint}) where
    its key is there, else run (with the runs of the lines whose run dir it reads), `jobs` at a time."""
    first, keys = first_lines(experiments), line_keys(experiments, tiny)
    done = {i: cache[i]["fingerprint"] for i in ids if cache.get(i, {}).get("key") == keys[i]}
    todo, stack = set(), [i for i in ids if i not in done]
    while stack:  # a line that reads another's run dir needs that run too
        i = stack.pop()
        if i not in todo:
            todo.add(i)
            stack += RUN_REF_RE.findall(first[i]["cmd"])
    order = [i for i in first if i in todo]
    if not order:
        return done, {}
    print(f"fingerprints: {len(order)} tiny runs ({', '.join(order)}), {jobs} at a time", flush=True)
    with tempfile.TemporaryDirectory(prefix="seqrl-fingerprint-") as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = {}

        def one(exp_id):
            dirs = {}
            for dep in RUN_REF_RE.findall(first[exp_id]["cmd"]):
                if futures[dep].exception() is not None:
                    raise KeyError(dep)
                dirs[dep] = futures[dep].result()[1]
            start = time.monotonic()
            got = fingerprint_run(first[exp_id], tiny[first[exp_id]["cmd"].split()[0]], dirs, Path(tmp))
            print(f"  {exp_id}: {got[0]} ({time.monotonic() - start:.0f} s)", flush=True)
            return got

        for exp_id in order:  # a dependency is submitted (so started) before the lines that wait on it
            futures[exp_id] = pool.submit(one, exp_id)
        errors = {}
        for exp_id in order:
            try:
                fp = futures[exp_id].result()[0]
            except (CheckError, KeyError) as err:  # KeyError: a line whose dependency failed
                errors[exp_id] = str(err) if isinstance(err, CheckError) else f"its {{run:{err}}} failed"
                continue
            if exp_id in ids:
                done[exp_id] = fp
    return done, {i: why for i, why in errors.items() if i in ids}


def read_fingerprint_cache() -> dict:
    path = DOCS / "fingerprints.json"
    return json.loads(path.read_text())["lines"] if path.is_file() else {}


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": sys.version.split()[0]}
    for name in NUMERIC_PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def write_fingerprints(spec: Path, table: Path, jobs: int, only: str) -> int:
    """--fingerprint: docs/fingerprints.json for every line of benchmark.sh (or those --only selects), reusing the
    entries whose code key is unchanged; says for each line run again whether its fingerprint changed."""
    experiments, tiny = read_benchmark_lines(spec), read_fingerprint_table(table)
    old = read_fingerprint_cache()
    ids = [i for i in first_lines(experiments) if re.search(only, i)] if only else list(first_lines(experiments))
    keys = line_keys(experiments, tiny)
    fps, errors = compute_fingerprints(experiments, tiny, ids, jobs, old)
    for exp_id, why in errors.items():
        print(f"benchmark.sh: {exp_id}: {why}", file=sys.stderr)
    ids = [i for i in ids if i not in errors]
    lines = {i: old[i] for i in first_lines(experiments) if i in old and i not in ids}  # kept as they were
    changed = []
    for i in first_lines(experiments):
        if i in ids:
            lines[i] = {"key": keys[i], "fingerprint": fps[i]}
            if i in old and old[i]["key"] != keys[i]:
                same = old[i]["fingerprint"] == fps[i]
                print(f"{i}: code changed, fingerprint {'the same' if same else 'CHANGED'} ({fps[i]})")
                changed += [] if same else [i]
    data = {
        "about": "written by `bash benchmark.sh --fingerprint`: per experiment id, the key of its code and the "
        "fingerprint of what it computes (benchmark.sh, Fingerprints)",
        "versions": package_versions(),
        "lines": {i: lines[i] for i in first_lines(experiments) if i in lines},
    }
    path = DOCS / "fingerprints.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}: {len(ids)} lines fingerprinted, {len(changed)} changed: {' '.join(changed) or 'none'}")
    return 1 if errors else 0


def seed_groups(experiments: list[dict]) -> dict:
    """id -> the ids compared with it on the same seed (linked by a check's `other_id:metric`, a `{run:X}` or a
    negative control's pair), sorted: one group, one draw."""
    parent = {e["id"]: e["id"] for e in experiments}

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for e in experiments:
        linked = [x for c in e["conditions"] for x, _ in c["refs"] if x] + RUN_REF_RE.findall(e["cmd"])
        for other in linked + ([e["negative"]] if e["negative"] else []):
            if other in parent:
                parent[root(other)] = root(e["id"])
    members = defaultdict(list)
    for i in parent:
        members[root(i)].append(i)
    return {i: sorted(members[root(i)]) for i in parent}


def drawn_seeds(experiments: list[dict], fingerprints: dict, group: list[str], n: int) -> list[int]:
    """The first `n` report seeds of a group: drawn from a hash of its lines' ids, fingerprints and checks."""
    key = sha(sorted([e["id"], fingerprints[e["id"]], e["check_as_written"]] for e in experiments if e["id"] in group))
    seeds, i = [], 0
    while len(seeds) < n:
        seed = REPORT_SEEDS[int(sha([key, i]), 16) % len(REPORT_SEEDS)]
        seeds += [] if seed in seeds else [seed]
        i += 1
    return seeds


def prepare(spec: Path, table: Path, out: Path, seeds: str, jobs: int) -> int:
    """Before a benchmark run: fingerprint the selected lines (docs/fingerprints.json as a cache) into
    <out>/fingerprints.json, and write each id's seeds to <out>/seeds.txt (`drawn[:N]`: its group's first N drawn
    seeds, the first one only in an --untrained run)."""
    experiments, tiny = read_benchmark_lines(spec), read_fingerprint_table(table)
    folder = read_folder(out)
    selected = list(dict.fromkeys(e["id"] for e in folder.experiments))
    groups = seed_groups(experiments)
    drawn = seeds.startswith("drawn")
    needed = sorted({g for i in selected for g in groups[i]}) if drawn else selected
    fps, errors = compute_fingerprints(experiments, tiny, needed, jobs, read_fingerprint_cache())
    for exp_id, why in errors.items():  # its runs still run (and crash, or not), stamped with no fingerprint
        print(f"benchmark.sh: no fingerprint for {exp_id}: {why}", file=sys.stderr)
    if drawn and errors:
        raise CheckError(f"--seeds drawn: no fingerprint, so no report seeds, for {' '.join(errors)}")
    (out / "fingerprints.json").write_text(json.dumps({i: fps.get(i) for i in selected}, indent=1) + "\n")
    rows = []
    for i in selected:
        if drawn:
            n = int(seeds.partition(":")[2] or DRAWN_SEEDS)
            got = drawn_seeds(experiments, fps, groups[i], n)
            rows.append(f"{i} {' '.join(map(str, got[:1] if folder.untrained else got))}")
        else:
            rows.append(f"{i} {' '.join(seeds.split())}")  # --seeds "$(seq 1 5)" has newlines
    (out / "seeds.txt").write_text("\n".join(rows) + "\n")
    return 0


# --publish: docs/results.json holds what was published (per claim line of benchmark.sh: its id, command and check as
# written, and the values, verdict and folder); docs/results.md and README.md's results table are rendered from it
# alone, so --check-published can re-render them and compare.
DOCS = Path("docs")
README = Path("README.md")
README_BEGIN = "<!-- BEGIN results table: written by benchmark.sh --publish -->"
README_END = "<!-- END results table -->"
PAGE_BEGIN = "<!-- BEGIN results: written by benchmark.sh --publish -->"  # in each docs/<script>.md
PAGE_END = "<!-- END results -->"
STATUS_ORDER = {"fails": 0, "not checked": 1, "not run": 2, "holds": 3, "info": 4}  # the first table: failures first
NOT_RUN = "not run in the published runs"
STAMP_RE = re.compile(r"(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})\d{2}")  # results/<YYYYmmdd-HHMMSS>: the run's start


def read_table(path: Path, n_fields: int, name: str, layout: str) -> list[list[str]]:
    """The rows of a `|`-separated table of benchmark.sh (UNTRAINED_TABLE, HEADLINES, FIGURES)."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        row = [f.strip() for f in line.split("|")]
        if line.strip() and not line.startswith("#"):
            if len(row) != n_fields:
                raise CheckError(f"{name} line {i}: needs `{layout}`")
            rows.append(row)
    return rows


def read_benchmark_lines(path: Path) -> list[dict]:
    """The experiment lines of benchmark.sh (`quick:` or `full:` then the six fields), every check parsed."""
    lines = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        mode, colon, spec = line.partition(":")
        if line.strip() and (not colon or mode.strip() not in ("quick", "full")):
            raise CheckError(f"experiment line {i}: starts with {mode.strip()!r}, not `quick:` or `full:`")
        if spec.strip():
            lines.append((mode.strip(), spec, f"experiment line {i}"))
    experiments = parse_experiments([(spec, where) for _, spec, where in lines])
    for e, (mode, _, _) in zip(experiments, lines, strict=True):
        e["mode"] = mode
    return experiments


def read_headlines(path: Path, experiments: list[dict]) -> list[dict]:
    """HEADLINES: one row per script, naming an experiment of that script and one of its metrics."""
    metrics, script_of = defaultdict(set), {}
    for e in experiments:
        metrics[e["id"]].update(e["metrics"])
        script_of[e["id"]] = e["cmd"].split()[0] if e["cmd"].split() else ""
    rows = read_table(path, 4, "HEADLINES", "script | experiment id | metric | what it shows")
    headlines = [dict(zip(("script", "id", "metric", "shows"), row, strict=True)) for row in rows]
    for h in headlines:
        if h["id"] not in script_of:
            raise CheckError(f"HEADLINES row {h['script']}: no experiment line has id {h['id']!r}")
        if script_of[h["id"]] != h["script"]:
            raise CheckError(f"HEADLINES row {h['script']}: {h['id']} runs {script_of[h['id']]}, not {h['script']}")
        if h["metric"] not in metrics[h["id"]]:
            raise CheckError(f"HEADLINES row {h['script']}: {h['id']} shows no metric {h['metric']!r}")
    scripts = [h["script"] for h in headlines]
    for script in dict.fromkeys(script_of.values()):
        if scripts.count(script) != 1:
            raise CheckError(f"HEADLINES: script {script!r} needs one row, has {scripts.count(script)}")
    return headlines


def folder_name(path: Path) -> str:
    """A results folder as the page names it: relative to the repository (the working directory), else its name."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.resolve().name


def run_info(folder: Folder) -> dict:
    meta, (n_ok, n_runs) = folder.meta, folder.run_counts()
    stamp = STAMP_RE.search(folder.out.resolve().name)
    date = meta.get("date") or (f"{stamp[1]}-{stamp[2]}-{stamp[3]} {stamp[4]}:{stamp[5]}" if stamp else "unknown")
    return {
        "folder": folder_name(folder.out),
        "date": date,
        "machine": f"{meta.get('cpu', '?')}, {meta.get('cores', '?')} cores, --jobs {meta.get('jobs', '?')}",
        "command": f"bash benchmark.sh {meta.get('argv', '')}".strip(),
        "commit": meta.get("git", "unknown"),
        "seeds": folder.seeds,
        "untrained": folder.untrained,
        "runs_finished": f"{n_ok} of {n_runs}",
        "total_s": meta.get("total_s"),
        "note": meta.get("note"),  # e.g. a folder re-made from an earlier results.json (its runs on another machine)
    }


def untrained_info(folder: Folder) -> dict:
    head, by_kind, _ = untrained_summary(folder)
    return {"folder": folder_name(folder.out), "head": head, "holds": by_kind["holds"], "errors": by_kind["error"]}


def headline(row: dict, claims: list[dict]) -> dict:
    """A HEADLINES row with what the README's table shows of it: the command and published values of the first claim
    line of its experiment that shows its metric."""
    claim = next(c for c in claims if c["id"] == row["id"] and row["metric"] in c["metrics"])
    return row | {k: claim.get(k) for k in ("command", "folder", "seeds", "values", "wall_time_s", "status", "verdict")}


def published_claim(e: dict, first_cmd: dict, trained: list[Folder]) -> dict:
    """One claim line of benchmark.sh, judged in the first folder that ran its experiment with its command (a folder
    run with another command for an experiment counts as not having run it, also for the checks that refer to it)."""
    claim = {k: e[k] for k in ("id", "mode", "claim", "metrics", "prediction")}
    claim |= {"command": e["cmd"], "check": e["check_as_written"], "folder": None, "status": "not run"}
    claim["verdict"] = NOT_RUN
    for folder in trained:
        ran = {x["id"] for x in folder.experiments if first_cmd.get(x["id"]) == x["cmd"]} & folder.ran
        if e["id"] not in ran:
            continue
        seeds = folder.seeds_of(e["id"])
        verdict = evaluate_claim(e, folder.metric_of, seeds, ran) if e["conditions"] else None
        values = {m: [folder.metric_of(e["id"], m, s) for s in seeds] for m in e["metrics"]}
        got = {m: [v for v in vals if v is not None] for m, vals in values.items()}
        return claim | {
            "folder": folder_name(folder.out),
            "seeds": seeds,
            "fingerprint": folder.fingerprints.get(e["id"]),
            "values": values,
            "mean": {m: sum(v) / len(v) if v else None for m, v in got.items()},
            "range": {m: [min(v), max(v)] if v else None for m, v in got.items()},
            "status": verdict["status"] if verdict else "info",
            "verdict": verdict["text"] if verdict else "reported (anchor or fact of the data, not a claim)",
            "crashed_seeds": folder.crashed.get(e["id"], []),
            "wall_time_s": folder.wall_times(e["id"]),
        }
    return claim


def publish(spec: Path, figures_file: Path, headlines_file: Path, paths: list[Path]) -> int:
    experiments = read_benchmark_lines(spec)
    headlines = read_headlines(headlines_file, experiments)
    folders = []
    for path in paths:
        if not (path / "experiments.txt").is_file():
            raise CheckError(f"--publish: {path} is not a results folder (no experiments.txt)")
        folders.append(read_folder(path))
    trained = [f for f in folders if not f.untrained]
    first_cmd = {}
    for e in experiments:
        first_cmd.setdefault(e["id"], e["cmd"])
    claims = [published_claim(e, first_cmd, trained) for e in experiments]
    figure_dir = DOCS / "figures"
    figure_dir.mkdir(parents=True, exist_ok=True)
    for old in figure_dir.glob("*.png"):  # a figure that no published run drew must not stay behind
        old.unlink()
    figures = read_table(figures_file, 6, "FIGURES", "kind | file | title | series | y | reference")
    drawn, figure_ids = {}, {}
    source = {c["id"]: c["folder"] for c in claims if c["folder"]}  # id -> the folder its claims come from
    for kind, name, _, series, _, _ in figures:  # from the folder that its claims use for most of its series
        if kind == "overopt":  # every id that starts with the series' prefix
            ids = [i for i in source if i.startswith(series)]
        else:
            ids = [ref.split(":")[0] for _, ref in series_pairs(series)]
        ran = [
            (sum(source.get(i) == folder_name(f.out) for i in ids), -k, f)
            for k, f in enumerate(trained)
            if (f.out / f"{name}.png").is_file()
        ]
        uses, _, folder = max(ran, key=lambda r: r[:2], default=(0, 0, None))  # the first given on a tie
        figure_ids[name] = ids
        if uses > 0:
            shutil.copyfile(folder.out / f"{name}.png", figure_dir / f"{name}.png")
            drawn[f"{name}.png"] = folder_name(folder.out)
    data = {
        "command": "bash benchmark.sh --publish " + " ".join(folder_name(f.out) for f in folders),
        "runs": [run_info(f) for f in folders],
        "untrained": [untrained_info(f) for f in folders if f.untrained],
        "claims": claims,
        "figures": [
            {"name": name, "title": title, "kind": kind, "y": y, "ids": figure_ids[name]}
            | {"folder": drawn.get(f"{name}.png")}
            for kind, name, title, _, y, _ in figures
        ],
        "headlines": [headline(row, claims) for row in headlines],
    }
    (DOCS / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (DOCS / "results.md").write_text(render_page(data))
    print(f"wrote {DOCS / 'results.md'}, {DOCS / 'results.json'} and {len(drawn)} figures in {figure_dir}")
    if README.is_file() and README_BEGIN in README.read_text():
        README.write_text(readme_with_table(README.read_text(), data))
        print(f"rewrote the results table of {README}")
    else:
        print(f"{README} has no `{README_BEGIN}` line: its results table is not written", file=sys.stderr)
    for h in headlines:  # each script page's own results block
        page = DOCS / f"{h['script']}.md"
        page.write_text(page_with_results(page.read_text(), data, h["script"]))
    return 0


def check_published(spec: Path, headlines_file: Path, table: Path) -> int:
    experiments = read_benchmark_lines(spec)
    reasons = stale_reasons(experiments, read_headlines(headlines_file, experiments))
    more, unstamped = fingerprint_reasons(experiments, read_fingerprint_table(table))
    for reason in reasons + more:
        print(f"benchmark.sh: stale: {reason}", file=sys.stderr)
    if reasons or more:
        return 1
    print(f"{DOCS / 'results.json'} and {DOCS / 'results.md'} carry every claim line of benchmark.sh as it is")
    if unstamped:
        print(f"benchmark.sh: note: {len(unstamped)} published experiments carry no fingerprint (published before "
              "fingerprints), so their numbers are not checked against the code as it is")
    return 0


def fingerprint_reasons(experiments: list[dict], tiny: dict) -> tuple[list[str], list[str]]:
    """(why the published numbers are not the code at HEAD's, the published ids that carry no fingerprint): HEAD's
    fingerprints missing from docs/fingerprints.json, a published fingerprint that HEAD's code does not compute, seeds
    that are not the group's drawn report seeds."""
    keys, cache = line_keys(experiments, tiny), read_fingerprint_cache()
    missing = [i for i in keys if cache.get(i, {}).get("key") != keys[i]]
    if missing:
        return [
            f"{DOCS / 'fingerprints.json'} lacks the fingerprints of the code as it is for {' '.join(missing)} (run "
            "`bash benchmark.sh --fingerprint`: an edit that computes the same numbers keeps them)"
        ], []
    fps, groups = {i: cache[i]["fingerprint"] for i in keys}, seed_groups(experiments)
    path = DOCS / "results.json"
    claims = json.loads(path.read_text())["claims"] if path.is_file() else []
    reasons, unstamped = {}, {}
    for c in claims:
        if c["folder"] is None or c["id"] not in fps:
            continue
        if not c.get("fingerprint"):
            unstamped[c["id"]] = True
        elif c["fingerprint"] != fps[c["id"]]:
            reasons[c["id"]] = (
                f"{c['id']} was published from code whose fingerprint is {c['fingerprint']}; the code as it is "
                f"computes {fps[c['id']]}: rerun it (`--seeds drawn`) and publish"
            )
        elif c["seeds"] != (drawn := drawn_seeds(experiments, fps, groups[c["id"]], len(c["seeds"]))):
            reasons[c["id"]] = f"{c['id']} was published on seeds {c['seeds']}, not its drawn report seeds {drawn}"
    return list(reasons.values()), list(unstamped)


def stale_reasons(experiments: list[dict], headlines: list[dict]) -> list[str]:
    """Why the published page no longer matches benchmark.sh, one line per reason: a claim line (id, command, check)
    that the page does not carry or one it carries that benchmark.sh no longer has, a changed HEADLINES table, or a
    results.md or README table that is not what results.json renders."""
    path = DOCS / "results.json"
    if not path.is_file():
        return [f"{path} not found (write it: bash benchmark.sh --publish <results folder> ...)"]
    data = json.loads(path.read_text())
    current = [(e["id"], e["cmd"], e["check_as_written"]) for e in experiments]
    published = [(c["id"], c["command"], c["check"]) for c in data["claims"]]
    missing, extra = Counter(current) - Counter(published), Counter(published) - Counter(current)
    reasons = []
    for e, key in zip(experiments, current, strict=True):
        if missing[key] > 0:
            missing[key] -= 1
            reasons.append(
                f"{e['where']} (id {e['id']}) is not on the published page (a new line, or its command or check "
                f"changed): `{e['check_as_written']}`"
            )
    for exp_id, _, check in published:
        if extra[(exp_id, _, check)] > 0:
            extra[(exp_id, _, check)] -= 1
            reasons.append(
                f"published claim of id {exp_id}: benchmark.sh has no line with its command and check `{check}`"
            )
    if [{k: h[k] for k in ("script", "id", "metric", "shows")} for h in data["headlines"]] != headlines:
        reasons.append("the HEADLINES table of benchmark.sh is not the one published")
    page = DOCS / "results.md"
    if not page.is_file() or page.read_text() != render_page(data):
        reasons.append(f"{page} is not what {path} renders (edited by hand, or written by another benchmark.sh)")
    readme = README.read_text() if README.is_file() else ""
    if README_BEGIN in readme and readme != readme_with_table(readme, data):
        reasons.append(f"the results table of {README} is not what {path} renders")
    for h in headlines:
        page = DOCS / f"{h['script']}.md"
        text = page.read_text() if page.is_file() else ""
        if PAGE_BEGIN not in text or text != page_with_results(text, data, h["script"]):
            reasons.append(f"the results block of {page} is not what {path} renders")
    return reasons


def python_command(cmd: str) -> str:
    """An experiment's command as a reader pastes it into bash (benchmark.sh adds `--seed S` and the run directory;
    `{run:X}` reads as '<run dir of X>': the run dir of experiment X's run of the same seed)."""
    script, *words = shlex.split(cmd)
    return shlex.join(["python", f"algos/{script}.py", *(RUN_REF_RE.sub(r"<run dir of \1>", w) for w in words)])


def pasteable(cmd: str) -> str:
    """A recorded command with each word quoted where bash needs it (older folders recorded the words unquoted)."""
    return shlex.join(shlex.split(cmd))


def script_of(claim: dict) -> str:
    return claim["command"].split()[0]


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2


def short(v: float) -> str:
    """A headline number: three significant digits, whole numbers from 100 on."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def cell(text: str) -> str:
    """Text in a markdown table cell (a `|` would end the cell)."""
    return text.replace("|", "\\|")


def claim_group(claim: dict) -> list[str]:
    """The heading of an experiment's lines: its anchor, command, mode, folder and seeds, wall time per run."""
    info = f"`{python_command(claim['command'])}` (plus `--seed S`) · {claim['mode']}"
    if claim["folder"] is None:
        info += f" · **{NOT_RUN}**"
    else:
        info += f" · from `{claim['folder']}`, seeds {' '.join(map(str, claim['seeds']))}"
        fp = claim.get("fingerprint")
        info += f" · fingerprint `{fp}`" if fp else " · **no fingerprint** (published before fingerprints)"
        if claim["crashed_seeds"]:
            info += f" · **CRASHED** seeds {', '.join(map(str, claim['crashed_seeds']))}"
        times = claim["wall_time_s"]
        if times:
            info += f" · wall time per run: median {duration(median(times))} ({duration(min(times))} to "
            info += f"{duration(max(times))})"
    return [
        f'### <a id="{claim["id"]}"></a>{claim["id"]}',
        "",
        info,
        "",
        "| claim | measured | lecture predicts | check | verdict |",
        "|---|---|---|---|---|",
    ]


def measured_cell(claim: dict) -> str:
    """Per metric its mean and range over seeds, then the seeds: the first table of results.md and the script pages."""
    if claim["folder"] is None:
        return NOT_RUN
    shown = []
    for metric in claim["metrics"]:
        if claim["range"][metric] is None:
            shown.append(f"`{metric}`: no value")
            continue
        low, high = claim["range"][metric]
        spread = "" if low == high else f" ({fmt(low)} to {fmt(high)})"
        shown.append(f"`{metric}` {fmt(claim['mean'][metric])}{spread}")
    return "<br>".join(shown) + f"<br>seeds {' '.join(map(str, claim['seeds']))}"


def glance_rows(claims: list[dict], link: str) -> list[str]:
    """One row per claim line, failures first: verdict, experiment, claim, mean (range) and seeds."""
    rows = ["| verdict | experiment | claim | measured: mean (range over seeds) |", "|---|---|---|---|"]
    for c in sorted(claims, key=lambda c: STATUS_ORDER.get(c["status"], 5)):
        verdict = c["verdict"].split(": ", 1)[0] if c["folder"] else NOT_RUN  # the seeds' details: on results.md
        rows.append(f"| {cell(verdict)} | [{c['id']}]({link}#{c['id']}) | {cell(c['claim'])} | {measured_cell(c)} |")
    return rows


def figure_caption(figure: dict, folder: bool) -> str:
    """What a figure draws, said under it (on results.md with the folder of its runs)."""
    if figure["kind"] == "curve":
        what = f"`{figure['y']}` against environment steps: the mean over seeds with a band of one standard deviation"
        if figure["y"].startswith("charts/"):
            what += " (each seed's curve a rolling mean over episodes first)"
    elif figure["kind"] == "bar":
        what = "One bar per series: the mean over seeds; each dot is one seed"
    else:
        what = "One line per run (a beta and a seed): its evaluations in training order"
    return f"{what}." + (f" Runs of `{figure['folder']}`." if folder else "")


def figure_lines(figure: dict, folder: bool) -> list[str]:
    return [f"![{figure['title']}](figures/{figure['name']}.png)", "", figure_caption(figure, folder), ""]


def render_script_results(data: dict, script: str) -> list[str]:
    """The results block of docs/<script>.md: its claim lines (failures first) and its figures."""
    claims = [c for c in data["claims"] if script_of(c) == script]
    ids = {c["id"] for c in claims}
    lines = [
        PAGE_BEGIN,
        "",
        "Claims of this script as published on [the results page](results.md) (each experiment's command, "
        "folder, seeds and fingerprint are there):",
        "",
        *glance_rows(claims, "results.md"),
        "",
    ]
    for figure in data["figures"]:
        if figure["folder"] and ids & set(figure["ids"]):
            lines += figure_lines(figure, folder=False)
    return [*lines, PAGE_END]


def page_with_results(text: str, data: dict, script: str) -> str:
    before, _, rest = text.partition(PAGE_BEGIN)
    if PAGE_END not in rest:
        raise CheckError(f"docs/{script}.md: no `{PAGE_BEGIN}` ... `{PAGE_END}` block for its results")
    return before + "\n".join(render_script_results(data, script)) + rest.split(PAGE_END, 1)[1]


def claim_row(claim: dict) -> str:
    cells = []
    for metric in claim["metrics"]:
        if claim["folder"] is None:
            cells.append(f"`{metric}`: —")
            continue
        shown = f"`{metric}`: {' / '.join(fmt(v) for v in claim['values'][metric])}"
        if claim["range"][metric] is not None:
            low, high = claim["range"][metric]
            shown += f" · mean {fmt(claim['mean'][metric])}, range {fmt(low)} to {fmt(high)}"
        cells.append(shown)
    verdict = claim["verdict"] if claim["folder"] else NOT_RUN
    return (
        f"| {cell(claim['claim'])} | {'<br>'.join(cells)} | {cell(claim['prediction'])} | `{cell(claim['check'])}` "
        f"| {cell(verdict)} |"
    )


def render_page(data: dict) -> str:
    claims = data["claims"]
    statuses = [c["status"] for c in claims]
    n_hold, n_fail, n_unchecked = statuses.count("holds"), statuses.count("fails"), statuses.count("not checked")
    head = f"**claims holding: {n_hold} of {n_hold + n_fail}**"
    if n_unchecked:
        head += f" ({n_unchecked} not checked: an experiment they compare with was not run)"
    head += f" · claim lines {NOT_RUN}: {statuses.count('not run')} of {len(claims)}"
    published = {c["id"]: c.get("fingerprint") for c in claims if c["folder"]}
    head += f" · experiments with a fingerprint: {sum(map(bool, published.values()))} of {len(published)}"
    doc = [
        "# seqrl benchmark results",
        "",
        f"Written by `{data['command']}` from the runs below; not edited by hand (`bash benchmark.sh "
        "--check-published` fails when this page does not carry every claim line of benchmark.sh as it is).",
        "",
        head,
        "",
        *glance_rows(claims, ""),
        "",
        "Single-seed numbers differ across CPUs (torch's CPU kernels round differently per instruction set); the "
        "checks are set with margin so that they hold on other seeds and machines.",
        "",
        "## Untrained control",
        "",
        "The same runs with learning cut to nothing (`bash benchmark.sh --quick --untrained`): a claim that something "
        "was learned must fail there; one that holds cannot fail.",
        "",
    ]
    if not data["untrained"]:
        doc += ["No untrained control among the published runs.", ""]
    for control in data["untrained"]:
        doc += [f"`{control['folder']}`: {control['head']}", ""]
        if control["holds"]:
            doc += ["Positive claims that hold untrained (they cannot fail):", "", *control["holds"], ""]
        else:
            doc += ["No positive claim holds untrained.", ""]
        if control["errors"]:
            doc += ["Errors (no value to judge):", "", *control["errors"], ""]
    doc += [
        "## Claims",
        "",
        "Every claim line of benchmark.sh in its order, grouped by experiment (one run, several claims); `quick` "
        "lines run in `--quick` and full mode, `full` lines in full mode only. Measured: per-seed values in seed "
        "order, then the mean and range (min to max) over seeds. Check: as written in benchmark.sh, evaluated on "
        "every seed (`mean:` conditions on the means over seeds).",
        "",
    ]
    previous = None
    for claim in claims:
        if claim["id"] != previous:
            doc += ([""] if previous else []) + claim_group(claim)
            previous = claim["id"]
        doc.append(claim_row(claim))
    doc += [
        "",
        "## Published runs",
        "",
        "| folder | date | machine | command | commit | seeds | runs finished | total wall time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        total = duration(run["total_s"]) if run["total_s"] is not None else "unknown"
        doc.append(
            f"| `{run['folder']}` | {run['date']} | {run['machine']} | `{cell(pasteable(run['command']))}` | "
            f"{run['commit']} | {' '.join(map(str, run['seeds']))} | {run['runs_finished']} | {total} |"
        )
    doc += [f"\n`{run['folder']}`: {run['note']}" for run in data["runs"] if run.get("note")]
    doc += ["", "## Figures", ""]
    for figure in data["figures"]:
        if figure["folder"]:
            doc += [f"### {figure['name']}", "", *figure_lines(figure, folder=True)]
    missing = [f"- `{f['name']}`: {f['title']}" for f in data["figures"] if not f["folder"]]
    if missing:
        doc += ["Not drawn in the published runs (their experiments were not run):", "", *missing, ""]
    return "\n".join(doc).rstrip("\n") + "\n"


def render_headlines(data: dict) -> list[str]:
    """README's table of the nine scripts, each with its headline result (HEADLINES in benchmark.sh)."""
    rows = [
        "| script | what it shows | headline result (mean, range over seeds) | wall time per run | command |",
        "|---|---|---|---|---|",
    ]
    for h in data["headlines"]:
        link = f"[{h['id']}](docs/results.md#{h['id']})"
        values = [v for v in (h["values"] or {}).get(h["metric"], []) if v is not None]
        result = f"{NOT_RUN}: {link}"
        if values:
            spread = f"{short(min(values))} to {short(max(values))}"
            result = f"`{h['metric']}` {short(sum(values) / len(values))} ({spread}, {len(values)} seeds): {link}"
            if h.get("status") == "fails":  # the headline's claim line failed: the front page says so
                held = re.search(r"holds on (\d+)/(\d+)", h["verdict"] or "")
                result += f" · **fails on {int(held[2]) - int(held[1])} of {held[2]} seeds**" if held else " · **fails**"
        wall = duration(median(h["wall_time_s"])) if h["wall_time_s"] else "—"
        rows.append(
            f"| [{h['script']}](docs/{h['script']}.md) | {cell(h['shows'])} | {result} | {wall} | "
            f"`{python_command(h['command'])}` |"
        )
    return rows


def readme_with_table(text: str, data: dict) -> str:
    before, _, rest = text.partition(README_BEGIN)
    if README_END not in rest:
        raise CheckError(f"{README}: `{README_BEGIN}` without a `{README_END}` line")
    after = rest.split(README_END, 1)[1]
    return before + "\n".join([README_BEGIN, *render_headlines(data), README_END]) + after


def check_untrained_table(path: Path, experiments: list[dict]):
    """UNTRAINED_TABLE: one row per script, and every script of an experiment line has one."""
    rows = read_table(path, 3, "UNTRAINED_TABLE", "script | --arguments | what is left")
    for i, row in enumerate(rows, start=1):
        if not row[1].startswith("--"):
            raise CheckError(f"UNTRAINED_TABLE line {i}: needs `script | --arguments | what is left`")
    cut = {row[0] for row in rows}
    for e in experiments:
        script = e["cmd"].split()[0] if e["cmd"].split() else ""
        if script not in cut:
            raise CheckError(
                f"{e['where']} (id {e['id']}): script {script!r} has no UNTRAINED_TABLE row (the arguments that cut "
                "its learning to nothing)"
            )


if __name__ == "__main__":
    mode, args = sys.argv[1], [Path(a) for a in sys.argv[2:]]
    try:
        if mode == "validate":  # every experiment line (for the refs) and the tables of benchmark.sh must parse
            experiments = read_benchmark_lines(args[0])
            if len(args) > 1:
                check_untrained_table(args[1], experiments)
            if len(args) > 2:
                read_headlines(args[2], experiments)
            if len(args) > 3:
                check_fingerprint_table(experiments, read_fingerprint_table(args[3]))
            sys.exit(0)
        if mode == "publish":  # the caller's directory (relative folders), lines, figures, headlines, folders
            caller, spec, figures_file, headlines_file, *paths = args
            folders = [p if p.is_absolute() or not (caller / p).is_dir() else caller / p for p in paths]
            sys.exit(publish(spec, figures_file, headlines_file, folders))
        if mode == "check-published":
            sys.exit(check_published(args[0], args[1], args[2]))
        if mode == "fingerprint":  # lines, fingerprint table, jobs, --only regex
            sys.exit(write_fingerprints(args[0], args[1], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else ""))
        if mode == "prepare":  # lines, fingerprint table, results folder, seeds, jobs
            sys.exit(prepare(args[0], args[1], args[2], sys.argv[5], int(sys.argv[6])))
        sys.exit(aggregate(args[0]))
    except CheckError as err:
        print(f"benchmark.sh: {err}", file=sys.stderr)
        sys.exit(2)
PY
)

# Validate every experiment line and check before anything runs (a typo must not cost an hour of runs).
TABLES=$(mktemp -d)
trap 'rm -rf "$TABLES"' EXIT
printf '%s\n' "$EXPERIMENTS" | grep -v '^\s*$' >"$TABLES/experiments"
printf '%s\n' "$UNTRAINED_TABLE" >"$TABLES/untrained"
printf '%s\n' "$HEADLINES" >"$TABLES/headlines"
printf '%s\n' "$FIGURES" >"$TABLES/figures"
printf '%s\n' "$FINGERPRINT_TABLE" >"$TABLES/fingerprint"
python3 -c "$AGG_PY" validate "$TABLES/experiments" "$TABLES/untrained" "$TABLES/headlines" "$TABLES/fingerprint" \
  || exit $?
if [ "$VALIDATE" = 1 ]; then echo "benchmark.sh: every experiment line and check parses"; exit 0; fi
if [ "$CHECK_PUBLISHED" = 1 ]; then
  python3 -c "$AGG_PY" check-published "$TABLES/experiments" "$TABLES/headlines" "$TABLES/fingerprint"; exit $?
fi
if [ "$FINGERPRINT" = 1 ]; then
  python3 -c "$AGG_PY" fingerprint "$TABLES/experiments" "$TABLES/fingerprint" "$JOBS" "$ONLY"; exit $?
fi
if [ ${#PUBLISH[@]} -gt 0 ]; then
  python3 -c "$AGG_PY" publish "$CALLER_DIR" "$TABLES/experiments" "$TABLES/figures" "$TABLES/headlines" "${PUBLISH[@]}"
  exit $?
fi

if [ -n "$AGGREGATE" ]; then
  if [ "$UNTRAINED" = 1 ]; then
    echo "benchmark.sh: --aggregate takes no --untrained (the folder's meta.json says how it was run)" >&2; exit 2
  fi
  OUT="${AGGREGATE%/}"
  [ -f "$OUT/experiments.txt" ] || { echo "benchmark.sh: $OUT/experiments.txt not found" >&2; exit 2; }
  [ -f "$OUT/figures.txt" ] || printf '%s\n' "$FIGURES" >"$OUT/figures.txt"
else
  OUT="results/$(date +%Y%m%d-%H%M%S)"
  [ "$UNTRAINED" = 0 ] || OUT="$OUT-untrained"
  while ! mkdir -p "$(dirname "$OUT")" || ! mkdir "$OUT" 2>/dev/null; do OUT="${OUT%-r*}-r$RANDOM"; done
  mkdir -p "$OUT/runs" "$OUT/logs"
  echo "# id | claim | command | metrics | prediction | check" >"$OUT/experiments.txt"
  declare -A UNTRAINED_ARGS=()  # script -> the arguments appended to its commands in --untrained mode
  while IFS='|' read -r script extra _; do
    [ -z "${script// /}" ] || UNTRAINED_ARGS[$(echo $script)]=$(echo $extra)
  done <<<"$UNTRAINED_TABLE"
  [ "$UNTRAINED" = 0 ] || printf '%s\n' "$UNTRAINED_TABLE" >"$OUT/untrained.txt"
  printf '%s\n' "$EXPERIMENTS" | grep -v '^\s*$' | while IFS= read -r line; do
    mode="${line%%:*}"; spec="${line#*:}"
    if [ "$mode" = full ] && [ "$QUICK" = 1 ]; then continue; fi
    id=$(echo "$spec" | cut -d'|' -f1 | xargs)
    if [ -n "$ONLY" ] && ! [[ "$id" =~ $ONLY ]]; then continue; fi
    if [ "$UNTRAINED" = 1 ]; then  # the command as run: learning cut to nothing (the last value of a flag wins)
      IFS='|' read -r f_id f_claim f_cmd f_rest <<<"$spec"
      script=$(echo "$f_cmd" | awk '{print $1}')
      spec="$f_id|$f_claim|${f_cmd%"${f_cmd##*[![:space:]]}"} ${UNTRAINED_ARGS[$script]} |$f_rest"
    fi
    echo "$spec" >>"$OUT/experiments.txt"
  done
  printf '%s\n' "$FIGURES" >"$OUT/figures.txt"
  for dep in $(grep -o '{run:[^}]*}' "$OUT/experiments.txt" | sort -u | sed 's/^{run:\(.*\)}$/\1/'); do
    if ! cut -d'|' -f1 "$OUT/experiments.txt" | tr -d ' ' | grep -qxF "$dep"; then
      echo "benchmark.sh: a selected experiment reads the runs of $dep ({run:$dep}): select it too (--only)" >&2
      rm -r "$OUT"; exit 2
    fi
  done
  N_EXP=$(tail -n +2 "$OUT/experiments.txt" | cut -d'|' -f1 | sort -u | wc -l)
  [ "$N_EXP" -gt 0 ] || { echo "benchmark.sh: no experiment id matches --only '$ONLY'" >&2; rm -r "$OUT"; exit 2; }
  CPU=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
  GIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -z "$(git status --porcelain 2>/dev/null)" ] || GIT="$GIT (with uncommitted changes)"
  python3 -c 'import json,sys; print(json.dumps(dict(zip(["argv","seeds","jobs","cpu","cores","git","untrained","date"],
    sys.argv[1:]))))' "$ARGV" "$SEEDS" "$JOBS" "${CPU:-unknown}" "$(nproc --all)" "$GIT" "$UNTRAINED" \
    "$(date '+%Y-%m-%d %H:%M')" >"$OUT/meta.json"
  # every run stamped with its line's fingerprint (fingerprints.json); each id's seeds (seeds.txt)
  python3 -c "$AGG_PY" prepare "$TABLES/experiments" "$TABLES/fingerprint" "$OUT" "$SEEDS" "$JOBS" \
    || { rc=$?; rm -r "$OUT"; exit $rc; }
  declare -A SEEDS_OF=()
  while read -r id seeds_of; do SEEDS_OF[$id]=$seeds_of; done <"$OUT/seeds.txt"
  TOTAL=$(cut -d' ' -f2- "$OUT/seeds.txt" | wc -w)
  echo "benchmark: $N_EXP experiments, $TOTAL runs, $JOBS at a time -> $OUT"
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1

  run_one() {  # id seed script args... ; prints one progress line
    local id="$1" seed="$2"; shift 2
    local script="$1"; shift
    local start=$SECONDS rc=0 args=() a dep dir status
    for a in "$@"; do  # {run:<dep>}: the run dir of dep's run of this seed, once that run has ended
      while [[ "$a" =~ \{run:([^}]*)\} ]]; do
        dep="${BASH_REMATCH[1]}"
        while [ ! -f "$OUT/logs/${dep}_seed${seed}.exit" ]; do sleep 1; done
        dir=$(ls -d "$OUT/runs/$dep/seed$seed"/*/summary.json 2>/dev/null | head -1)
        if [ -z "$dir" ]; then
          mkdir -p "$OUT/runs/$id/seed$seed"
          echo "$dep seed=$seed did not finish: no run dir for {run:$dep}" >"$OUT/logs/${id}_seed${seed}.log"
          rc=1; break 2
        fi
        a="${a//"{run:$dep}"/$(dirname "$dir")}"
      done
      args+=("$a")
    done
    start=$SECONDS  # the run's own time, not the wait
    if [ $rc -eq 0 ]; then
      python3 "algos/$script.py" --seed "$seed" --runs-dir "$OUT/runs/$id/seed$seed" --exp-name "$id" "${args[@]}" \
        </dev/null >"$OUT/logs/${id}_seed${seed}.log" 2>&1
      rc=$?
    fi
    echo "$rc" >"$OUT/logs/${id}_seed${seed}.exit"
    status="ok"; [ $rc -eq 0 ] || status="CRASHED (exit $rc, see logs/${id}_seed${seed}.log)"
    echo "[$(date +%H:%M:%S)] $id seed=$seed $status in $((SECONDS - start))s" | tee -a "$OUT/log.txt"
  }

  T0=$SECONDS
  i=0
  declare -A SEEN=()
  while IFS='|' read -r id claim cmd rest; do
    [[ "$id" == \#* ]] && continue
    id=$(echo "$id" | xargs)
    [ -z "${SEEN[$id]:-}" ] || continue  # several claims (lines) may read the same run
    SEEN[$id]=1
    for seed in ${SEEDS_OF[$id]}; do
      i=$((i + 1))
      while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
      echo "[$(date +%H:%M:%S)] start $i/$TOTAL: $id seed=$seed"
      eval "run_one \"\$id\" \"\$seed\" $cmd" &  # eval: the command's quoted arguments stay whole
    done
  done <"$OUT/experiments.txt"
  wait
  echo "benchmark: all runs finished in $((SECONDS - T0))s; checking the claims"
  python3 -c 'import json,sys; p=sys.argv[1]; m=json.load(open(p)); m["total_s"]=int(sys.argv[2]); json.dump(m,open(p,"w"))' \
    "$OUT/meta.json" "$((SECONDS - T0))"
fi

python3 -c "$AGG_PY" aggregate "$OUT"
exit $?
}
