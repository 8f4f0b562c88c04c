"""Rank script: Cholesky factors computed by groups of ranks.

Usage: mpiexec -n 3 python shared_cholesky.py

Every rank builds every matrix from seeds. Groups of one to three ranks,
in several orders and with a rank left out of some, factor matrices with
several panels per rank, with fewer panels than ranks, and a singular one
(whose shared factorization fails at a later panel and falls back to the
owner's damped factorization); each result is compared with LAPACK's
factor of the whole matrix on one rank, and the bytes each rank sent with
its panels. Prints "rank R: ok".
"""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer
import numpy
from numpy.testing import assert_allclose

from chainerkfac import linalg
from chainerkfac.distributed import cholesky
from chainerkfac.distributed import create_communicator


def spd(seed, dim, rank, dtype):
    X = numpy.random.default_rng(seed).standard_normal((dim, rank))
    return (X @ X.T / rank + 1e-3 * numpy.eye(dim) * (rank >= dim)).astype(
        dtype)


# (ranks, dim, columns of the random product, dtype, rtol)
CASES = [
    ([0, 1, 2], 300, 320, numpy.float64, 1e-10),
    ([2, 0], 200, 220, numpy.float64, 1e-10),
    ([1, 0, 2], 70, 80, numpy.float64, 1e-10),  # 2 panels, 3 ranks
    ([1], 50, 60, numpy.float64, 1e-12),
    ([0, 1, 2], 300, 320, numpy.float32, 1e-3),
    # Rank 140 of 200: the fifth of six panels (columns 133-166, rank 2's)
    # is the first that is not positive definite.
    ([0, 2, 1], 200, 140, numpy.float64, 1e-10),
]


def main():
    comm = create_communicator('naive')
    assert comm.size == 3
    for seed, (ranks, dim, cols, dtype, rtol) in enumerate(CASES):
        M = spd(seed, dim, cols, dtype)
        if comm.rank not in ranks:
            continue
        comm.reset_bytes_moved()
        fallback = []

        def alone():
            fallback.append(True)
            return linalg.damped_cholesky(M, 0.0)

        mine = cholesky.lower_panels(M, ranks, comm.rank)
        before = M.copy()
        L = cholesky.shared_cholesky(comm, ranks, dim, mine, M, alone)
        numpy.testing.assert_array_equal(M, before)
        assert L.dtype == dtype and L.flags.f_contiguous
        assert bool(fallback) == (cols < dim and comm.rank == ranks[0])
        expected = (linalg.damped_cholesky(M, 0.0) if cols < dim
                    else numpy.linalg.cholesky(M.astype(numpy.float64)))
        assert_allclose(L, expected, rtol=0,
                        atol=rtol * numpy.abs(expected).max())
        # Each rank sent its panels once to each other rank of the group.
        bounds = cholesky.panel_bounds(dim, len(ranks))
        sent = sum((dim - bounds[p][0]) * (bounds[p][1] - bounds[p][0])
                   for p in cholesky.panels_of(dim, ranks, comm.rank))
        if cols >= dim:
            assert comm.reset_bytes_moved()['bcast'] == (
                sent * (len(ranks) - 1) * numpy.dtype(dtype).itemsize)
    print('rank {}: ok'.format(comm.rank))


if __name__ == '__main__':
    main()
