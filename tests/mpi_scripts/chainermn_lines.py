"""Rank script: the lines a ChainerMN user writes, under mpiexec -n 2.

``chainermn.create_multi_node_optimizer`` around KFAC (with a ChainerMN or
a chainerkfac communicator) must stop at its first K-FAC update with a
RuntimeError that names chainerkfac.create_multi_node_optimizer and the
opt-out, on every rank, instead of training replicas that drift apart; with
the opt-out (``independent_processes=True``) every rank trains its own
model, and create_multi_node_optimizer refuses such a KFAC by name. Prints
"rank R: ok".
(chainerkfac.create_multi_node_optimizer with a ChainerMN communicator is
checked against one process in tests/test_multi_node_optimizer.py.)
"""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer.functions as F
import chainermn
import numpy

from tests import rank_checks
from tests.rank_checks import MLP


def expect_refusal(communicator):
    model = MLP()
    optimizer = chainermn.create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(lr=0.1), communicator)
    optimizer.setup(model)
    x = numpy.arange(12, dtype=numpy.float32).reshape(4, 3)
    t = numpy.array([0, 1, 0, 1], dtype=numpy.int32)

    def two_updates():  # ChainerMN's first update only broadcasts
        for _ in range(2):
            optimizer.update(
                lambda x, t: F.softmax_cross_entropy(model(x), t), x, t)

    rank_checks.expect_error(
        communicator, RuntimeError, two_updates, 'one of 2 MPI processes',
        'chainerkfac.create_multi_node_optimizer',
        'independent_processes=True')


def independent_runs(communicator):
    """Each rank trains its own model on its own data: no collective."""
    model = MLP()
    optimizer = chainerkfac.optimizers.KFAC(lr=0.1,
                                            independent_processes=True)
    optimizer.setup(model)
    rng = numpy.random.RandomState(communicator.rank)
    for _ in range(3):
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         rng.randn(4, 3).astype(numpy.float32),
                         rng.randint(0, 2, 4))
    assert optimizer.t == 3 and all(b.ready() for b in optimizer.blocks)
    rank_checks.expect_error(
        communicator, ValueError,
        lambda: chainerkfac.create_multi_node_optimizer(
            chainerkfac.optimizers.KFAC(independent_processes=True),
            communicator), 'independent_processes=True')


expect_refusal(chainermn.create_communicator('naive'))
comm = chainerkfac.create_communicator('naive')
expect_refusal(comm)
independent_runs(comm)
print('rank {}: ok'.format(comm.rank), flush=True)
