"""Rank script, under mpiexec -n 2: a lazily initialised head that the
forward pass does not call at first gets no curvature, costs nothing and
breaks nothing; once called it gets its shape and its curvature. The
distributed run equals one process on the same global batch (a reference
that every rank computes alone, ``independent_processes=True``), in
float64. Prints "rank R: ok"."""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer
import chainer.functions as F
import chainer.links as L
import numpy


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        self.use_aux = False
        with self.init_scope():
            self.l1 = L.Linear(3, 5)
            self.l2 = L.Linear(None, 2)
            self.aux = L.Linear(None, 2)

    def forward(self, x):
        h = F.tanh(self.l1(x))
        y = self.l2(h)
        return y + self.aux(h) if self.use_aux else y


def run(optimizer, rank=0, size=1):
    numpy.random.seed(0)
    model = Net()
    optimizer.setup(model)
    for step in range(6):
        model.use_aux = step >= 3
        rng = numpy.random.RandomState(step)
        x, t = rng.randn(8, 3), rng.randint(0, 2, 8)
        b = 8 // size
        mine = slice(rank * b, (rank + 1) * b)
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         x[mine], t[mine])
        if step == 2:
            assert 'aux' in optimizer.describe()
            aux = next(b for b in optimizer.blocks if b.name == 'aux')
            assert not aux.shaped() and not aux.holds_curvature()
    return model


# Lazily initialised layers take the dtype in force at their first call.
chainer.global_config.dtype = numpy.dtype(numpy.float64)
comm = chainerkfac.create_communicator('naive')
distributed = run(chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(lr=0.1), comm), comm.rank, comm.size)
alone = run(chainerkfac.optimizers.KFAC(lr=0.1, independent_processes=True))
for (name, p), (_, q) in zip(sorted(distributed.namedparams()),
                             sorted(alone.namedparams())):
    numpy.testing.assert_allclose(p.array, q.array, rtol=1e-10, atol=1e-12,
                                  err_msg=name)
print('rank {}: ok'.format(comm.rank), flush=True)
