"""R2D2 with a gated Transformer-XL memory (algos/r2d2_trxl_memory.py): the attention band and its episode masks,
memory carried while acting = recomputation from the episode start (float64), the window mode's contexts, the
replay's stored memory and its burn-in refresh, the one-network Delta-Q ablation, smoke runs, clear errors."""

import ast
import functools
import sys

import gymnasium as gym
import numpy as np
import pytest
import spaces_env
import torch
from conftest import ROOT, load_script, run_in_process, run_script

trxl = load_script("r2d2_trxl_memory")
rnn = load_script("r2d2_rnnstate")


# ---------------------------------------------------------------- math shared with r2d2_rnnstate.py
def test_what_both_r2d2_scripts_define_is_the_same_text():
    """A function, class or constant both scripts define is the same text in each (where they must differ, the names
    differ: MemoryReplay, memory_actor_step, final_delta_q_memory, replay_bytes_memory), but the script's own."""
    own = {"Args", "main", "evaluate", "TrainState", "Run", "parse_args", "start_run", "ARCH_FIELDS", "SCRIPT"}
    own |= {"POSITIVE_FIELDS", "ZERO_OK_FIELDS", "close_episodes"}  # the checks and the replay row of each script
    texts = []
    for name in ("r2d2_trxl_memory", "r2d2_rnnstate"):
        text = (ROOT / "algos" / f"{name}.py").read_text()
        nodes = {}
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                nodes[node.name] = ast.get_source_segment(text, node)
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                nodes[node.targets[0].id] = ast.get_source_segment(text, node)
        texts.append(nodes)
    shared = (texts[0].keys() & texts[1].keys()) - own
    assert {"value_rescale", "nstep_rescaled_targets", "save_train_state", "install_stop_handlers"} <= shared
    assert [name for name in sorted(shared) if texts[0][name] != texts[1][name]] == []


def test_targets_priorities_and_rescaling_are_r2d2_rnnstate_s():
    """The R2D2 parts are the same functions as in r2d2_rnnstate.py (whose tests check them against plain loops)."""
    rng = np.random.default_rng(0)
    T, B, n = 20, 6, 4
    final = torch.tensor(rng.random((T, B)) < 0.2).double()
    terminal = final * torch.tensor(rng.random((T, B)) < 0.5).double()
    rewards, boot = torch.tensor(rng.normal(size=(T, B))), torch.tensor(rng.normal(size=(T, B)) * 5)
    targets = [
        module.nstep_rescaled_targets(rewards, final, terminal, boot, 0.97, n, T - n, 1e-3) for module in (trxl, rnn)
    ]
    torch.testing.assert_close(targets[0], targets[1], rtol=0, atol=0)
    td, mask = torch.rand(T, B), (torch.rand(T, B) > 0.3).float()
    torch.testing.assert_close(trxl.sequence_priority(td, mask, 0.9), rnn.sequence_priority(td, mask, 0.9))
    x = torch.linspace(-50, 50, 101).double()
    torch.testing.assert_close(trxl.inverse_value_rescale(trxl.value_rescale(x, 1e-3), 1e-3), x)
    np.testing.assert_array_equal(trxl.ape_x_epsilons(8, 0.4, 7.0), rnn.ape_x_epsilons(8, 0.4, 7.0))


def test_attention_band_by_hand():
    """2 memory entries (the older one of another episode) then 3 rows, span 2: row i (key 2 + i) sees keys
    2 + i - 2 .. 2 + i that are valid, and always itself."""
    key_valid = torch.tensor([[False], [True], [True], [True], [False]])  # (S = 5, B = 1); row 2 before its episode
    allowed, offset = trxl.attention_band(3, key_valid, 2)
    expected = [
        [0, 1, 1, 0, 0],  # row 0 = key 2: keys 0 (other episode), 1, 2
        [0, 1, 1, 1, 0],  # row 1 = key 3: keys 1, 2, 3
        [0, 0, 1, 1, 1],  # row 2 = key 4: keys 2, 3 and itself (invalid, but the diagonal is always allowed)
    ]
    np.testing.assert_array_equal(allowed[0].int().numpy(), expected)
    np.testing.assert_array_equal(offset[0].numpy(), [2, 1, 0, -1, -2])


