"""Rank script: check_same_structure under mpiexec -n 2.

Identical models pass; a different shape, an extra link and an
uninitialized parameter on rank 1 must each raise the same ValueError on
every rank, naming the parameter and the ranks. Prints "rank R: ok".
"""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer
import chainer.links as L

from chainerkfac.distributed import check_same_structure
from chainerkfac.distributed import create_communicator


class MLP(chainer.Chain):

    def __init__(self, n_in=3, n_hidden=4, extra=False):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, 2)
            if extra:
                self.l3 = L.Linear(2, 2)


def expect_mismatch(comm, link, *fragments):
    try:
        check_same_structure(comm, link)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError('rank {}: no error'.format(comm.rank))
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    print('rank {}: {}'.format(comm.rank, message), flush=True)


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
