"""Split blocks: ranks that share one Kronecker block's preconditioning.

When the assignment (:func:`~chainerkfac.distributed.assign_blocks`, with
``max_load_imbalance``) splits a large block into parts, each part's rank
computes rows or columns of ``V = G_d⁻¹ ∇W̄ A_d⁻¹``: columns ``J`` are
``G_d⁻¹ ∇W̄ A_d⁻¹[:, J]``, rows ``I`` are ``G_d⁻¹[I, :] ∇W̄ A_d⁻¹``, a
slice of one inverse and the other whole. The split fixes the block's
inverse form (:meth:`BlockCost.shard_costs
<chainerkfac.curvature.cost.BlockCost.shard_costs>` prices both):

* explicit inverses (:class:`~chainerkfac.curvature.forms.KroneckerInverses`),
  the longer side split;
* or, when inverses serve too few steps to pay for the larger factor's
  explicit inverse, the smaller factor's inverse and the larger one's
  Cholesky factor (:class:`~chainerkfac.curvature.forms.KroneckerMixed`),
  the shorter side split. From
  :data:`~chainerkfac.curvature.cost.SHARED_FACTORIZATION_MIN_DIM` on, the
  block's ranks compute that Cholesky factor together
  (:mod:`chainerkfac.distributed.cholesky`).

Whenever the owner refreshes the block (and on the first step of a process,
which resuming from a snapshot needs) it sends every other rank of the
block its part: a :class:`~chainerkfac.curvature.forms.Form` whose arrays
are slices of its own, or, for a shared factorization, the slice of the
smaller inverse and that rank's panels of the larger damped factor. A
:class:`Delivery` in front of each part says which; curvature blocks know
nothing of ranks.
"""
import enum

from chainer import backend

from chainerkfac import linalg
from chainerkfac.curvature import cost
from chainerkfac.curvature import forms
from chainerkfac.distributed import buffers
from chainerkfac.distributed import cholesky


class Delivery(enum.IntEnum):
    """What the owner of a split block sends for one part on a step (it
    travels as the first number of the part's message)."""

    #: The part's form is unchanged.
    NOTHING = 0
    #: The part's form (:meth:`Split.part_form`).
    PART = 1
    #: The slice of the smaller inverse and the receiver's panels of the
    #: larger damped factor, to factor together.
    PANELS = 2


