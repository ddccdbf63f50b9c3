"""What the Lightning adapter reads of the output a loss is fed: the class axis (last, or
a sequence's second) and the losses of each way of taking the output, against torch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stethoscope.callbacks._lightning.predictions import _classes_second, probability_rows


def _read(output, labels):
    values, width = probability_rows(output, labels)
    return values.tolist(), width


def test_classes_on_the_second_axis_of_a_sequences_scores_are_read_as_such():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7)  # (N, C, T) as cross_entropy takes it
    labels = torch.randint(0, 5, (4, 7))
    assert _classes_second(logits, labels)
    probs = logits.softmax(dim=1)
    (flag, as_logits, _, as_probs, _, *_), width = _read(probs, labels)
    assert width == 5 and flag == 1.0  # every (n, t) column sums to 1 over the classes
    assert as_logits == pytest.approx(F.cross_entropy(probs, labels).item(), rel=1e-5)
    assert as_probs == pytest.approx(F.nll_loss(probs.log(), labels).item(), rel=1e-5)
    (_, as_logits, _, _, as_softmax, *_), _ = _read(logits, labels)
    assert as_logits == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert as_softmax == pytest.approx(F.cross_entropy(probs, labels).item(), rel=1e-5)


@pytest.mark.parametrize(
    ("shape", "labels", "second"),
    [
        ((4, 7, 5), (4, 7), False),  # (N, T, C): a transformer's, classes last
        ((4, 5, 5), (4, 5), False),  # either axis fits: the last, as before
        ((4, 5, 7, 3), (4, 7, 3), True),  # (N, C, H, W): segmentation
        ((4, 5), (4,), False),  # two dimensions: the last
    ],
)
def test_the_class_axis_is_the_second_only_where_the_labels_lack_it_and_not_the_last(
    shape, labels, second
):
    assert _classes_second(torch.zeros(shape), torch.zeros(labels, dtype=torch.long)) is second
    # float targets (probabilities, a regression's) name no class axis
    assert not _classes_second(torch.zeros(shape), torch.zeros(labels))
    assert not _classes_second(torch.zeros(shape), None)


def test_label_smoothings_uniform_term_is_the_mean_of_the_log_probabilities():
    torch.manual_seed(1)
    logits, labels = torch.randn(6, 4), torch.randint(0, 4, (6,))
    values, _ = _read(logits, labels)
    smoothed = F.cross_entropy(logits, labels, label_smoothing=0.2).item()
    assert 0.8 * values[1] + 0.2 * values[5] == pytest.approx(smoothed, rel=1e-5)


@pytest.mark.parametrize(("out_shape", "y_shape"), [((8, 3), (8, 3)), ((8, 1), (8,)), ((8,), (8,))])
def test_a_binary_or_multi_label_outputs_three_losses_are_torchs(out_shape, y_shape):
    torch.manual_seed(2)
    logits = torch.randn(out_shape)
    y = torch.randint(0, 2, y_shape).float()
    flat = y.reshape(logits.shape)
    values, _ = _read(logits, y)
    unit, as_logits, _, as_sigmoid = values[8:12]
    assert unit == 0.0
    assert as_logits == pytest.approx(F.binary_cross_entropy_with_logits(logits, flat).item())
    sig = torch.sigmoid(logits)
    assert as_sigmoid == pytest.approx(F.binary_cross_entropy_with_logits(sig, flat).item())
    values, _ = _read(sig, y)
    assert values[8] == 1.0  # a sigmoid's output
    assert values[10] == pytest.approx(F.binary_cross_entropy(sig, flat).item(), rel=1e-5)


def test_targets_of_another_shape_or_outside_0_and_1_give_no_binary_loss():
    logits = torch.randn(8, 3)
    assert all(v != v for v in _read(logits, torch.randint(0, 3, (8,)))[0][8:12])  # classes
    values, _ = _read(logits, torch.full((8, 3), 2.0))  # a regression's targets
    assert values[8] == 0.0 and all(v != v for v in values[9:12])


@pytest.mark.parametrize("soft", [False, True])
def test_class_probability_targets_give_the_class_losses_of_torchs_cross_entropy(soft):
    """One-hot or soft targets, one distribution per row (``cross_entropy``'s class
    probabilities), read as the labels are: each way of taking the output is torch's own
    loss against them."""
    torch.manual_seed(3)
    logits = torch.randn(6, 4)
    q = F.one_hot(torch.randint(0, 4, (6,)), 4).float()
    if soft:
        q = 0.9 * q + 0.1 / 4  # targets smoothed by hand
    values, _ = _read(logits, q)
    assert values[1] == pytest.approx(F.cross_entropy(logits, q).item(), rel=1e-5)
    probs = logits.softmax(dim=1)
    assert values[4] == pytest.approx(F.cross_entropy(probs, q).item(), rel=1e-5)
    values, _ = _read(probs, q)
    assert values[3] == pytest.approx(-(q * probs.log()).sum(1).mean().item(), rel=1e-5)
    assert values[12] == 6.0  # a term per row


def test_float_targets_that_are_not_distributions_give_no_class_loss():
    logits = torch.randn(6, 4)
    multi_hot = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 6)  # a multi-label's: the binary ways
    values, _ = _read(logits, multi_hot)
    assert all(v != v for v in values[1:8]) and values[9] == values[9]
    assert values[12] == 24.0  # a binary loss's terms: the elements


def test_on_the_host_only_the_ways_of_the_outputs_kind_are_computed():
    """On the CPU the host knows at no cost whether the rows are probabilities, and
    computes only the ways the rule reads for them (a language model's vocabulary makes
    the others most of a sampled step); on a device, which the host must not wait for,
    every way, with no read of the device."""
    from _accelerator import SimulatedAccelerator

    torch.manual_seed(4)
    logits, labels = torch.randn(8, 5), torch.randint(0, 5, (8,))
    probs = logits.softmax(dim=1)
    of_logits, _ = _read(logits, labels)
    of_probs, _ = _read(probs, labels)
    assert of_logits[3] != of_logits[3] and of_logits[4] == of_logits[4]  # no log of logits
    assert of_probs[4] != of_probs[4] and of_probs[3] == of_probs[3]  # no softmax of probs
    with SimulatedAccelerator(lag=0) as sim:
        on_device, _ = _read(logits, labels)
        assert sim.syncs == []
    assert on_device[3] == on_device[3] and on_device[4] == pytest.approx(of_logits[4])
