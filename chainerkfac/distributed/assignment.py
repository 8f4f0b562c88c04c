"""Placement of curvature blocks on ranks by a cost model.

In the model-parallel stages of distributed K-FAC (Osawa et al., CVPR 2019,
§3.3, Fig. 1 stages 4-5) each block's factors are reduced onto one rank, its
*owner*, which refreshes the inverses and preconditions the block's gradient
before the all-gather-v returns the result to everyone. The iteration waits
for the busiest owner, so blocks are balanced by their cost, not by their
number: in ResNet-50 the largest Kronecker block costs 10^8 times as much as
the smallest BatchNormalization block. The count-based split of the original
implementation (consecutive equal-count chunks, network order) gives the
ranks that hold the last stage most of the work: a max/mean load of 3.3 at
4 ranks and 4.2 at 8, where longest-processing-time-first reaches 1.0 and
1.47 (1.47 is the floor: the res5 3x3 convolution alone is almost a fifth
of the total).

Everything here is a pure function of (blocks, costs, world size): every rank
computes the same :class:`Assignment` without communicating.

Surplus ranks. Every block has exactly one owner, which computes it and
contributes its result to the all-gather-v; when ranks outnumber blocks, the
surplus ranks own nothing and idle through stages 4-5 (their all-gather-v
segment is empty). :attr:`Assignment.load_imbalance` counts them (it is at
least ``world_size / n_blocks`` then), so the waste is reported, not hidden.
The paper computes such blocks redundantly on several ranks instead; that
cannot shorten the iteration, which still waits for the costliest block, and
a reduce-scatter delivers each segment to a single rank, so redundant owners
would need an extra broadcast of the factors.
"""
import dataclasses
import heapq
import numbers

from chainerkfac.curvature.cost import BlockCost  # NOQA  (public here too)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Owner of every block and the resulting load of every rank.

    Attributes:
        names (tuple of str): Block names, in the order given.
        owners (tuple of int): ``owners[i]`` is the only rank that refreshes
            and preconditions block ``i``.
        loads (tuple of float): Cost assigned to each rank, indexed by rank.
    """

    names: tuple
    owners: tuple
    loads: tuple

    @property
    def world_size(self):
        """Number of ranks the blocks were assigned to."""
        return len(self.loads)

    @property
    def load_imbalance(self):
        """Maximum over mean of the per-rank loads (1.0 is perfect balance).

        Idle ranks count in the mean: the model-parallel stage takes as long
        as the busiest rank, whatever the others do.
        """
        total = sum(self.loads)
        if total == 0:
            return 1.0
        return max(self.loads) * self.world_size / total

    @property
    def idle_ranks(self):
        """Ranks that own no block (surplus ranks when ranks outnumber
        blocks)."""
        busy = set(self.owners)
        return tuple(r for r in range(self.world_size) if r not in busy)

    def blocks_of(self, rank):
        """Indices of the blocks owned by ``rank``, in the order given."""
        return tuple(i for i, owner in enumerate(self.owners) if owner == rank)

    def buffer_order(self):
        """Block indices grouped by owner, in rank order (in the order given
        within a rank): the layout of a reduce-scatter-v send buffer and of
        an all-gather-v result."""
        return tuple(sorted(range(len(self.owners)),
                            key=lambda i: (self.owners[i], i)))

    def segment_counts(self, sizes):
        """Per-rank segment sizes for the ``v`` collectives, when block ``i``
        contributes ``sizes[i]`` elements (laid out by
        :meth:`buffer_order`)."""
        if len(sizes) != len(self.owners):
            raise ValueError('expected {} sizes, one per block, got '
                             '{}'.format(len(self.owners), len(sizes)))
        counts = [0] * self.world_size
        for owner, size in zip(self.owners, sizes):
            counts[owner] += int(size)
        return counts


def _check(blocks, world_size):
    blocks = list(blocks)
    if int(world_size) != world_size or world_size < 1:
        raise ValueError('world_size must be a positive integer, got '
                         '{!r}'.format(world_size))
    names = [b.name for b in blocks]
    if len(set(names)) != len(names):
        raise ValueError('block names must be unique')
    return blocks, int(world_size)


def _costs(blocks, refresh_fraction):
    if isinstance(refresh_fraction, numbers.Real):
        refresh_fraction = [refresh_fraction] * len(blocks)
    fractions = list(refresh_fraction)
    if len(fractions) != len(blocks):
        raise ValueError('expected one refresh_fraction or {}, one per '
                         'block, got {}'.format(len(blocks), len(fractions)))
    return [b.cost(f) for b, f in zip(blocks, fractions)]


def _assignment(blocks, owners, world_size, costs):
    loads = [0.0] * world_size
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return Assignment(names=tuple(b.name for b in blocks),
                      owners=tuple(owners), loads=tuple(loads))


def assign_blocks(blocks, world_size, refresh_fraction=1.0):
    """Assigns blocks to ranks by longest-processing-time-first greedy.

    Blocks are taken in decreasing cost and each goes to the least-loaded
    rank; LPT's makespan is within 4/3 of the optimum (Graham, 1969). Ties
    (equal costs, equal loads) go to the earlier block and the lower rank, so
    the result depends on nothing but the arguments and every rank computes
    the same one.

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

    Returns:
        Assignment: ``owners`` follows the order of ``blocks``.
    """
    blocks, world_size = _check(blocks, world_size)
    costs = _costs(blocks, refresh_fraction)
    order = sorted(range(len(blocks)), key=lambda i: (-costs[i], i))
    heap = [(0.0, rank) for rank in range(world_size)]
    owners = [None] * len(blocks)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
    return _assignment(blocks, owners, world_size, costs)


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
    return _assignment(blocks, owners, world_size,
                       _costs(blocks, refresh_fraction))
