"""The work of one curvature block, in floating-point operations.

One model serves two decisions: which rank owns a block in distributed
K-FAC (:func:`chainerkfac.distributed.assign_blocks`) and whether a block's
inverse or preconditioning is large enough to use every BLAS thread in one
process (:mod:`chainerkfac.cpu_parallel`).
"""
import dataclasses

from chainerkfac import linalg
from chainerkfac.curvature import low_rank


#: Block kinds and the number of dimensions each takes.
KINDS = {'kronecker': 2, 'doubly_factored': 3, 'diagonal': 1, 'full': 1}

#: How much longer an operation of LAPACK's ``potrf``/``potri`` takes than
#: one of a matrix product, as :meth:`BlockCost.shard_costs` charges the
#: refresh of a split block's owner: counted like products, a split looks
#: cheaper than it is (benchmarks/tuning_measurements.md, "The cost of a
#: K-FAC step").
LAPACK_SLOWDOWN = 2.0

#: The size from which the ranks of a split block share its larger
#: factor's Cholesky factorization (:mod:`chainerkfac.distributed.cholesky`)
#: rather than leave it to the owner. Below it one message per panel and
#: the chain of panel factorizations cost more than the shared operations
#: save.
SHARED_FACTORIZATION_MIN_DIM = 1024


@dataclasses.dataclass(frozen=True)
class StepWork:
    """Operations of a step: the layers' forward and backward passes,
    and K-FAC's on a stale step and on a refresh step."""

    passes: float
    stale: float
    refresh: float

    def __add__(self, other):
        return StepWork(self.passes + other.passes, self.stale + other.stale,
                        self.refresh + other.refresh)

    def ratios(self):
        """``(stale, refresh)`` over the passes (``None`` without
        passes): a stale K-FAC step then takes about ``1 + stale`` times
        the passes' time, where MomentumSGD's takes about one."""
        if not self.passes:
            return None
        return self.stale / self.passes, self.refresh / self.passes


