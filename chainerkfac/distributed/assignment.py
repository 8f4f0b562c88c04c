"""Placement of curvature blocks on ranks by a cost model.

In the model-parallel stages of distributed K-FAC (Osawa et al., CVPR 2019,
§3.3, Fig. 1 stages 4-5) each block's factors are reduced onto one rank, its
*owner*, which refreshes the inverses and preconditions the block's gradient
before the all-gather-v returns the result to everyone. The iteration waits
for the busiest owner, so blocks are balanced by their cost
(longest-processing-time first), not by their number: block costs span
orders of magnitude (the placement's figures: ``docs/measurements.md``).

Split blocks. With one owner per block the largest block is a floor. When
the assignment allows it (``shardable``), a Kronecker block's
preconditioning is split over several ranks by rows or columns of ``G⁻¹
∇W̄ A⁻¹`` (:meth:`BlockCost.shard_costs`): the owner still refreshes the
inverses and hands each other rank what its part needs; for inverses that
serve few steps, the ranks of the block compute the larger factor's
Cholesky factor together (:mod:`chainerkfac.distributed.cholesky`, from
:data:`~chainerkfac.curvature.cost.SHARED_FACTORIZATION_MIN_DIM` rows).
Blocks are split only until the load imbalance reaches ``max_imbalance``:
each split moves a copy of the block's gradient more in the reduce-scatter.

Everything here is a pure function of (blocks, costs, world size): every rank
computes the same :class:`Assignment` without communicating. Ranks beyond
the blocks' parts own nothing and idle through stages 4-5;
:attr:`Assignment.load_imbalance` counts them.
"""
import dataclasses
import heapq
import numbers

