"""One Cholesky factorization shared by the ranks of a split block.

When inverses serve few steps, a split Kronecker block keeps its larger
damped factor ``M`` (``A_d`` or ``G_d``, ``d x d``) as a Cholesky factor
``L`` (:meth:`BlockCost.shard_costs
<chainerkfac.curvature.cost.BlockCost.shard_costs>`); from
:data:`~chainerkfac.curvature.cost.SHARED_FACTORIZATION_MIN_DIM` rows on,
its ranks compute ``L`` together: computed by the owner alone, that
``d³/3`` is the one piece of work no split of the preconditioning
shrinks. The ``k`` ranks of the block factor ``M`` right-looking, by
column panels dealt out round-robin (``panel p`` to ``ranks[p % k]``)::

    for each panel p (columns j):
        its rank:   L_jj = chol(M_jj),  L_rj = M_rj L_jj⁻ᵀ
                    (linalg.cholesky_panel)
        group_bcast of [L_jj; L_rj] to the other ranks of the block
        every rank: M_·q -= L_·j L_qjᵀ for each of its panels q right of j

The rank of panel ``p + 1`` updates, factors and sends it first, before
its other updates (lookahead, without waiting for its sends to arrive), so
the panels' own factorizations overlap the other ranks' updates instead of
holding them up.

The trailing updates, all but ``O(d² b)`` of the ``d³/3`` operations, are
matrix products spread evenly over the ranks (:data:`PANELS_PER_RANK`);
every rank ends with the whole ``L``, which its part needs. A panel
that is not positive definite (damping 0, round-off) is sent as NaN, so
every rank of the block stops at the same panel; the owner then factors the
damped factor alone as an unsplit block does (jitter, then eigenvalues,
:func:`chainerkfac.linalg.damped_cholesky`) and broadcasts the result.
"""
import math

from chainer import backend
import numpy

from chainerkfac import linalg

#: Panels per rank. With one, the middle ranks would do most of the
#: trailing updates (about 1.5x the mean); more panels even the updates out
#: and shorten each step of the chain that the panels' own factorizations
#: form, until thin products cost more (the figures:
#: benchmarks/tuning_measurements.md, "The cost of a K-FAC step").
PANELS_PER_RANK = 8

#: Narrower panels make the trailing updates slow, thin products.
MIN_PANEL = 32


def panel_bounds(dim, ranks):
    """``[(start, stop), ...]``: the column panels of a ``dim x dim``
    factorization shared by ``ranks`` ranks (a count); panel ``p`` belongs
    to the ``p % ranks``-th rank of the block."""
    count = max(1, min(ranks * PANELS_PER_RANK, dim // MIN_PANEL))
    edges = [round(dim * p / count) for p in range(count + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if a < b]


def panels_of(dim, ranks, rank):
    """Indices of the panels (:func:`panel_bounds`) that ``rank`` of the
    block's ``ranks`` (a sequence) factors and updates."""
    k = len(ranks)
    position = list(ranks).index(rank)
    return [p for p in range(len(panel_bounds(dim, k))) if p % k == position]


def panel_shapes(dim, ranks, rank):
    """``{p: (dim - start, stop - start)}``: the shapes of the panels of
    :func:`panels_of`, as :func:`lower_panels` cuts them."""
    bounds = panel_bounds(dim, len(ranks))
    return {p: (dim - bounds[p][0], bounds[p][1] - bounds[p][0])
            for p in panels_of(dim, ranks, rank)}


def lower_panels(M, ranks, rank):
    """``{p: M[start:, start:stop]}`` for the panels of :func:`panels_of`,
    as C-ordered copies: what the owner hands each rank of the block, its
    columns of ``M`` from the diagonal down."""
    bounds = panel_bounds(len(M), len(ranks))
    return {p: M[bounds[p][0]:, slice(*bounds[p])].copy()
            for p in panels_of(len(M), ranks, rank)}


def shared_cholesky(comm, ranks, dim, mine, like, alone):
    """The lower Cholesky factor ``L`` of a ``dim x dim`` matrix ``M``,
    computed by ``ranks`` together (see the module docstring).

    Every rank of ``ranks`` calls it, in the same order relative to its
    other shared factorizations. ``mine`` is this rank's
    :func:`lower_panels` of ``M`` (possibly none); they are overwritten.
    ``like`` is an array of the array module and dtype of ``M``.
    ``alone()``, called on ``ranks[0]`` only when a panel is not positive
    definite, returns the factor that rank computes by itself instead
    (with jitter, or through eigenvalues); it is broadcast whole.

    Returns:
        ``L`` on every rank of the block: Fortran-ordered, zero above the
        diagonal, what LAPACK's solves take without a copy.
    """
    xp, dtype = backend.get_array_module(like), like.dtype
    k = len(ranks)
    bounds = panel_bounds(dim, k)
    L = xp.zeros((dim, dim), dtype=dtype, order='F')
    ready, sends = {}, []

    def factor_and_send(p):
        panel = mine.pop(p)
        try:
            linalg.cholesky_panel(panel)
        except numpy.linalg.LinAlgError:
            panel[...] = math.nan
        ready[p] = panel
        sends.append(comm.group_bcast(panel, comm.rank, ranks, wait=False))

    if ranks[0] == comm.rank:
        factor_and_send(0)
    for p, (start, stop) in enumerate(bounds):
        root = ranks[p % k]
        if root == comm.rank:
            panel = ready.pop(p)
        else:
            panel = xp.empty((dim - start, stop - start), dtype=dtype)
            comm.group_bcast(panel, root, ranks)
        if not math.isfinite(float(panel[0, 0])):
            for wait in sends:
                wait()
            # Lᵀ in C order is L in Fortran order.
            transposed = xp.empty((dim, dim), dtype=dtype)
            if comm.rank == ranks[0]:
                transposed[...] = alone().T
            return comm.group_bcast(transposed, ranks[0], ranks).T
        L[start:, start:stop] = panel
        for q in sorted(mine):
            # mine[q] holds M[r:, r:t] of panel q = (r, t), right of p.
            right = mine[q]
            r = dim - len(right)
            below = panel[r - start:]
            right -= below @ below[:right.shape[1]].T
            if q == p + 1:
                # Lookahead: the next panel goes out before this rank's
                # other updates, which the other ranks need not wait for.
                factor_and_send(q)
    for wait in sends:
        wait()
    return L
