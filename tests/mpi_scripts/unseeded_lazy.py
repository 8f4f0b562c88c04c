"""Rank script, under mpiexec -n 2: ChainerMN's MNIST lines, which seed
nothing and build ``L.Linear(None, n)``, so each rank draws its own first
weights at the first forward pass. The distributed run must take one
process's steps from rank 0's weights on the same global batch: every
rank computes that reference alone, drawing with rank 0's seed. Argument:
the KFAC options as JSON. Prints "rank R: ok"."""
import json
import sys

import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer
import chainer.functions as F
import chainer.links as L
import numpy


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, 6)
            self.l2 = L.Linear(None, 3)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def run(optimizer, seed, rank=0, size=1):
    numpy.random.seed(seed)
    model = L.Classifier(MLP())
    optimizer.setup(model)
    for step in range(10):
        rng = numpy.random.RandomState(100 + step)
        x = rng.randn(8, 5)
        t = rng.randint(0, 3, 8)
        b = 8 // size
        mine = slice(rank * b, (rank + 1) * b)
        optimizer.update(model, x[mine], t[mine])
    return model


chainer.global_config.dtype = numpy.dtype(numpy.float64)
options = json.loads(sys.argv[1])
comm = chainerkfac.create_communicator('naive')
distributed = run(chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(lr=0.1, **options), comm),
    seed=comm.rank, rank=comm.rank, size=comm.size)
alone = run(chainerkfac.optimizers.KFAC(lr=0.1, independent_processes=True,
                                        **options), seed=0)
for (name, p), (_, q) in zip(sorted(distributed.namedparams()),
                             sorted(alone.namedparams())):
    numpy.testing.assert_allclose(p.array, q.array, rtol=1e-9, atol=1e-12,
                                  err_msg=name)
print('rank {}: ok'.format(comm.rank), flush=True)
