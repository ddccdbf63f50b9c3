"""The pieces of sharded statistics, each on its own: what a rank reduces of a DTensor,
where its rows go, how the ranks' parts combine, and the self-check of the combined norms.
The ranks' all-reduce is stood in for by a function that adds (or takes the maximum of)
another rank's numbers; the two-rank runs are in ``test_lightning_fsdp.py``."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stethoscope.callbacks._lightning import shards
from stethoscope.callbacks._lightning.measures import StepMeasures
from stethoscope.callbacks._lightning.parameters import ParameterProbe, row_norms
from stethoscope.callbacks._lightning.reductions import StaleGrads, check_combined
from stethoscope.callbacks._lightning.shards import (
    FlatSlice,
    ShardCombiner,
    flat_row_norms,
    local_part,
    scatter_rows,
)

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def two_ranks(other: list[torch.Tensor]) -> tuple[ShardCombiner, list[str]]:
    """A combiner whose all-reduce adds in (or takes the maximum with) the next of
    ``other``: the other rank's part of each collective. Also the ops it was asked for."""
    calls: list[str] = []

    def all_reduce(tensor: torch.Tensor, op: str) -> None:
        theirs = other[len(calls)].to(tensor.dtype)
        calls.append(op)
        if op == "sum":
            tensor.add_(theirs)
        else:
            torch.maximum(tensor, theirs, out=tensor)

    return ShardCombiner(all_reduce), calls


def test_norms_counts_and_peaks_combine_in_at_most_two_collectives():
    mine = [torch.tensor([3.0, 0.0]), torch.tensor([1.0, 2.0]), torch.tensor([5.0]), torch.ones(1)]
    # the other rank's parts, as the collectives see them: squares and counts, then peaks
    theirs_sum = torch.tensor([16.0, 4.0, 10.0, 20.0], dtype=torch.float64)  # 4², 2², counts
    theirs_max = torch.tensor([7.0], dtype=torch.float64)
    combiner, calls = two_ranks([theirs_sum, theirs_max])
    out = combiner.combine(mine, ["norm", "sum", "max", None])
    assert calls == ["sum", "max"]
    assert out[0].tolist() == [5.0, 2.0]  # sqrt(3² + 4²), sqrt(0 + 2²)
    assert out[1].tolist() == [11.0, 22.0]
    assert out[2].tolist() == [7.0]
    assert out[3] is mine[3]  # this rank's own: untouched
    assert all(t.dtype == torch.float32 for t in out)


def test_a_huge_norm_is_combined_without_overflow():
    combiner, _ = two_ranks([torch.tensor([0.0], dtype=torch.float64)])
    (out,) = combiner.combine([torch.tensor([3e30])], ["norm"])  # its square overflows float32
    assert out.item() == pytest.approx(3e30, rel=1e-6)


def test_measures_combine_only_the_parts_that_say_how():
    combiner, calls = two_ranks([torch.tensor([16.0], dtype=torch.float64)])  # 4²
    measures = StepMeasures(step=0, epoch=0, plan=frozenset({"grads"}), combiner=combiner)
    measures.add("grads", torch.tensor([3.0]), combine="norm")
    measures.add("loss", torch.tensor([2.5]))
    reading = measures.take()
    assert reading.values.tolist() == [5.0, 2.5]
    assert calls == ["sum"]
    with pytest.raises(ValueError, match="combine='mean' must be one of"):
        measures.add("grads", torch.zeros(1), combine="mean")


def test_each_row_lands_at_its_place_in_the_whole_tensor():
    assert scatter_rows(torch.tensor([1.0, 2.0]), (5, 3, 2)).tolist() == [0, 0, 0, 1, 2]
    assert scatter_rows(torch.zeros(0), (3, 0, 0)).tolist() == [0, 0, 0]