class Split:
    """How one block's preconditioning is cut into parts.

    Args:
        dims: ``(d_A, d_G)`` of the block.
        explicit (bool): Explicit inverses (else the mixed form).
        bounds: ``[(start, stop)]`` per part, along the split side.
        ranks: The rank that computes each part (the owner first).
    """

    def __init__(self, dims, explicit, bounds, ranks):
        d_A, d_G = dims
        self.explicit = explicit
        self.bounds = list(bounds)
        self.ranks = tuple(ranks)
        # V is (d_G, d_A): explicit inverses split its longer side, the
        # mixed form its shorter side.
        self.columns = (d_A >= d_G) == explicit
        larger = 'A' if d_A >= d_G else 'G'
        self.cholesky = None if explicit else larger
        self.shared = (not explicit
                       and max(dims) >= cost.SHARED_FACTORIZATION_MIN_DIM)
        self.dims = {'A': d_A, 'G': d_G}

    @staticmethod
    def length(dims, explicit):
        """The length of the side parts split: the longer one with explicit
        inverses, the shorter one in the mixed form."""
        return max(dims) if explicit else min(dims)

    def build(self, factors, damping, reuse):
        """The block's form on every refresh (:meth:`FisherBlock.fix_form
        <chainerkfac.curvature.base.FisherBlock.fix_form>`); a shared
        factorization leaves the larger factor damped, for
        :meth:`SplitBlocks.share` to factor."""
        A, G = factors
        if self.explicit:
            return forms.KroneckerInverses.refreshed(A, G, damping)
        return forms.KroneckerMixed.refreshed(
            A, G, damping, self.cholesky, factorize=not self.shared)

    def empty(self, s):
        start, stop = self.bounds[s]
        return start == stop

    def part_of(self, matrix, s):
        """The view of part ``s``'s rows or columns of a ``(d_G, d_A)``
        matrix."""
        start, stop = self.bounds[s]
        return matrix[:, start:stop] if self.columns else matrix[start:stop]

    def part_form(self, form, s):
        """Part ``s`` of the block's ``form``: its inverse sliced, the
        other array whole; ``apply(∇)`` then gives the part's rows or
        columns of ``V``."""
        start, stop = self.bounds[s]
        if self.columns:
            return form.columns(start, stop)
        return form.rows(start, stop)

    def part_shapes(self, s):
        """``(shape of A's array, shape of G's array)`` in part ``s``'s
        form."""
        start, stop = self.bounds[s]
        d_A, d_G = self.dims['A'], self.dims['G']
        if self.columns:
            return (d_A, stop - start), (d_G, d_G)
        return (d_A, d_A), (stop - start, d_G)

    def triangular(self):
        """Whether A's and G's arrays are lower triangular (a Cholesky
        factor travels as its triangle, half the bytes)."""
        return self.cholesky == 'A', self.cholesky == 'G'

    def form_of(self, A_side, G_side, damping=None):
        """The part's form from its arrays."""
        if self.explicit:
            return forms.KroneckerInverses.from_sides(A_side, G_side,
                                                      damping)
        return forms.KroneckerMixed.from_sides(A_side, G_side, self.cholesky,
                                               damping)

    def adopt(self, form):
        """The whole block's ``form``, built by another placement (a
        snapshot of another number of processes, or of one), as the kind
        :meth:`build` makes: each side's inverse or Cholesky factor, the
        one computed from the other where the kinds differ (the same
        damped inverse, to round-off)."""
        sides = []
        for f in 'AG':
            want = '_chol' if f == self.cholesky else '_inv'
            have = form.arrays.get(f + want)
            if have is None and want == '_inv':
                have = linalg.inverse_of_cholesky(form.arrays[f + '_chol'])
            elif have is None:
                have = linalg.cholesky_of_inverse(form.arrays[f + '_inv'])
            sides.append(have)
        return self.form_of(*sides, damping=form.damping)

    def factor_ranks(self):
        """The ranks that factor the larger factor together: the owner,
        then the ranks of the non-empty other parts."""
        return (self.ranks[0],) + tuple(
            rank for s, rank in enumerate(self.ranks) if s > 0
            and not self.empty(s))


def _pack(array, triangular):
    # A lower Cholesky factor travels as its triangle, half the bytes.
    if triangular:
        return buffers.pack_symmetric(array.T)
    return array.ravel()


def _unpack(flat, shape, triangular):
    """``(array, elements read)``."""
    if triangular:
        xp = backend.get_array_module(flat)
        d = shape[0]
        size = d * (d + 1) // 2
        # The transpose of the upper triangle is the lower factor in
        # Fortran order, which LAPACK's solves take without a copy.
        return xp.triu(buffers.unpack_symmetric(flat[:size], d)).T, size
    size = shape[0] * shape[1]
    return flat[:size].reshape(shape), size


def cholesky_alone(block, split):
    """The larger factor's Cholesky factor, computed by the owner alone as
    an unsplit block would (with jitter, else through the eigenvalues), for
    a factor that a shared factorization found not positive definite."""
    A, G = block.factor['A'], block.factor['G']
    damping = dict(zip('AG', linalg.factored_damping(
        (A, G), block.form.damping)))
    return linalg.damped_cholesky(block.factor[split.cholesky],
                                  damping[split.cholesky])


