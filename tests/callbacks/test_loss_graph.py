"""The loss graph's broadcast, read on the host from the autograd nodes: an (N, 1)
prediction against an (N,) target, by hand or through mse_loss, against shapes that match,
pairwise ranking losses and classification losses."""

from __future__ import annotations

import warnings

import pytest
import torch

from stethoscope.callbacks._lightning.loss_graph import broadcast_in_loss
from stethoscope.detectors import BroadcastLoss
from stethoscope.observation import Observation

N = 6


@pytest.fixture
def pred() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)(torch.randn(N, 3))  # (N, 1)


TARGET = torch.randn(N)


@pytest.mark.parametrize(
    ("loss", "op"),
    [
        pytest.param(lambda p: ((p - TARGET) ** 2).mean(), "Sub", id="by-hand"),
        pytest.param(lambda p: (TARGET - p).abs().mean(), "Sub", id="target-first"),
        pytest.param(lambda p: torch.nn.functional.mse_loss(p, TARGET), "MseLoss", id="mse"),
        pytest.param(lambda p: torch.nn.functional.l1_loss(p, TARGET), "Sub", id="l1"),
    ],
)
def test_a_prediction_broadcast_against_its_target_is_named(pred, loss, op):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mse_loss warns of it itself
        said = broadcast_in_loss(loss(pred))
    assert said == f"a ({N}, 1) prediction against a target made a ({N}, {N}) tensor in {op}"


@pytest.mark.parametrize(
    "loss",
    [
        pytest.param(lambda p: ((p.squeeze(-1) - TARGET) ** 2).mean(), id="squeezed"),
        pytest.param(lambda p: torch.nn.functional.mse_loss(p, TARGET[:, None]), id="matched"),
        pytest.param(lambda p: torch.relu(1 - (p - p.T)).mean(), id="pairwise-ranking"),
        pytest.param(
            lambda p: torch.nn.functional.cross_entropy(
                torch.cat([p, -p], 1), torch.zeros(N, dtype=torch.long)
            ),
            id="cross-entropy",
        ),
    ],
)
def test_shapes_that_match_or_pair_on_purpose_are_no_broadcast(pred, loss):
    assert broadcast_in_loss(loss(pred)) == ""


def test_a_loss_with_no_graph_cannot_be_read():
    assert broadcast_in_loss(torch.tensor(1.0)) is None
    assert broadcast_in_loss(None) is None


def test_the_detector_names_it_once_it_held_on_sampled_steps_in_a_row(pred):
    said = broadcast_in_loss(((pred - TARGET) ** 2).mean())
    d = BroadcastLoss()
    found = []
    for step, seen in ((0, said), (16, ""), (32, said), (48, said), (64, said)):
        found += d.update(Observation(step=step, loss_broadcast=seen))
    (finding,) = found
    assert finding.step == 48 and said in finding.message and "squeeze" in finding.message