def tiny_net(span, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    net = trxl.TransformerXLQNetwork(3, 4, 16, 2, 2, 32, span).to(dtype)
    with torch.no_grad():  # away from the near-identity gates of the initialization, so every part matters
        for param in net.parameters():
            param.normal_(0.0, 0.3)
    return net


def act(net, memory, window, obs, prev_action, prev_reward, first):
    """Drive actor_step over (T, E) inputs; returns Q (T, E, A) and the stored layer inputs (T, E, L', D)."""
    context = trxl.initial_context(net, memory, window, obs.shape[1], "cpu")
    context = {key: value.to(torch.float64) if value.is_floating_point() else value for key, value in context.items()}
    qs, stored = [], []
    for t in range(obs.shape[0]):
        q, context, inputs = trxl.memory_actor_step(
            net, context, obs[t].numpy(), prev_action[t].numpy(), prev_reward[t].numpy(), first[t]
        )
        qs.append(q)
        stored.append(torch.as_tensor(inputs))
    return torch.stack(qs), torch.stack(stored)


def random_inputs(T=15, E=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(T, E, 3, generator=g, dtype=torch.float64)
    prev_action = torch.randint(-1, 4, (T, E), generator=g)
    prev_reward = torch.randn(T, E, generator=g, dtype=torch.float64)
    first = np.zeros((T, E), dtype=bool)
    first[0] = True
    first[7, 1] = True  # env 1 starts a new episode at step 7
    return obs, prev_action, prev_reward, first


def test_memory_carried_while_acting_equals_recomputing_from_the_episode_start_float64():
    """The band (span M) makes acting with the memory of the last M layer inputs exact: the same Q as one forward
    pass over the episode from its first step, at every step (the memory's reach, M x layers, is longer than M);
    and the layer inputs the actor stores are those of the recomputation."""
    M = 4
    net = tiny_net(M)
    obs, prev_action, prev_reward, first = random_inputs()
    q_act, stored = act(net, "stored", 0, obs, prev_action, prev_reward, first)
    x = net.encode(obs, prev_action, prev_reward)
    with torch.no_grad():
        for e, start in ((0, 0), (1, 7), (2, 0)):
            rows = slice(start, 15)  # the episode running at the end
            q_full, inputs = net(
                x[rows, e : e + 1],
                trxl.no_memory(net, 1, "cpu").double(),
                torch.ones(rows.stop - rows.start, 1, dtype=torch.bool),
            )
            torch.testing.assert_close(q_act[rows, e], q_full[:, 0], rtol=0, atol=1e-12)
            torch.testing.assert_close(stored[rows, e], inputs[:, :, 0].permute(1, 0, 2), rtol=0, atol=1e-12)
        # env 1 before its reset: the first episode, rows 0..6
        q_full, _ = net(x[:7, 1:2], trxl.no_memory(net, 1, "cpu").double(), torch.ones(7, 1, dtype=torch.bool))
        torch.testing.assert_close(q_act[:7, 1], q_full[:, 0], rtol=0, atol=1e-12)
        # the memory matters: with a band of 1 (each layer sees one step back) the late steps' Q-values differ
        q_band_m, _ = net(x[:, :1], trxl.no_memory(net, 1, "cpu").double(), torch.ones(15, 1, dtype=torch.bool))
        for module in (net, *net.blocks):
            module.span = 1
        q_band1, _ = net(x[:, :1], trxl.no_memory(net, 1, "cpu").double(), torch.ones(15, 1, dtype=torch.bool))
        assert (q_band1[5:] - q_band_m[5:]).abs().max() > 1e-3


def test_the_memory_reaches_exactly_memory_length_times_layers_steps_back():
    """Reach: a change of the first observation changes Q up to M x L steps later and never after (the band of each
    layer passes information at most M steps on): what a corridor longer than M x L cannot get past."""
    M, layers, T = 3, 2, 12
    net = tiny_net(M)
    assert len(net.blocks) == layers
    obs, prev_action, prev_reward, _ = (value[:, :1] for value in random_inputs(T=T, E=2))  # one episode
    changed = obs.clone()
    changed[0] += 1.0
    with torch.no_grad():
        q, _ = net(
            net.encode(obs, prev_action, prev_reward),
            trxl.no_memory(net, 1, "cpu").double(),
            torch.ones(T, 1, dtype=torch.bool),
        )
        q_changed, _ = net(
            net.encode(changed, prev_action, prev_reward),
            trxl.no_memory(net, 1, "cpu").double(),
            torch.ones(T, 1, dtype=torch.bool),
        )
    moved = (q - q_changed).abs().amax(dim=(1, 2))  # (T,)
    assert (moved[: M * layers + 1] > 1e-6).all() and (moved[M * layers + 1 :] == 0).all()


def test_window_mode_acts_on_the_last_k_rows_and_trains_on_windows_from_their_first_row():
    """DTQN mode: each acting step's Q is the network over the last k rows of its episode (recomputed); a replayed
    window of rows t0 .. t0 + m + n - 1 (m + n <= k) is trained from its first row, no memory before it."""
    k = 4
    net = tiny_net(k - 1)
    obs, prev_action, prev_reward, first = random_inputs()
    q_act, stored = act(net, "window", k, obs, prev_action, prev_reward, first)
    assert stored.shape[2] == 0  # nothing to store: no memory
    x = net.encode(obs, prev_action, prev_reward)
    with torch.no_grad():
        for t in range(15):
            lo = max(0, t - k + 1)
            q, _ = net(x[lo : t + 1, :1], trxl.no_memory(net, 1, "cpu").double(), torch.ones(t + 1 - lo, 1).bool())
            torch.testing.assert_close(q_act[t, 0], q[-1, 0], rtol=0, atol=1e-12)
        win = {
            "obs": obs[3:7],
            "prev_action": prev_action[3:7],
            "prev_reward": prev_reward[3:7],
            "key_valid": torch.ones(4, 3, dtype=torch.bool),
        }
        q_train = trxl.replay_q(net, win, 0, trxl.Args(memory="window", window=k, memory_length=k - 1))
        q_first_row_on, _ = net(x[3:7], trxl.no_memory(net, 3, "cpu").double(), torch.ones(4, 3).bool())
        torch.testing.assert_close(q_train, q_first_row_on, rtol=0, atol=1e-12)
        torch.testing.assert_close(q_train[-1, 0], q_act[6, 0], rtol=0, atol=1e-12)  # a full window: as when acting


# ---------------------------------------------------------------- replay with a real NEXT_STEP vector env
class CounterEnv(gym.Env):
    """obs = [episode id (> 0: never an empty row's 0), step in episode, 1]; random lengths 1..12, ends either way."""

    def __init__(self, env_index):
        self.observation_space = gym.spaces.Box(-1e9, 1e9, shape=(3,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.env_index, self.episode = env_index, -1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t, self.length = 0, int(self.np_random.integers(1, 13))
        self.truncates = bool(self.np_random.random() < 0.5)
        return self._obs(), {}

    def _obs(self):
        return np.array([(1000 * self.env_index + self.episode + 1) / 1000, self.t / 10, 1.0], dtype=np.float32)

    def step(self, action):
        self.t += 1
        ended = self.t >= self.length
        return self._obs(), 0.1 * self.t, ended and not self.truncates, ended and self.truncates, {}


M_TEST, BURN_IN_TEST, SEQ_LEN_TEST, N_TEST = 5, 2, 4, 2


def fill_replay(
    memory="stored", num_vector_steps=200, window=SEQ_LEN_TEST + N_TEST, memory_length=M_TEST, store_layer0=True
):
    """Drive the script's actor and replay exactly as its main loop does, on CounterEnvs (default NEXT_STEP), with
    the replay's lead and stored layers as the script sets them for --memory `memory` (2 layers)."""
    E = 4
    vec = gym.vector.SyncVectorEnv([lambda i=i: CounterEnv(i) for i in range(E)])
    sizes = {"d_model": 16, "num_layers": 2, "num_heads": 2, "ff_size": 32, "window": window}
    args = trxl.Args(memory=memory, memory_length=memory_length, burn_in=BURN_IN_TEST, **sizes)
    torch.manual_seed(0)
    net = trxl.build_network(args, 3, 2)
    layers = 2 - (not store_layer0) if trxl.MEMORY_MODES[memory].stores_memory else 0
    rb = trxl.MemoryReplay(4000, E, 3, layers, 16, SEQ_LEN_TEST, 1, trxl.replay_lead(args), N_TEST)
    context = trxl.initial_context(net, memory, window, E, "cpu")
    rng = np.random.default_rng(0)
    obs, _ = vec.reset(seed=0)
    first, final, terminal = np.ones(E, bool), np.zeros(E, bool), np.zeros(E, bool)
    prev_action, prev_reward = np.full(E, trxl.NO_ACTION), np.zeros(E, np.float32)
    for _ in range(num_vector_steps):
        prev_action[first], prev_reward[first] = trxl.NO_ACTION, 0.0
        _, context, inputs = trxl.memory_actor_step(net, context, obs, prev_action, prev_reward, first)
        action = rng.integers(2, size=E)
        next_obs, reward, term, trunc, _ = vec.step(action)
        reward = np.where(final, 0.0, reward).astype(np.float32)
        rb.add(
            obs=obs,
            first=first,
            final=final,
            terminal=terminal,
            prev_action=prev_action,
            prev_reward=prev_reward,
            layer_inputs=inputs,
            action=action,
            reward=reward,
        )
        first, final, terminal = trxl.next_row_flags(final, term, trunc)
        obs, prev_action, prev_reward = next_obs, action, reward
    return rb, net


def test_stored_memory_is_the_actor_s_and_replays_exactly_with_and_without_burn_in():
    """An unchanged network: the stored memory at t0 (with or without a burn-in refresh) gives exactly the Q of the
    recomputation from the episode start; the empty memory does not where t0 is mid-episode; key_valid masks the
    rows before the episode."""
    rb, net = fill_replay()
    ids = np.nonzero(rb.valid())[0][:150]
    anchors, starts = rb.seq_anchor[ids], rb.seq_ep_start[ids]
    assert (anchors > starts).sum() > 30 and (anchors - starts).max() > M_TEST + BURN_IN_TEST
    prefix = int((anchors - starts).max())
    full = trxl.to_torch(rb.gather(ids, lead=prefix), "cpu")
    win = trxl.to_torch(rb.gather(ids), "cpu")
    # key_valid: rows of the sequence's episode (obs[0] is the episode id) from its start on
    ep_id = win["obs"][rb.lead, :, 0]  # the anchor row's episode
    same = win["obs"][: rb.lead + 1, :, 0] == ep_id
    np.testing.assert_array_equal(win["key_valid"][: rb.lead + 1].numpy(), same.numpy())
    with torch.no_grad():
        q_true = trxl.memory_q(net, full, prefix, "zero", prefix, M_TEST)
        for burn_in in (0, BURN_IN_TEST):
            q_stored = trxl.memory_q(net, win, rb.lead, "stored", burn_in, M_TEST)
            assert trxl.delta_q(q_stored, q_true).max() < 1e-5
        q_zero = trxl.memory_q(net, win, rb.lead, "zero", 0, M_TEST)
        dq = trxl.delta_q(q_zero[0], q_true[0])
        assert dq[torch.tensor(anchors == starts)].max() < 1e-5 and dq[torch.tensor(anchors > starts)].mean() > 1e-3


def test_burn_in_refreshes_the_newest_entries_and_final_delta_q_orders_the_three_starts():
    """After a weight change the stored memory is stale; the burn-in recomputes its burn_in newest entries (so it
    repairs part of the error) and keeps the M - burn_in older ones as stored. final_delta_q_memory measures this on
    one network."""
    rb, net = fill_replay()
    dq = trxl.final_delta_q_memory(net, rb, np.random.default_rng(0), 100, "cpu", BURN_IN_TEST, M_TEST)
    assert dq["count"] == 100
    assert max(dq["first_stored"], dq["last_stored"], dq["first_stored_burn_in"], dq["last_stored_burn_in"]) < 1e-5
    assert dq["first_zero"] > 1e-3 and dq["first_zero_burn_in"] > 1e-3  # mid-episode: an empty memory is wrong
    ids = np.nonzero(rb.valid())[0][:50]
    win = trxl.to_torch(rb.gather(ids), "cpu")
    with torch.no_grad():
        for param in net.parameters():  # a "training step": the stored memory is now stale
            param.add_(0.05 * torch.randn_like(param))
        entries, valid = trxl.anchor_memory(net, win, rb.lead, "stored", BURN_IN_TEST, M_TEST)
        stored = win["layer_inputs"][rb.lead - M_TEST : rb.lead].permute(2, 0, 1, 3)
        torch.testing.assert_close(entries[:, : M_TEST - BURN_IN_TEST], stored[:, : M_TEST - BURN_IN_TEST])
        assert (entries[:, -BURN_IN_TEST:] - stored[:, -BURN_IN_TEST:]).abs().max() > 1e-3  # recomputed
        np.testing.assert_array_equal(valid.numpy(), win["key_valid"][rb.lead - M_TEST : rb.lead].numpy())
    dq = trxl.final_delta_q_memory(net, rb, np.random.default_rng(0), 100, "cpu", BURN_IN_TEST, M_TEST)
    assert dq["first_zero"] > dq["first_stored"] > dq["first_stored_burn_in"] > 1e-5


def test_without_layer0_stored_the_memory_recomputes_it_from_the_window_rows():
    """--no-store-layer0: the replay keeps layers >= 1 only; layer 0's entries are the embeddings of the window's rows
    under the current network. Unchanged network: exactly the episode recompute's Q. After a weight change: layer 0
    fresh (= encode now), layer 1 as stored."""
    rb, net = fill_replay(store_layer0=False)
    assert rb.layer_inputs.shape[2] == 1
    rb_all, _ = fill_replay()  # the same actor and envs storing both layers
    np.testing.assert_array_equal(rb.layer_inputs[:, :, 0], rb_all.layer_inputs[:, :, 1])
    ids = np.nonzero(rb.valid())[0][:150]
    prefix = int((rb.seq_anchor[ids] - rb.seq_ep_start[ids]).max())
    full, win = (trxl.to_torch(rb.gather(ids, lead=lead), "cpu") for lead in (prefix, None))
    with torch.no_grad():
        q_true = trxl.memory_q(net, full, prefix, "zero", prefix, M_TEST)
        for burn_in in (0, BURN_IN_TEST):
            assert trxl.delta_q(trxl.memory_q(net, win, rb.lead, "stored", burn_in, M_TEST), q_true).max() < 1e-5
        for param in net.parameters():
            param.add_(0.05 * torch.randn_like(param))
        entries, _ = trxl.anchor_memory(net, win, rb.lead, "stored", 0, M_TEST)
        rows = slice(rb.lead - M_TEST, rb.lead)
        torch.testing.assert_close(
            entries[0], net.encode(win["obs"][rows], win["prev_action"][rows], win["prev_reward"][rows])
        )
        torch.testing.assert_close(entries[1], win["layer_inputs"][rows, :, 0])


def test_episode_mode_recomputes_from_the_episode_start_in_segments():
    """--memory episode: every window reaches back to its episode's first row (lead_rows), and the prefix, run as a
    burn-in in segments of M rows, gives the Q of one pass over the whole episode: exact, with any weights."""
    rb, net = fill_replay("episode")
    assert rb.lead is None
    ids = np.nonzero(rb.valid())[0]
    ids = ids[np.argsort(rb.seq_ep_start[ids] - rb.seq_anchor[ids])[:100]]  # the longest prefixes
    lead = int(rb.lead_rows(ids).max())
    assert lead == (rb.seq_anchor[ids] - rb.seq_ep_start[ids]).max() > M_TEST  # two segments or more
    win = trxl.to_torch(rb.gather(ids), "cpu")
    args = trxl.Args(memory="episode", memory_length=M_TEST)
    with torch.no_grad():
        for param in net.parameters():
            param.add_(0.05 * torch.randn_like(param))
        q = trxl.replay_q(net, win, lead, args)
        x = net.encode(win["obs"], win["prev_action"], win["prev_reward"])
        q_one_pass, _ = net(x, trxl.no_memory(net, len(ids), "cpu"), win["key_valid"])
    torch.testing.assert_close(q, q_one_pass[lead:], rtol=0, atol=1e-5)


def double(win: dict) -> dict:
    return {key: value.double() if value.is_floating_point() else value for key, value in win.items()}


def test_exact_mode_equals_the_episode_re_encode_float64():
    """--memory exact: an empty memory L x M rows before t0 (or at the episode start, where that is closer) and a
    burn-in of those rows give, by the band (Q at a row depends on its last L x M rows only), the Q of --memory
    episode's re-encode from the episode start, on every replayed row, also where t0 lies more than L x M rows after
    the episode start; one row of burn-in less does not."""
    M, L = 3, 2
    rb, net = fill_replay("exact", memory_length=M)
    assert rb.lead == L * M and rb.layer_inputs.shape[2] == 0  # nothing stored
    net.double()
    with torch.no_grad():
        for param in net.parameters():  # away from the near-identity gates of the initialization
            param.normal_(0.0, 0.3)
    ids = np.nonzero(rb.valid())[0]
    prefix = rb.seq_anchor[ids] - rb.seq_ep_start[ids]  # rows from the episode start to t0
    assert (prefix > L * M).sum() > 5 and (prefix < L * M).sum() > 5
    np.testing.assert_array_equal(rb.lead_rows(ids), np.minimum(prefix, L * M))  # never before the episode start
    lead, full_lead = int(rb.lead_rows(ids).max()), int(prefix.max())
    win, full = double(trxl.to_torch(rb.gather(ids), "cpu")), double(trxl.to_torch(rb.gather(ids, full_lead), "cpu"))
    with torch.no_grad():
        q_exact = trxl.replay_q(net, win, lead, trxl.Args(memory="exact", memory_length=M, num_layers=L))
        q_episode = trxl.replay_q(net, full, full_lead, trxl.Args(memory="episode", memory_length=M))
        q_short = trxl.memory_q(net, win, lead, "zero", lead - 1, M)  # a burn-in of L x M - 1 rows
    assert q_exact.shape == (SEQ_LEN_TEST + N_TEST, len(ids), 2)
    torch.testing.assert_close(q_exact, q_episode, rtol=0, atol=1e-10)
    far = torch.tensor(prefix >= L * M)
    assert (q_short[0, far] - q_episode[0, far]).abs().amax(-1).min() > 1e-6  # the band is tight
    torch.testing.assert_close(q_short[:, ~far], q_episode[:, ~far], rtol=0, atol=1e-10)


@pytest.mark.parametrize("memory", list(trxl.MEMORY_MODES))
def test_replay_checkpoint_round_trips_without_pickles(tmp_path, memory):
    """The replay's state_dict is plain arrays and numbers in every mode (the episode mode's unbounded lead is not
    saved): through save_train_state and read_train_state (safetensors and JSON) it restores every array."""
    rb, _ = fill_replay(memory, num_vector_steps=30)
    trxl.save_train_state(tmp_path, {"rb": rb.state_dict()})
    fresh, _ = fill_replay(memory, num_vector_steps=0)
    fresh.load_state_dict(trxl.read_train_state(tmp_path)["rb"])
    for key, value in rb.state_dict().items():
        np.testing.assert_array_equal(getattr(fresh, key), value)
    assert fresh.lead == rb.lead


@pytest.mark.parametrize("memory", ["zero", "window", "episode", "exact"])
def test_modes_without_a_stored_memory_store_no_layer_inputs_and_replay_bytes_by_hand(memory):
    rb, _ = fill_replay(memory, num_vector_steps=50)
    assert rb.layer_inputs.shape == (4000, 4, 0, 16)
    sizes = trxl.replay_bytes_memory(rb, M_TEST)
    per_row = 3 * 4 + 8 + 4 + 8 + 4 + 3 * 1 + 4  # obs, action, reward, prev action, prev reward, flags, ep_step
    assert sizes["bytes_per_row"] == per_row and sizes["bytes"] == 50 * 4 * per_row
    assert trxl.final_delta_q_memory(None, rb, np.random.default_rng(0), 10, "cpu", BURN_IN_TEST, M_TEST) == {}
    rb, _ = fill_replay("stored", num_vector_steps=50)
    sizes = trxl.replay_bytes_memory(rb, M_TEST)
    assert sizes["bytes_per_row"] == per_row + 2 * 16 * 4  # + L x D float32 layer inputs
    assert sizes["memory_bytes_per_sequence"] == M_TEST * 2 * 16 * 4


def test_an_episode_longer_than_the_replay_is_an_error_in_episode_mode():
    """--memory episode needs a whole episode in the ring: once one has more rows than the replay holds per env, its
    later sequences could never be replayed; check_episode_fits stops the run then with a one-line error (the other
    modes need at most a bounded lead and go on)."""
    for lead, fails in ((None, True), (4, False)):
        rb = trxl.MemoryReplay(20, 2, 3, 0, 16, SEQ_LEN_TEST, 1, lead, N_TEST)
        row = {"obs": np.zeros((2, 3)), "action": np.zeros(2, int), "reward": np.zeros(2), "final": np.zeros(2, bool)}
        row |= {"prev_action": np.zeros(2, int), "prev_reward": np.zeros(2), "terminal": np.zeros(2, bool)}
        for t in range(21):  # one episode per env, never ending
            trxl.check_episode_fits(rb)  # 20 rows fit
            rb.add(**row, first=np.full(2, t == 0), layer_inputs=np.zeros((2, 2, 16)))
        if fails:
            with pytest.raises(SystemExit, match="^error: --memory episode .* 21 rows"):
                trxl.check_episode_fits(rb)
        else:
            trxl.check_episode_fits(rb)


# ---------------------------------------------------------------- subprocess runs
TINY = [
    "--total-timesteps",
    "2400",
    "--learning-starts",
    "800",
    "--num-envs",
    "4",
    "--buffer-size",
    "2000",
    "--batch-size",
    "8",
    "--eval-episodes",
    "4",
    "--env-kwargs",
    '{"corridor_length": 3}',
    "--d-model",
    "16",
    "--memory-length",
    "6",
    "--window",
    "15",
]


# the smoke runs: half of TINY's steps (50 updates); the Delta-Q checks at learning rate 0 need TINY's 2400 steps (the
# wandering episodes that start sequences mid-episode: at 1200 steps the empty memory's Delta-Q stayed under 1e-3)
SMOKE = ["--total-timesteps", "1200", "--learning-starts", "400", *TINY[4:]]


@pytest.mark.parametrize("memory", ["stored", "zero", "window", "episode", "exact"])
def test_smoke_run_and_eval_only_round_trip(runs_dir, memory):
    # the stored mode (the default) as commands; the other modes in-process (the same main, no interpreter start)
    run = functools.partial(run_script, "r2d2_trxl_memory", runs_dir=runs_dir, timeout=120)
    if memory != "stored":
        run = functools.partial(run_in_process, trxl, runs_dir)
    summary = run(*SMOKE, "--memory", memory)
    metrics = summary["metrics"]
    for key in ("eval/episodic_return", "eval/success_rate", "replay/bytes", "perf/learner_ms_per_update"):
        assert np.isfinite(metrics[key]), key
    assert ("model/final_delta_q_last_stored" in metrics) == (memory == "stored")
    per_row = metrics["replay/bytes_per_row"]
    assert per_row == 3 * 4 + 8 + 4 + 8 + 4 + 3 + 4 + (2 * 16 * 4 if memory == "stored" else 0)  # only (c) stores
    again = run("--eval-only", "--checkpoint", summary["run_dir"], "--eval-episodes", "4")
    assert again["args"]["memory"] == memory and again["args"]["d_model"] == 16  # from the checkpoint
    assert again["metrics"]["eval/episodic_return"] == pytest.approx(metrics["eval/episodic_return"])


@pytest.mark.parametrize("env_id", spaces_env.MODULE_IDS)
def test_structured_observation_spaces_are_flattened(runs_dir, env_id):
    env = trxl.make_flat_env(env_id, {})
    raw = gym.make(env_id)
    obs, _ = env.reset(seed=0)
    raw_obs, _ = raw.reset(seed=0)
    assert obs.dtype == np.float32
    np.testing.assert_array_equal(obs, spaces_env.expected_flat(raw_obs))
    tiny = [
        "--total-timesteps",
        "600",
        "--learning-starts",
        "200",
        "--num-envs",
        "2",
        "--buffer-size",
        "1200",
        "--batch-size",
        "4",
        "--eval-episodes",
        "2",
        "--seq-len",
        "4",
        "--seq-overlap",
        "2",
        "--burn-in",
        "2",
        "--memory-length",
        "4",
        "--d-model",
        "16",
        "--env-kwargs",
        "{}",
    ]
    summary = run_in_process(trxl, runs_dir, "--env-id", env_id, *tiny)
    assert 0.0 <= summary["metrics"]["eval/episodic_return"] <= spaces_env.EPISODE_LENGTH


@pytest.mark.parametrize("store_layer0", ["--store-layer0", "--no-store-layer0"])
def test_learning_rate_zero_stored_memory_is_exact_in_the_main_loop(runs_dir, store_layer0):
    """With a learning rate of 0 the network never changes: the stored memory is exact (Delta-Q 0), with layer 0
    stored or recomputed; the empty one is not (TMaze episodes are longer than a sequence when the agent wanders)."""
    args = (*TINY, "--learning-rate", "0", store_layer0)
    summary = run_in_process(trxl, runs_dir, *args)
    metrics = summary["metrics"]
    layers = 2 if store_layer0 == "--store-layer0" else 1  # of the 2 layers, d_model 16 floats each
    assert metrics["replay/memory_bytes_per_sequence"] == 6 * layers * 16 * 4  # M = 6
    assert metrics["model/final_delta_q_last_stored"] < 1e-5
    assert metrics["model/final_delta_q_last_stored_burn_in"] < 1e-5
    assert metrics["model/final_delta_q_last_zero"] > 1e-3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env-id", "Pendulum-v1", "--env-kwargs", "{}"], "only Discrete action spaces"),
        (["--env-id", "seqrl/NoSuchEnv-v0"], "cannot make env"),
        (["--memory-length", "0"], "--memory-length must be at least 1"),
        (["--window", "0", "--memory", "window"], "--window must be at least 1"),
        (["--burn-in", "40", "--memory-length", "32"], "longer than the memory"),
        (["--burn-in", "-1"], "--burn-in must be at least 0"),
        (["--d-model", "30", "--num-heads", "4"], "multiple of --num-heads"),
        (["--buffer-size", "1000"], "buffer-size"),
        (["--memory", "window", "--window", "8"], "more than --window 8"),
        (["--seq-len", "4", "--seq-overlap", "4"], "seq-overlap"),
        (["--env-kwargs", "[1]"], "must be a JSON object"),
        (["--eval-only"], "needs --checkpoint"),
        (["--memory", "window", "--burn-in", "2"], "--burn-in does not apply to --memory window"),
        (["--memory", "episode", "--burn-in", "0"], "--burn-in does not apply to --memory episode"),
        (["--memory", "exact", "--burn-in", "8"], "--burn-in does not apply to --memory exact"),
        (["--memory", "zero", "--no-store-layer0"], "--no-store-layer0 applies to --memory stored"),
        (
            ["--memory", "episode", "--env-id", "CartPole-v1", "--env-kwargs", "{}", "--buffer-size", "1000"],
            "CartPole-v1 episodes have up to 501 rows",
        ),
    ],
)
def test_clear_errors(runs_dir, monkeypatch, args, message):
    """In-process: what main does before any work (parse_args, then the env check that opens start_run) stops with
    SystemExit("error: ..."), which Python prints as that one line on stderr, exit 1 (end to end in the next test)."""
    monkeypatch.setattr(sys, "argv", ["r2d2_trxl_memory.py", "--runs-dir", str(runs_dir), *args])
    with pytest.raises(SystemExit) as exc:
        parsed = trxl.parse_args()
        trxl.check_env(parsed.env_id, parsed.env_kwargs)
    error = str(exc.value.code)
    assert error.startswith("error: ") and message in error and "\n" not in error, error
    assert not runs_dir.exists()  # before any run dir


def test_clear_error_in_a_subprocess(runs_dir):
    proc = run_script(
        "r2d2_trxl_memory",
        "--env-id",
        "Pendulum-v1",
        "--env-kwargs",
        "{}",
        runs_dir=runs_dir,
        expect_fail=True,
        timeout=60,
    )
    assert proc.stderr.startswith("error: Pendulum-v1 has action space Box") and "Traceback" not in proc.stderr
    assert not runs_dir.exists()