class SplitBlocks:
    """The split blocks of an assignment, from one rank's side: fixes
    their forms, sends and receives their parts, and computes this rank's
    parts of ``V``."""

    def __init__(self, comm, assignment, blocks, fractions):
        self.comm = comm
        self.assignment = assignment
        self.splits = {}
        for i in assignment.split_blocks:
            dims = blocks[i].dims()
            explicit = blocks[i].cost().explicit_form(fractions[i])
            self.splits[i] = Split(
                dims, explicit,
                assignment.part_bounds(i, Split.length(dims, explicit)),
                assignment.shards[i])
            blocks[i].fix_form(self.splits[i].build)
        #: ``{block: part}`` of the blocks this rank holds a part of.
        self.parts = assignment.parts_of(comm.rank)
        self._received = {}
        self._send_all = True

    def _deliveries(self, rank):
        """``(block, part)`` of the non-empty parts that ``rank`` computes
        for another owner, in block order."""
        return [(i, s) for i, split in self.splits.items()
                for s, holder in enumerate(split.ranks)
                if s > 0 and holder == rank and not split.empty(s)]

    def _message(self, block, i, s, dest, fresh):
        """``(Delivery, [(array, triangular)])`` for part ``s`` of block
        ``i``: A's and G's arrays of the part's form, or, for a shared
        factorization, the inverse's slice and ``dest``'s panels of the
        larger damped factor."""
        split = self.splits[i]
        if split.shared and id(block) in fresh:
            part = split.part_form(block.form, s)
            inverse = part.sides()[0 if split.cholesky == 'G' else 1]
            panels = cholesky.lower_panels(block.form.cholesky_factor,
                                           split.factor_ranks(), dest)
            return Delivery.PANELS, [(inverse, False)] + [
                (panels[p], False) for p in sorted(panels)]
        if block.ready() and (self._send_all or id(block) in fresh):
            part = split.part_form(block.form, s)
            return Delivery.PART, list(zip(part.sides(), split.triangular()))
        return Delivery.NOTHING, []

    def share(self, blocks, refreshed):
        """Owners send each other rank of their split blocks what its part
        needs (one alltoall); then the ranks of each shared factorization
        compute it, block by block."""
        if not self.splits:
            return
        fresh = {id(block) for block in refreshed}
        rank, owners = self.comm.rank, self.assignment.owners
        like = blocks[next(iter(self.splits))].params()[0]
        xp, dtype = backend.get_array_module(like.array), like.dtype
        parts, counts = [], [0] * self.comm.size
        for dest in range(self.comm.size):
            for i, s in self._deliveries(dest):
                if owners[i] != rank:
                    continue
                delivery, arrays = self._message(blocks[i], i, s, dest, fresh)
                packed = [xp.asarray([int(delivery)], dtype=dtype)] + [
                    _pack(array, triangular) for array, triangular in arrays]
                parts += packed
                counts[dest] += sum(a.size for a in packed)
        send_buffer = xp.concatenate(parts) if parts else xp.empty(0, dtype)
        received, _ = self.comm.alltoall_v(send_buffer, counts)
        self._send_all = False
        # {block: (the inverse's slice, this rank's panels)} of the shared
        # factorizations this rank joins as a non-owner.
        offset, shared = 0, {}
        for source in range(self.comm.size):
            for i, s in self._deliveries(rank):
                if owners[i] != source:
                    continue
                delivery = Delivery(int(received[offset]))
                offset += 1
                if delivery == Delivery.NOTHING:
                    continue
                split = self.splits[i]
                sides = list(zip(split.part_shapes(s), split.triangular()))
                if delivery == Delivery.PANELS:
                    # Only the inverse's slice; the other side is factored.
                    sides = [side for side in sides if not side[1]]
                arrays = []
                for shape, triangular in sides:
                    array, size = _unpack(received[offset:], shape,
                                          triangular)
                    arrays.append(array)
                    offset += size
                if delivery == Delivery.PANELS:
                    panels = {}
                    for p, shape in sorted(cholesky.panel_shapes(
                            split.dims[split.cholesky], split.factor_ranks(),
                            rank).items()):
                        panels[p], size = _unpack(received[offset:], shape,
                                                  False)
                        offset += size
                    shared[i] = arrays[0], panels
                else:
                    self._received[i] = split.form_of(*arrays)
        for i, split in self.splits.items():
            block = blocks[i]
            ranks = split.factor_ranks()
            if owners[i] == rank and split.shared and id(block) in fresh:
                M = block.form.cholesky_factor
                block.form = block.form.with_cholesky(
                    cholesky.shared_cholesky(
                        self.comm, ranks, len(M),
                        cholesky.lower_panels(M, ranks, rank), M,
                        lambda: cholesky_alone(block, split)))
            elif i in shared:
                inverse, panels = shared[i]
                L = cholesky.shared_cholesky(
                    self.comm, ranks, split.dims[split.cholesky], panels,
                    received, None)
                self._received[i] = split.form_of(
                    *((L, inverse) if split.cholesky == 'A'
                      else (inverse, L)))

    def part_form(self, block, i):
        """This rank's form for its part of block ``i``, or ``None`` before
        the block's first inverse."""
        s = self.parts[i]
        if s == 0:
            return (self.splits[i].part_form(block.form, 0)
                    if block.ready() else None)
        return self._received.get(i)
