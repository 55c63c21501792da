"""r2d2_rnnstate's burn-in: one packed nn.LSTM call over each sequence's last piece equals the step loop that zeroes
the state at every episode start (float64, starts at random places)."""

import pytest
import torch
from conftest import load_script

r2d2 = load_script("r2d2_rnnstate")


def step_loop(net, z, first, state):
    for t in range(z.shape[0]):
        keep = (~first[t]).double()[:, None]
        _, state = net.core(z[t : t + 1], (state[0] * keep, state[1] * keep))
    return state


@pytest.mark.parametrize("T", [0, 1, 7, 16])
def test_state_after_equals_the_step_loop(T):
    torch.manual_seed(0)
    net = r2d2.RecurrentQNetwork(obs_dim=3, num_actions=2, hidden_size=8).double()
    B = 6
    g = torch.Generator().manual_seed(T)
    z = torch.randn(T, B, 8, generator=g, dtype=torch.float64)
    first = torch.rand(T, B, generator=g) < 0.25
    if T:
        first[:, 0] = False  # a sequence without a start: the stored state carries through
        first[T - 1, 1] = True  # a start at the last row: a one-row piece from zeros
        first[0, 2] = True  # a start at row 0
    state = (torch.randn(B, 8, generator=g, dtype=torch.float64), torch.randn(B, 8, generator=g, dtype=torch.float64))
    with torch.no_grad():
        h, c = net.state_after(z, first, state)
        h_ref, c_ref = step_loop(net, z, first, state)
    assert torch.allclose(h, h_ref, atol=1e-12) and torch.allclose(c, c_ref, atol=1e-12)