def test_a_part_held_alike_by_several_ranks_is_counted_by_one():
    def held(coordinate, placements):
        mesh = SimpleNamespace(get_coordinate=lambda: coordinate)
        return SimpleNamespace(device_mesh=mesh, placements=placements)

    shard, replicate = shards.Shard(0), shards.Replicate()
    assert shards._counted_here(held((1,), (shard,)))  # its own shard
    assert shards._counted_here(held((0, 1), (replicate, shard)))
    assert not shards._counted_here(held((1, 0), (replicate, shard)))  # rank 0 counts it
    assert not shards._counted_here(held(None, (shard,)))  # not in the mesh


@pytest.fixture
def process_group():
    """A one-rank gloo group, for real DTensors; taken down after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()


def test_a_dtensor_is_reduced_as_the_plain_tensor_this_rank_holds(process_group):
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), process_group, [Shard(0)]))
    weight.grad = distribute_tensor(torch.randn(6, 4), process_group, [Shard(0)])
    weight.grad.to_local()[2].zero_()
    assert type(local_part(weight)) is torch.Tensor
    probe = ParameterProbe([("w", weight)])
    assert probe.sharded and probe.numel.tolist() == [24.0]
    whole = weight.grad.full_tensor()
    assert torch.allclose(probe.grad_norms([0]), whole.norm().reshape(1))
    assert torch.allclose(probe.whole_grad_norms([0]), whole.norm().reshape(1))
    rows = row_norms([weight.grad])
    assert rows.shape == (6,) and rows[2] == 0 and (rows != 0).sum() == 5
    plain = torch.nn.Parameter(torch.randn(3))
    assert local_part(plain) is plain and not ParameterProbe([("p", plain)]).sharded


def test_the_self_check_warns_once_when_the_combined_norms_disagree():
    reference = np.array([1.0, 2.0, np.nan])
    assert check_combined(np.array([1.0, 2.0000001, np.nan]), reference)
    with pytest.warns(RuntimeWarning, match=r"parameter 1: 1\.5 against 2"):
        assert not check_combined(np.array([1.0, 1.5, np.nan]), reference)
    with pytest.warns(RuntimeWarning, match="disagree"):  # non-finite in other places
        assert not check_combined(np.array([1.0, 2.0, 3.0]), reference)


def test_an_fsdp1_slice_folds_into_the_rows_of_the_whole_parameter():
    # a (3, 4) weight of which this rank holds elements 2 to 7: half of row 0, all of row 1
    local = torch.arange(1.0, 7.0)  # 1..6 at flattened positions 2..7
    rows = flat_row_norms(local, FlatSlice(torch.Size((3, 4)), start=2, count=6))
    want = [torch.tensor([1.0, 2.0]).norm(), torch.tensor([3.0, 4.0, 5.0, 6.0]).norm(), 0.0]
    assert torch.allclose(rows, torch.tensor(want))


def test_a_parameter_fsdp1_left_this_rank_nothing_of_counts_alike_on_every_rank():
    held = torch.nn.Parameter(torch.ones(6))  # a slice of a (2, 3) weight, with a gradient
    held.grad = torch.full((6,), 2.0)
    empty = torch.nn.Parameter(torch.ones(0))  # no element here: FSDP1 gives no gradient
    flat = {
        id(held): FlatSlice(torch.Size((2, 3)), start=0, count=6),
        id(empty): FlatSlice(torch.Size((4, 5)), start=0, count=0),
    }
    probe = ParameterProbe([("a.weight", held), ("b.weight", empty)], flat=flat)
    assert probe.sharded and probe.numel.tolist() == [6.0, 20.0]
    assert probe.with_grad([0, 1]) == [0, 1]  # as on the rank that holds b
    assert probe.grad(1).numel() == 0
    assert probe.unit_rows([0, 1]).tolist() == pytest.approx([12**0.5, 12**0.5, 0, 0, 0, 0])
    # the stale gradients are read per parameter, one part per parameter on every rank
    measures = StepMeasures(step=0, epoch=0, plan=frozenset({"stale_grads"}))
    stale = StaleGrads(probe)
    stale.each_backward(measures, torch.zeros(()))
    stale.before_step(measures, [0, 1])
    assert measures.take().values.numel() == 2
