"""Rank script, under mpiexec -n 2: ``describe()`` says which rank owns
each K-FAC layer (before the first update: that the first update places
them), and only rank 0 warns at set-up about the links that fall back to
momentum SGD. Prints "rank R: ok"."""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import logging

import chainer.functions as F
import chainer.links as L
import numpy

from tests.rank_checks import MLP


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


records = Records()
logging.getLogger('chainerkfac.fallback').addHandler(records)
comm = chainerkfac.create_communicator('naive')
model = MLP()
model.add_link('emb', L.EmbedID(3, 2))
optimizer = chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(lr=0.1), comm)
optimizer.setup(model)
assert len(records.messages) == (1 if comm.rank == 0 else 0), \
    records.messages
before = optimizer.describe()
assert before.count('; rank set at the first update') == 2, before
x = numpy.arange(12, dtype=numpy.float32).reshape(4, 3)
t = numpy.array([0, 1, 0, 1], dtype=numpy.int32)
optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t), x, t)
after = optimizer.describe()
owners = optimizer.stages.assignment.owners
for block, owner in zip(optimizer.blocks, owners):
    line = next(line for line in after.splitlines()
                if line.strip().startswith(block.name + ' '))
    assert line.endswith('; rank {}'.format(owner)), after
assert sorted(owners) == [0, 1], owners
print('rank {}: ok'.format(comm.rank), flush=True)
