"""Rank script: the lines a ChainerMN user writes, under mpiexec -n 2.

``chainermn.create_multi_node_optimizer`` around KFAC (with a ChainerMN or
a chainerkfac communicator) must stop at its first K-FAC update with a
RuntimeError that names chainerkfac.create_multi_node_optimizer, on every
rank, instead of training replicas that drift apart. Prints "rank R: ok".
(chainerkfac.create_multi_node_optimizer with a ChainerMN communicator is
checked against one process in tests/test_multi_node_optimizer.py.)
"""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy


class MLP(chainer.Chain):

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 2)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def expect_refusal(communicator):
    model = MLP()
    optimizer = chainermn.create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(lr=0.1), communicator)
    optimizer.setup(model)
    x = numpy.arange(12, dtype=numpy.float32).reshape(4, 3)
    t = numpy.array([0, 1, 0, 1], dtype=numpy.int32)

    def lossfun(x, t):
        return F.softmax_cross_entropy(model(x), t)

    try:
        for _ in range(2):  # ChainerMN's first update only broadcasts
            optimizer.update(lossfun, x, t)
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError('rank {}: no error'.format(communicator.rank))
    for fragment in ('one of 2 MPI processes',
                     'chainerkfac.create_multi_node_optimizer'):
        assert fragment in message, (fragment, message)
    print('rank {}: {}'.format(communicator.rank, message), flush=True)


expect_refusal(chainermn.create_communicator('naive'))
comm = chainerkfac.create_communicator('naive')
expect_refusal(comm)
print('rank {}: ok'.format(comm.rank), flush=True)
