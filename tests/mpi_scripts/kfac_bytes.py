"""Counts the bytes of every collective on refresh and stale K-FAC steps.

    mpiexec -n N python kfac_bytes.py
    mpiexec -n 3 python kfac_bytes.py --split [--shared]

A stale step must move only gradients: the reduce-scatter-v and the
all-gather-v each carry exactly the gradients of the K-FAC blocks (the
all-gather-v also the step rule's four sums of each part a rank
computes, and per rank its batch size and the digest of its options), and
the allreduce carries the other gradients and the BatchNorm running
statistics.
A refresh step adds the upper triangles of the refreshed factors. Replicas,
running statistics included, stay identical. With ``--split`` two blocks
of :class:`tests.split_model.SplitMLP` are split over the ranks, one with
explicit inverses and one with Cholesky factors: each part with rows or
columns to compute receives the block's gradient, and the owner sends each
other part one flag every step and, when it refreshed the block, what the
part needs: inverse slices, and for the Cholesky form the larger factor's
Cholesky factor (its lower triangle) or, with ``--shared`` (every size
shares the factorization), the part's panels of the larger damped factor,
which the ranks then factor together, each broadcasting its panels. Exits
non-zero on a mismatch.
"""
import sys

import chainerkfac  # NOQA  (NumPy-2 shims before Chainer)
import chainer
import chainer.functions as F
import chainer.links as L
import numpy

from chainerkfac import step_rule
from chainerkfac.curvature import cost
from chainerkfac.distributed import cholesky
from tests import split_model


class CNN(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(2, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 5 * 5, 3)
            self.emb = L.EmbedID(3, 2)

    def forward(self, x, t):
        h = self.fc(F.relu(self.bn(self.conv(x))))
        return F.softmax_cross_entropy(h + F.sum(self.emb(t)) * 0.1, t)


def main():
    comm = chainerkfac.create_communicator('naive')
    model = CNN()
    optimizer = chainerkfac.create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(factor_interval=3, inverse_interval=3),
        comm)
    optimizer.setup(model)
    itemsize = 4
    grads = sum(p.size for b in optimizer.blocks for p in b.params())
    conv_a, conv_g = 2 * 9 + 1, 4
    fc_a, fc_g = 4 * 25 + 1, 3
    triangles = sum(d * (d + 1) // 2 for d in (conv_a, conv_g, fc_a, fc_g))
    bn_diag = 2 * 4
    replicated = model.emb.W.size + 2 * 4  # + avg_mean, avg_var
    reporter = chainer.Reporter()
    rng = numpy.random.RandomState(comm.rank)
    for step in range(1, 5):
        observation = {}
        with reporter.scope(observation):
            optimizer.update(model, rng.randn(6, 2, 5, 5).astype('f'),
                             rng.randint(0, 3, 6).astype('i'))
        refresh = step in (1, 4)
        factors = triangles + bn_diag if refresh else 0
        rates = 5 if refresh else 0  # one change rate per refreshed factor
        expected = {
            'kfac/bytes/reduce_scatter_v': (grads + factors) * itemsize,
            'kfac/bytes/all_gather_v': (
                grads + rates + step_rule.N_TERMS * len(
                    optimizer.stages.assignment.buffer_order())
                + 2 * comm.size) * itemsize,
            'kfac/bytes/allreduce': replicated * itemsize,
        }
        for key, value in expected.items():
            assert observation[key] == value, (step, key, observation[key],
                                               value)
    state = {n: p.array for n, p in model.namedparams()}
    state['avg_mean'] = model.bn.avg_mean
    state['avg_var'] = model.bn.avg_var
    reference = comm.bcast_obj(state if comm.rank == 0 else None)
    for name, value in state.items():
        assert numpy.array_equal(value, reference[name]), name

    optimizer.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
    try:
        optimizer.update(model, rng.randn(6, 2, 5, 5).astype('f'),
                         rng.randint(0, 3, 6).astype('i'))
    except ValueError as error:
        assert 'GradientClipping' in str(error), error
    else:
        raise AssertionError('GradientClipping was not rejected')
    if comm.rank == 0:
        print('bytes ok')


def main_split():
    if '--shared' in sys.argv:
        cost.SHARED_FACTORIZATION_MIN_DIM = 1
    comm = chainerkfac.create_communicator('naive')
    numpy.random.seed(0)
    model = split_model.SplitMLP(36, hidden=(50, 120))
    optimizer = chainerkfac.create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(factor_interval=3, inverse_interval=3),
        comm, max_load_imbalance=1.0)
    optimizer.setup(model)
    itemsize = 4
    reporter = chainer.Reporter()
    rng = numpy.random.RandomState(comm.rank)
    for step in range(1, 5):
        observation = {}
        with reporter.scope(observation):
            optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                             rng.randn(6, 36).astype('f'),
                             rng.randint(0, 3, 6).astype('i'))
        stages = optimizer.stages
        assignment = stages.assignment
        splits = stages.split.splits
        forms = [splits[i].explicit for i in assignment.split_blocks]
        assert forms == [True, False], (forms, assignment)
        refresh = step in (1, 4)
        scattered = sent = broadcast = 0
        # The step rule's sums of every part; each rank's batch size and
        # options digest.
        gathered = step_rule.N_TERMS * len(assignment.buffer_order()) \
            + 2 * comm.size
        if step == 1:
            # The parameters of rank 0, broadcast before the first update.
            broadcast += sum(p.size for p in model.params())
        for i, block in enumerate(optimizer.blocks):
            grad = block.gradient().size
            d_a, d_g = block.dims()
            layout = splits.get(i)
            bounds = [(0, 1)] if layout is None else layout.bounds
            scattered += grad * sum(stop > start for start, stop in bounds)
            gathered += grad
            if refresh:
                scattered += d_a * (d_a + 1) // 2 + d_g * (d_g + 1) // 2
                gathered += 2
            shared = refresh and layout is not None and \
                not layout.explicit and max(
                    d_a, d_g) >= cost.SHARED_FACTORIZATION_MIN_DIM
            if shared:
                # The ranks factoring the larger damped factor together.
                ranks = layout.factor_ranks()
                dim = max(d_a, d_g)

                def panels(rank):
                    return sum(h * w for h, w in cholesky.panel_shapes(
                        dim, ranks, rank).values())

                # Each of them broadcasts its panels to the others.
                if comm.rank in ranks:
                    broadcast += panels(comm.rank) * (len(ranks) - 1)
            if assignment.owners[i] != comm.rank:
                continue
            for s, rank in enumerate(assignment.shards[i]):
                if s == 0 or layout.empty(s):
                    continue
                sent += 1
                if not refresh:
                    continue
                for shape, triangular in zip(layout.part_shapes(s),
                                             layout.triangular()):
                    if not triangular:
                        sent += int(numpy.prod(shape))
                    elif shared:  # the part's panels instead
                        sent += panels(rank)
                    else:  # its lower triangle
                        sent += shape[0] * (shape[0] + 1) // 2
        expected = {
            'kfac/bytes/reduce_scatter_v': scattered * itemsize,
            'kfac/bytes/all_gather_v': gathered * itemsize,
            'kfac/bytes/alltoall_v': sent * itemsize,
            'kfac/bytes/bcast': broadcast * itemsize,
        }
        for key, value in expected.items():
            assert observation[key] == value, (step, key, observation[key],
                                               value)
    if comm.rank == 0:
        print('split bytes ok' + (' (shared)' if '--shared' in sys.argv
                                  else ''))


if __name__ == '__main__':
    main_split() if '--split' in sys.argv else main()