from chainerkfac.curvature.cost import BlockCost  # NOQA  (public here too)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Owner and ranks of every block and the resulting load of every rank.

    A block's *parts* are the pieces of its preconditioning; unsplit blocks
    have one. Part ``s`` of block ``i`` runs on rank ``shards[i][s]``, and
    ``shards[i][0] == owners[i]``; the parts of a block are on distinct
    ranks.

    Attributes:
        names (tuple of str): Block names, in the order given.
        owners (tuple of int): ``owners[i]`` is the only rank that refreshes
            the factors and inverses of block ``i``.
        shards (tuple of tuple of int): The ranks of each block's parts.
        weights (tuple of tuple of float): The fraction of the split side
            of ``G⁻¹ ∇W̄ A⁻¹`` each part computes (see
            :meth:`BlockCost.shard_costs`; the owner may get none).
        loads (tuple of float): Cost assigned to each rank, indexed by rank.
        work (float): The cost of all blocks on one owner each, unsplit:
            what :attr:`load_imbalance` divides among the ranks.
    """

    names: tuple
    owners: tuple
    shards: tuple
    weights: tuple
    loads: tuple
    work: float

    @property
    def world_size(self):
        """Number of ranks the blocks were assigned to."""
        return len(self.loads)

    @property
    def load_imbalance(self):
        """Maximum load over the ideal mean ``work / world_size`` (1.0 is
        perfect balance).

        Idle ranks count in the mean: the model-parallel stage takes as long
        as the busiest rank, whatever the others do. Work that splitting
        adds (the refresh at LAPACK's speed, an inverse formed explicitly
        where a Cholesky factor would do) counts against it.
        """
        if self.work == 0:
            return 1.0
        return max(self.loads) * self.world_size / self.work

    @property
    def idle_ranks(self):
        """Ranks that hold no part of any block (surplus ranks)."""
        busy = {rank for ranks in self.shards for rank in ranks}
        return tuple(r for r in range(self.world_size) if r not in busy)

    @property
    def split_blocks(self):
        """Indices of the blocks whose preconditioning has several parts."""
        return tuple(i for i, ranks in enumerate(self.shards)
                     if len(ranks) > 1)

    def blocks_of(self, rank):
        """Indices of the blocks owned by ``rank``, in the order given."""
        return tuple(i for i, owner in enumerate(self.owners) if owner == rank)

    def parts_of(self, rank):
        """``{block index: part index}`` of the parts ``rank`` computes."""
        return {i: ranks.index(rank) for i, ranks in enumerate(self.shards)
                if rank in ranks}

    def buffer_order(self):
        """The parts ``(block, part)`` grouped by rank, in rank order (in
        block order within a rank): the layout of a reduce-scatter-v send
        buffer and of an all-gather-v result."""
        return tuple(sorted(
            ((i, s) for i, ranks in enumerate(self.shards)
             for s in range(len(ranks))),
            key=lambda item: (self.shards[item[0]][item[1]], item[0])))

    def segment_counts(self, sizes):
        """Per-rank segment sizes for the ``v`` collectives, when part
        ``(i, s)`` contributes ``sizes[i, s]`` elements (laid out by
        :meth:`buffer_order`)."""
        items = self.buffer_order()
        missing = [item for item in items if item not in sizes]
        if missing or len(sizes) != len(items):
            raise ValueError('expected a size for each of the {} parts '
                             '(block, part), got {} (missing {})'.format(
                                 len(items), len(sizes), missing[:3]))
        counts = [0] * self.world_size
        for i, s in items:
            counts[self.shards[i][s]] += int(sizes[i, s])
        return counts

    def part_bounds(self, block, length):
        """``[(start, stop), ...]``: the contiguous range of a side of
        ``length`` rows or columns that each part of ``block`` computes,
        in part order, sized by :attr:`weights` (rounded; possibly
        empty)."""
        bounds, start, total = [], 0, 0.0
        for weight in self.weights[block]:
            total += weight
            stop = min(int(length), int(round(total * length)))
            bounds.append((start, stop))
            start = stop
        bounds[-1] = (bounds[-1][0], int(length))
        return bounds


def _check(blocks, world_size):
    blocks = list(blocks)
    if int(world_size) != world_size or world_size < 1:
        raise ValueError('world_size must be a positive integer, got '
                         '{!r}'.format(world_size))
    names = [b.name for b in blocks]
    if len(set(names)) != len(names):
        raise ValueError('block names must be unique')
    return blocks, int(world_size)


#: Parts costing less than this fraction of the ideal mean load are not
#: split further: LPT packs them to within a small excess of the mean.
SPLIT_FLOOR = 0.25


def _fractions(blocks, refresh_fraction):
    if isinstance(refresh_fraction, numbers.Real):
        refresh_fraction = [refresh_fraction] * len(blocks)
    fractions = list(refresh_fraction)
    if len(fractions) != len(blocks):
        raise ValueError('expected one refresh_fraction or {}, one per '
                         'block, got {}'.format(len(blocks), len(fractions)))
    return fractions


def _place(blocks, fractions, parts, world_size):
    """Longest-processing-time-first over the parts of every block.

    Parts are taken in decreasing cost (an owner's part before the others
    of its block) and each goes to the least-loaded rank that holds no part
    of the same block; ties go to the earlier block and the lower rank.
    """
    items = []
    for i, (block, f, k) in enumerate(zip(blocks, fractions, parts)):
        _, costs = block.shard_costs(f, k)
        items += [(cost, i, s) for s, cost in enumerate(costs)]
    items.sort(key=lambda item: (-item[0], item[1], item[2]))
    heap = [(0.0, rank) for rank in range(world_size)]
    shards = [[None] * k for k in parts]
    for cost, i, s in items:
        skipped = []
        load, rank = heapq.heappop(heap)
        while rank in shards[i]:
            skipped.append((load, rank))
            load, rank = heapq.heappop(heap)
        shards[i][s] = rank
        heapq.heappush(heap, (load + cost, rank))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return _assignment(blocks, fractions, shards, parts, world_size)


def _assignment(blocks, fractions, shards, parts, world_size):
    loads = [0.0] * world_size
    weights = []
    for block, f, ranks, k in zip(blocks, fractions, shards, parts):
        block_weights, costs = block.shard_costs(f, k)
        weights.append(block_weights)
        for rank, cost in zip(ranks, costs):
            loads[rank] += cost
    return Assignment(
        names=tuple(b.name for b in blocks),
        owners=tuple(ranks[0] for ranks in shards),
        shards=tuple(tuple(ranks) for ranks in shards),
        weights=tuple(weights),
        loads=tuple(loads),
        work=sum(b.cost(f) for b, f in zip(blocks, fractions)))


def assign_blocks(blocks, world_size, refresh_fraction=1.0, shardable=False,
                  max_imbalance=1.1):
    """Assigns blocks to ranks by longest-processing-time-first greedy.

    Blocks are taken in decreasing cost and each goes to the least-loaded
    rank; LPT's makespan is within 4/3 of the optimum (Graham, 1969). Ties
    (equal costs, equal loads) go to the earlier block and the lower rank, so
    the result depends on nothing but the arguments and every rank computes
    the same one.

    While the load imbalance exceeds ``max_imbalance``, the shardable block
    with the costliest part that a further split makes cheaper gets one
    part more (at most one per rank and per row or column of the side it
    splits, :meth:`BlockCost.split_length`), and the parts are placed
    again; the best placement seen is
    returned. Splitting also stops when a part that cannot shrink already
    sets the busiest rank's load, or when the costliest part to split is
    below :data:`SPLIT_FLOOR` of the mean: blocks are split only where it
    can pay for the bytes it costs.

    Args:
        blocks (iterable of BlockCost): The curvature blocks, in a fixed
            order (the same on every rank).
        world_size (int): Number of ranks.
        refresh_fraction (float or sequence of float): Fraction of the
            iterations that refresh the inverses (1 without stale Fisher),
            one for all blocks or one per block; preconditioning happens
            every iteration. It weighs the inverse costs and picks each
            block's form (:meth:`BlockCost.cost`); an eigendecomposition
            costs several times more per ``d³`` and can be accounted for by
            scaling the fraction up.
        shardable (bool or sequence of bool): Whether a block's
            preconditioning may be split over ranks (Kronecker blocks with
            explicit inverses); one for all blocks or one per block.
        max_imbalance (float): The load imbalance at which splitting stops.

    Returns:
        Assignment: ``owners`` and ``shards`` follow the order of ``blocks``.
    """
    blocks, world_size = _check(blocks, world_size)
    fractions = _fractions(blocks, refresh_fraction)
    if isinstance(shardable, bool):
        shardable = [shardable] * len(blocks)
    shardable = [bool(x) and b.kind == 'kronecker'
                 for x, b in zip(shardable, blocks)]
    parts = [1] * len(blocks)

    def costliest_part(i, k):
        return max(blocks[i].shard_costs(fractions[i], k)[1])

    best = _place(blocks, fractions, parts, world_size)
    while best.load_imbalance > max_imbalance:
        candidates = [
            i for i in range(len(blocks))
            if shardable[i] and parts[i] < min(
                world_size, blocks[i].split_length(fractions[i]))
            and costliest_part(i, parts[i] + 1) < costliest_part(i, parts[i])]
        # No placement beats the costliest part that cannot shrink.
        floor = max([costliest_part(i, parts[i]) for i in range(len(blocks))
                     if i not in candidates] + [0.0])
        if not candidates or max(best.loads) <= floor:
            break
        split = max(candidates,
                    key=lambda i: (costliest_part(i, parts[i]), -i))
        # Parts below SPLIT_FLOOR of the ideal mean pack well enough.
        if costliest_part(split, parts[split]) <= \
                SPLIT_FLOOR * best.work / world_size:
            break
        parts[split] += 1
        trial = _place(blocks, fractions, parts, world_size)
        if max(trial.loads) < max(best.loads):
            best = trial
    return best


def place_blocks(blocks, world_size, max_load_imbalance):
    """The assignment of a model's Fisher blocks to ``world_size`` ranks.

    Each block's cost (:meth:`FisherBlock.cost
    <chainerkfac.curvature.FisherBlock.cost>`) is weighed by the share of
    steps that refresh its inverse in a *fresh* run's first iteration,
    which the options alone decide: only owners keep a block's factors, so
    the placement must come out the same when a run resumes. Blocks are
    split (:func:`assign_blocks`'s ``shardable``) where they allow it and
    ``max_load_imbalance`` is not ``None``.

    Returns:
        ``(Assignment, refresh fractions per block)``.
    """
    costs = [b.cost() for b in blocks]
    for block, cost in zip(blocks, costs):
        if cost is None:
            raise ValueError(
                '{} ({}) does not define cost(), which distributed K-FAC '
                'needs to place it on a rank'.format(type(block).__name__,
                                                     block.name))
    fractions = [1 / b.inverse_reuse() for b in blocks]
    split = max_load_imbalance is not None
    return assign_blocks(
        costs, world_size, fractions,
        shardable=[split and b.splittable() for b in blocks],
        max_imbalance=max_load_imbalance or 1.0), fractions


def assign_blocks_by_count(blocks, world_size, refresh_fraction=1.0):
    """The original implementation's split, for comparison.

    Consecutive chunks of equal count (``numpy.array_split`` of the block
    indices: the first ``n % world_size`` ranks take one block more),
    whatever the blocks cost. The loads use the same cost model as
    :func:`assign_blocks`.
    """
    blocks, world_size = _check(blocks, world_size)
    base, extra = divmod(len(blocks), world_size)
    owners = []
    for rank in range(world_size):
        owners += [rank] * (base + (1 if rank < extra else 0))
    return _assignment(blocks, _fractions(blocks, refresh_fraction),
                       [[owner] for owner in owners], [1] * len(blocks),
                       world_size)