def total(works):
    """The sum of the :class:`StepWork` of ``works`` that are not ``None``
    (``None`` if none is)."""
    known = [work for work in works if work is not None]
    return sum(known[1:], known[0]) if known else None


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """What the cost model needs to know about one curvature block.

    Args:
        name (str): Name of the block, e.g. the link's path in the model.
        kind (str): ``'kronecker'`` for a Linear or Convolution2D block
            ``A ⊗ G``; ``'diagonal'`` or ``'full'`` for a BatchNormalization
            block (paper §5.4).
        dims (tuple of int): ``(d_A, d_G)`` for ``'kronecker'``, the sizes of
            the input-side factor A (including the bias coordinate) and of
            the output-side factor G; ``(d_K, d_Ψ, d_G)`` for
            ``'doubly_factored'`` (a Linear's doubly-factored block ``Ψ ⊗ K
            ⊗ G``, Ba et al. 2017 §4: positions, channels, outputs);
            ``(C,)`` (the number of channels) for BatchNormalization.

    Costs are floating-point operation counts:

    * ``'kronecker'``: inverting both factors (Cholesky ``potrf`` + ``potri``,
      about ``d³`` each) costs ``d_A³ + d_G³``; preconditioning
      ``G⁻¹ ∇W A⁻¹`` is two matrix products, ``2 d_G d_A (d_A + d_G)``.
      A block whose inverse serves few steps keeps Cholesky factors instead
      (:meth:`cost`).
    * ``'doubly_factored'``: three factors and the bias's ``d_G x d_G``
      block to invert, ``d_K³ + d_Ψ³ + 2 d_G³``; preconditioning multiplies
      the ``d_G x d_Ψ x d_K`` gradient along each axis, ``2 d_K d_Ψ d_G
      (d_K + d_Ψ + d_G)``, and the bias, ``2 d_G²``.
    * ``'full'``: a dense ``2C x 2C`` Fisher of (γ, β): ``(2C)³`` to invert,
      ``2 (2C)²`` for the matrix-vector product.
    * ``'diagonal'``: ``2C`` reciprocals and ``2C`` products.
    """

    name: str
    kind: str
    dims: tuple
    #: Rows of one step's batch (samples times positions; samples for
    #: ``'doubly_factored'``), for :meth:`step_costs`; 0 unknown.
    rows: int = 0
    #: Whether the block can precondition from its batch's rows
    #: (:mod:`chainerkfac.curvature.low_rank`, a Linear's block).
    low_rank: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError('block {!r}: unknown kind {!r}; expected one of '
                             '{}'.format(self.name, self.kind, sorted(KINDS)))
        dims = tuple(int(d) for d in self.dims)
        if len(dims) != KINDS[self.kind] or min(dims) < 1:
            raise ValueError(
                'block {!r}: a {!r} block takes {} positive dims, got '
                '{!r}'.format(self.name, self.kind, KINDS[self.kind],
                              self.dims))
        # The instance is frozen; normalising the field is the one write.
        object.__setattr__(self, 'dims', dims)

    @property
    def inverse_cost(self):
        """Operations to refresh the inverse (or damped diagonal)."""
        if self.kind == 'kronecker':
            d_a, d_g = self.dims
            return d_a ** 3 + d_g ** 3
        if self.kind == 'doubly_factored':
            d_k, d_psi, d_g = self.dims
            return d_k ** 3 + d_psi ** 3 + 2 * d_g ** 3
        c2 = 2 * self.dims[0]
        return c2 ** 3 if self.kind == 'full' else c2

    @property
    def precondition_cost(self):
        """Operations to precondition the block's gradient once."""
        if self.kind == 'kronecker':
            d_a, d_g = self.dims
            return 2 * d_g * d_a * (d_a + d_g)
        if self.kind == 'doubly_factored':
            d_k, d_psi, d_g = self.dims
            return 2 * d_k * d_psi * d_g * (d_k + d_psi + d_g) + 2 * d_g ** 2
        c2 = 2 * self.dims[0]
        return 2 * c2 ** 2 if self.kind == 'full' else c2

    def pass_cost(self):
        """Operations of the layer's forward and backward passes over
        :attr:`rows`: three products of ``rows x d_in x d_out``
        (``6 rows d_in d_out``) for a Kronecker or doubly-factored block;
        0 for BatchNorm, which is element-wise."""
        if self.kind == 'kronecker':
            d_a, d_g = self.dims
            return 6 * self.rows * d_a * d_g
        if self.kind == 'doubly_factored':
            d_k, d_psi, d_g = self.dims
            return 6 * self.rows * d_k * d_psi * d_g
        return 0

    def step_costs(self):
        """``(stale, refresh)``: K-FAC's operations on a step that refreshes
        nothing and on one that refreshes the statistics and the inverses.

        Stale: preconditioning (:func:`low_rank.pays
        <chainerkfac.curvature.low_rank.pays>` decides, for a block that
        can, whether from the batch's rows, ``2 N (d_G² + d_A² + d_G
        d_A)``) and about 10 operations a parameter (the step rule's sums,
        the checks, momentum). Refresh: that, the statistics (``2 N (d_A²
        + d_G²)`` for a Kronecker block) and the inverses at
        :data:`LAPACK_SLOWDOWN` times the operations of a product."""
        precondition = self.precondition_cost
        if self.kind == 'kronecker':
            d_a, d_g = self.dims
            params = d_a * d_g
            statistics = 2 * self.rows * (d_a * d_a + d_g * d_g)
            if self.low_rank and low_rank.pays(self.rows, d_a, d_g):
                precondition = 2 * self.rows * (d_g * d_g + d_a * d_a
                                                + d_g * d_a)
        elif self.kind == 'doubly_factored':
            d_k, d_psi, d_g = self.dims
            params = d_k * d_psi * d_g
            statistics = 2 * self.rows * (d_k * d_psi * (d_k + d_psi)
                                          + d_g * d_g)
        else:
            params = 2 * self.dims[0]
            statistics = 2 * self.rows * params
        stale = precondition + 10 * params
        return stale, stale + statistics + LAPACK_SLOWDOWN * self.inverse_cost

    def explicit_form(self, refresh_fraction=1.0):
        """Whether a Kronecker block whose inverses are refreshed on a
        fraction ``f`` of the iterations keeps explicit inverses (else
        Cholesky factors): :func:`chainerkfac.linalg.explicit_inverse_pays`
        for an inverse serving ``1/f`` steps."""
        f = refresh_fraction
        return self.kind == 'kronecker' and (
            f == 0 or linalg.explicit_inverse_pays(*self.dims, 1 / f))

    def cost(self, refresh_fraction=1.0):
        """Operations per iteration when inverses are refreshed on a
        ``refresh_fraction`` ``f`` of the iterations (1 without stale Fisher).

        A Kronecker block takes the form :meth:`explicit_form` chooses. With
        ``I = d_A³ + d_G³``, ``P`` the preconditioning products and ``C``
        the rule's break-even constant, it costs ``f I + P`` with explicit
        inverses, and ``f I / 3 + (1 + 1/C) P`` with Cholesky factors
        (``potrf`` only; triangular solves do the products' work more
        slowly, by the ``P / C`` per step that puts the rule's break-even
        where it is).
        """
        f = refresh_fraction
        if self.kind != 'kronecker' or self.explicit_form(f):
            return f * self.inverse_cost + self.precondition_cost
        return (f * self.inverse_cost / 3
                + (1 + 1 / linalg.EXPLICIT_INVERSE_BREAK_EVEN)
                * self.precondition_cost)

    def split_length(self, refresh_fraction=1.0):
        """The side of ``V = G⁻¹ ∇W̄ A⁻¹`` that :meth:`shard_costs` splits:
        the longer one with explicit inverses, the shorter one with
        Cholesky factors."""
        d_A, d_G = self.dims
        return (max if self.explicit_form(refresh_fraction) else min)(
            d_A, d_G)

    def shard_costs(self, refresh_fraction, shards):
        """How a Kronecker block's work is divided when its preconditioning
        is split into ``shards`` parts on as many ranks.

        The first part's rank, the block's owner, refreshes the inverses
        at a fraction ``f`` of the iterations and hands the others what
        their parts need. The block keeps the form of :meth:`explicit_form`:

        * Explicit inverses: ``V`` splits along its longer side. Rows ``I``
          of ``V`` are ``G⁻¹[I, :] ∇W̄ A⁻¹`` and columns ``J`` are ``G⁻¹ ∇W̄
          A⁻¹[:, J]``, so a part of a fraction ``w`` of that side costs
          ``w P`` and needs a slice of one inverse and the other whole. The
          owner pays ``R = f s I`` to refresh them.
        * For inverses serving few steps, the Cholesky factor of the larger
          factor and the explicit inverse of the smaller one, say ``L_A``
          and ``G⁻¹`` when ``d_G < d_A``: ``V`` splits along its shorter
          side, ``V[I, :] = (G⁻¹[I, :] ∇W̄) A⁻¹`` by triangular solves
          (:func:`chainerkfac.linalg.mixed_precondition`). A part costs
          ``w (2 d_G² d_A + (1 + 1/C) 2 d_A² d_G)`` and needs ``L_A`` whole
          and rows of ``G⁻¹``. From :data:`SHARED_FACTORIZATION_MIN_DIM`
          on, the ``shards`` ranks compute ``L_A`` together
          (:mod:`chainerkfac.distributed.cholesky`): each pays ``f d_A³ /
          (3 shards)`` of trailing updates, matrix products at full speed,
          and ends with ``L_A`` whole; the owner also inverts ``G``, ``R =
          f s d_G³`` more. Below it the owner factors ``A`` alone and
          sends ``L_A``: ``R = f s (d_A³ / 3 + d_G³)``.

        ``s`` is :data:`LAPACK_SLOWDOWN`. With ``Q`` the whole block's work
        on the parts (``P`` or the sum above), the owner's smaller share
        ``w₀`` evens out the parts::

            R + w₀ Q = (1 - w₀) Q / (shards - 1)

        or ``w₀ = 0`` when ``R`` alone exceeds that. :meth:`cost` counts
        the unsplit block's LAPACK operations like products, so splitting
        has to beat it by that margin: it errs on the side of not
        splitting, which also moves fewer bytes.

        Returns:
            ``(weights, costs)``: the fraction of the split side and the
            operations per iteration of each part; one part is the unsplit
            block, ``((1.0,), (cost(f),))``.
        """
        f, k = refresh_fraction, int(shards)
        if k == 1:
            return (1.0,), (self.cost(f),)
        if self.kind != 'kronecker':
            raise ValueError('block {!r}: only Kronecker blocks can be split '
                             'over ranks, not {!r} ones'.format(
                                 self.name, self.kind))
        if self.explicit_form(f):
            shared = 0.0
            refresh = f * LAPACK_SLOWDOWN * self.inverse_cost
            split = self.precondition_cost
        else:
            short, long = sorted(self.dims)
            shared = 0.0
            refresh = f * LAPACK_SLOWDOWN * short ** 3
            if long >= SHARED_FACTORIZATION_MIN_DIM:
                shared = f * long ** 3 / (3 * k)
            else:
                refresh += f * LAPACK_SLOWDOWN * long ** 3 / 3
            split = 2 * short * long * (
                short + (1 + 1 / linalg.EXPLICIT_INVERSE_BREAK_EVEN) * long)
        owner = max(0.0, (split - (k - 1) * refresh) / (k * split))
        other = (1 - owner) / (k - 1)
        return ((owner,) + (other,) * (k - 1),
                (shared + refresh + owner * split,)
                + (shared + other * split,) * (k - 1))
