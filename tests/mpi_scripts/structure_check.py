"""Rank script: check_same_structure under mpiexec -n 2.

Identical models pass; a different shape, an extra link and an
uninitialized parameter on rank 1 must each raise the same ValueError on
every rank, naming the parameter and the ranks. Prints "rank R: ok".
"""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

from chainerkfac.distributed import check_same_structure
from chainerkfac.distributed import create_communicator
from tests import rank_checks
from tests.rank_checks import MLP


def expect_mismatch(comm, link, *fragments):
    rank_checks.expect_error(
        comm, ValueError, lambda: check_same_structure(comm, link),
        *fragments)


comm = create_communicator('naive')
assert comm.size == 2
odd = comm.rank == 1
check_same_structure(comm, MLP())
expect_mismatch(comm, MLP(n_hidden=5 if odd else 4),
                "parameter '/l1/W'", 'shape (4, 3) float32 on rank 0',
                'shape (5, 3) float32 on rank 1')
expect_mismatch(comm, MLP(extra=odd),
                "parameter '/l3/W'", 'missing on rank 0',
                'shape (2, 2) float32 on rank 1')
expect_mismatch(comm, MLP(n_in=None if odd else 3),
                "parameter '/l1/W'", 'uninitialized on rank 1')
print('rank {}: ok'.format(comm.rank), flush=True)
