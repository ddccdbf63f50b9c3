"""What this rank holds of each parameter when a strategy shards them, and how the ranks
combine what each measured of its own part.

FSDP2 (Lightning's ``ModelParallelStrategy``, ``fully_shard``) holds each parameter and
gradient as a ``DTensor``: every rank stores one shard (``Shard``) or a copy
(``Replicate``) along each dimension of a device mesh. A reduction of the DTensor itself
would be a collective per tensor, with a placement to resolve; instead each rank reduces
the plain tensor it holds (:func:`local_part`) and the ranks combine the numbers of a
sampled step in one or two all-reduces (:class:`ShardCombiner`): sums of squares for the
norms, sums for the counts, maxima for the peaks. A part held alike by several ranks (a
``Replicate`` placement) is counted once: by the rank at coordinate 0 along each of those
mesh dimensions; the others reduce an empty view of it.

FSDP1 (``FullyShardedDataParallel`` with ``use_orig_params=True``) shows each parameter
as a 1-D view of the elements this rank holds of it (:class:`FlatSlice`), reduced and
combined the same way.

Nothing here runs for a model whose parameters are plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

try:  # a build without torch.distributed has no DTensor: then nothing is sharded
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - depends on the torch build
    DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]

try:  # where a shard's rows start in the whole tensor (private in torch 2.13)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - depends on the torch version
    compute_local_shape_and_global_offset = None

__all__ = [
    "COMBINES",
    "DTensor",
    "FlatSlice",
    "ShardCombiner",
    "flat_replicas",
    "flat_row_norms",
    "flat_slices",
    "is_sharded",
    "local_part",
    "replicated",
    "row_span",
    "scatter_rows",
    "summed_over_groups",
    "unwrapped_name",
    "whole_checksums",
]

#: How the ranks combine a part of a step's reading: ``"norm"`` (an L2 norm: the root of
#: the sum of the squares), ``"sum"`` (counts) or ``"max"`` (a peak).
COMBINES = ("norm", "sum", "max")


@dataclass(frozen=True)
class FlatSlice:
    """How this rank holds a parameter under FSDP1 (``FullyShardedDataParallel`` with
    ``use_orig_params=True``): the parameter it sees is a 1-D view of its elements
    ``start`` to ``start + count`` of the whole parameter flattened, whose shape is
    ``shape``. ``count`` 0: this rank counts none of it (it holds none, and no gradient;
    or, under a hybrid strategy, another replica counts what it holds).

    DeepSpeed's ZeRO holds its slices elsewhere: see ``zero``'s subclasses, which read
    them where it keeps them."""

    shape: torch.Size
    start: int
    count: int

    #: Whether :meth:`whole_grad` can gather the whole gradient (FSDP1 cannot).
    gathers_whole: ClassVar[bool] = False

    def data(self, param: torch.Tensor) -> torch.Tensor:
        """The elements of ``param`` this rank counts, as a 1-D tensor (detached)."""
        return param.detach() if self.count else param.detach().reshape(-1)[:0]

    def grad(self, param: torch.Tensor) -> torch.Tensor:
        """The gradient of the elements this rank counts (detached; empty where it counts
        none: FSDP1 then leaves no gradient, or another replica counts it)."""
        g = param.grad
        return g.detach() if g is not None and self.count else param.detach().reshape(-1)[:0]

    def whole_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The whole gradient, gathered from every rank: a collective every rank must
        make, a check's reference (only where :attr:`gathers_whole`)."""
        raise NotImplementedError("FSDP1 has no gather of one parameter's gradient")


def flat_slices(module: torch.nn.Module) -> dict[int, FlatSlice]:
    """The :class:`FlatSlice` of each parameter of ``module`` that FSDP1 shards, by the
    parameter's ``id``: those of every ``FullyShardedDataParallel`` inside it with
    ``use_orig_params=True`` and a sharding strategy that holds each element on one rank
    (``FULL_SHARD``, ``SHARD_GRAD_OP``) or on one rank of each replica (``HYBRID_SHARD``,
    ``_HYBRID_SHARD_ZERO2``: the first replica's ranks count it, the others none). Empty
    for any other model. Read from FSDP's flat parameter (private in torch 2.13:
    ``_params``, ``_shapes``, ``_shard_param_infos``; the module's ``_inter_node_pg``)."""
    out: dict[int, FlatSlice] = {}
    for m, flat, hybrid in _flat_parameters(module):
        # under a hybrid strategy the replicas hold the same: the first counts it
        elsewhere = hybrid and torch.distributed.get_rank(m._inter_node_pg) != 0
        for p, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos, strict=True):
            held = info.numel_in_shard if info.in_shard and not elsewhere else 0
            start = info.intra_param_start_idx if held else 0
            out[id(p)] = FlatSlice(torch.Size(shape), int(start), int(held))
    return out


#: The name FSDP1 gives the module it wraps, in its parameters' and modules' names.
_FSDP1_WRAPPED = "_fsdp_wrapped_module"


def unwrapped_name(name: str) -> str:
    """``name`` as the model names it, without FSDP1's wrappers in it."""
    return ".".join(part for part in name.split(".") if part != _FSDP1_WRAPPED)


#: FSDP1's sharding strategies whose slices are mapped: each element held by one rank
#: (of each replica, under the hybrid ones).
_MAPPED = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _flat_parameters(module: torch.nn.Module) -> list[tuple[torch.nn.Module, Any, bool]]:
    """``(FullyShardedDataParallel, its flat parameter, hybrid)`` of each FSDP1 module
    inside ``module`` with ``use_orig_params=True`` and a mapped strategy; ``hybrid``:
    it shards within a group of ranks and replicates across such groups
    (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``). Private in torch 2.13: ``_handle``,
    ``_sharding_strategy``, ``flat_param._params``."""
    out = []
    for m in module.modules():
        handle = getattr(m, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        strategy = getattr(getattr(handle, "_sharding_strategy", None), "name", None)
        if getattr(flat, "_params", None) and strategy in _MAPPED:
            out.append((m, flat, "HYBRID" in strategy))
    return out


def flat_replicas(module: torch.nn.Module) -> dict[int, Any]:
    """Under FSDP1's hybrid strategies, the process group each parameter is sharded over
    (the ranks of one replica), by the parameter's ``id``: what the replicas compare,
    summed over that group. Empty for any other model."""
    return {
        id(p): m.process_group
        for m, flat, hybrid in _flat_parameters(module)
        if hybrid
        for p in flat._params
    }


def flat_row_norms(local: torch.Tensor, flat: FlatSlice) -> torch.Tensor:
    """The L2 norm of each row (dim 0) of the whole parameter, of the elements of it that
    ``local`` (this rank's 1-D slice, maybe empty) holds; zeros elsewhere: the ranks'
    norms combine as norms do."""
    rows = flat.shape[0]
    out = torch.zeros(rows, device=local.device)
    if local.numel() == 0:
        return out
    row_len = max(flat.shape.numel() // max(rows, 1), 1)
    index = torch.arange(flat.start, flat.start + flat.count, device=local.device) // row_len
    return out.index_add_(0, index, local.detach().float().square()).sqrt_()


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor, whose value is spread over several ranks."""
    return DTensor is not None and isinstance(tensor, DTensor)


def _counted_here(tensor: Any) -> bool:
    """Whether this rank counts its local part of ``tensor``: always, but along a mesh
    dimension whose placement is ``Replicate`` (every rank there holds the same), only
    the rank at coordinate 0 does."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: holds nothing
        return False
    return all(
        c == 0 for c, p in zip(coordinate, tensor.placements, strict=True) if p.is_replicate()
    )


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor this rank reduces of ``tensor``: itself, unless it is a DTensor:
    then its local shard, or an empty view of it where another rank counts the same
    (see :func:`_counted_here`)."""
    if not is_sharded(tensor):
        return tensor
    local = tensor.to_local()
    return local if _counted_here(tensor) else local.reshape(-1)[:0]


def row_span(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """For a DTensor: ``(rows of the whole tensor, first row held here, rows held here)``
    along dimension 0, with ``0`` rows where another rank counts the same; None for a
    plain tensor (it holds every row), or where torch cannot say."""
    if not is_sharded(tensor):
        return None
    rows = tensor.shape[0]
    if not _counted_here(tensor):
        return rows, 0, 0
    if compute_local_shape_and_global_offset is None:  # pragma: no cover - torch version
        return None
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return rows, offset[0], shape[0]


def scatter_rows(local_rows: torch.Tensor, span: tuple[int, int, int]) -> torch.Tensor:
    """``local_rows``, the values of the rows held here, placed at their rows of the
    whole tensor; zeros elsewhere (summed over the ranks, each row is counted once)."""
    rows, first, held = span
    out = local_rows.new_zeros(rows)
    if held:
        out[first : first + held] = local_rows
    return out


def replicated(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor held alike by several ranks along some mesh
    dimension (a ``Replicate`` placement: HSDP's replicas, a tensor-parallel norm)."""
    return is_sharded(tensor) and any(p.is_replicate() for p in tensor.placements)


def summed_over_groups(groups: Sequence[Any], sums: torch.Tensor) -> torch.Tensor:
    """``sums``, each summed over its process group in ``groups`` (FSDP1's shard group of
    each parameter, see :func:`flat_replicas`): every rank of a replica then holds its
    whole parameters' checksums. One all-reduce per group."""
    out = sums.clone()
    by_group: dict[int, tuple[Any, list[int]]] = {}
    for i, group in enumerate(groups):
        by_group.setdefault(id(group), (group, []))[1].append(i)
    for group, indices in by_group.values():
        part = out[indices]
        torch.distributed.all_reduce(part, group=group)
        out[indices] = part
    return out


def whole_checksums(tensors: Sequence[Any], sums: torch.Tensor) -> torch.Tensor:
    """Each tensor's checksum over all of its shards, from ``sums``, the checksums of the
    parts this rank holds (the int64 sums of their bit patterns, see ``checksums``): a
    sum of bit patterns adds up over the shards, so an all-reduce over the mesh
    dimensions a tensor is sharded along gives every rank of a replica the checksum of
    its whole tensor, which every replica then compares. One all-reduce per group of
    tensors sharded alike; a collective every rank makes at the same meeting."""
    out = sums.clone()
    by_groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        dims = tuple(d for d, p in enumerate(t.placements) if p.is_shard())
        by_groups.setdefault((id(t.device_mesh), dims), []).append(i)
    for (_, dims), indices in by_groups.items():
        if not dims:
            continue
        mesh = tensors[indices[0]].device_mesh
        part = out[indices]
        for d in dims:
            torch.distributed.all_reduce(part, group=mesh.get_group(d))
        out[indices] = part
    return out


class ShardCombiner:
    """Combines the parts of a step's reading that every rank measured of its own shards.

    Every rank must combine the same parts, in the same order, at the same steps (the
    ranks plan those statistics alike: see ``Monitor.distribute(sharded=True)``).

    Args:
        all_reduce: ``(tensor, op)`` reduces ``tensor`` in place over every rank, ``op``
            ``"sum"`` or ``"max"`` (``torch.distributed.all_reduce`` in a run).
    """

    def __init__(self, all_reduce: Callable[[torch.Tensor, str], None]) -> None:
        self.all_reduce = all_reduce

    @classmethod
    def of_process_group(cls) -> ShardCombiner:
        """The combiner over the default process group: one asynchronous all-reduce on
        the device per combine (NCCL enqueues it; the host does not wait)."""
        ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}
        return cls(lambda tensor, op: torch.distributed.all_reduce(tensor, ops[op]))

    def combine(
        self, parts: Sequence[torch.Tensor], kinds: Sequence[str | None]
    ) -> list[torch.Tensor]:
        """``parts`` with every one whose kind is not None combined over the ranks: at
        most two collectives (the sums, squares of the norms included, then the
        maxima), whatever the number of parts."""
        out = list(parts)
        for op, wanted in (("sum", ("norm", "sum")), ("max", ("max",))):
            chosen = [i for i, k in enumerate(kinds) if k in wanted]
            if not chosen:
                continue
            # in float64: the square of a large float32 norm would overflow
            flat = torch.cat(
                [
                    out[i].double().square() if kinds[i] == "norm" else out[i].double()
                    for i in chosen
                ]
            )
            self.all_reduce(flat, op)
            for i, value in zip(chosen, flat.split([out[i].numel() for i in chosen]), strict=True):
                out[i] = (value.sqrt() if kinds[i] == "norm" else value).float()
        return out
