"""Runs K-FAC steps [start, stop) of a fixed run; used by test_serialization.

    python resume_run.py START STOP OUT [--resume SNAPSHOT]
    mpiexec -n N python resume_run.py START STOP OUT --distributed [...]
    ... [--mlp]   (tests.split_model.SplitMLP, its blocks split over ranks)

The model, data and optimizer settings are fixed, so runs that cover the same
steps must end in the same state. Writes the model and optimizer to OUT.npz;
distributed, every rank writes (and resumes from) its own OUT.rankR.npz,
since each rank keeps the curvature of the blocks it owns.
"""
import argparse

import chainerkfac  # NOQA  (NumPy-2 shims before Chainer)
import chainer
import chainer.functions as F
import chainer.links as L
import numpy

from chainerkfac import schedules
from tests import split_model


class CNN(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(1, 4, 3, pad=1,
                                        initialW=chainer.initializers.HeNormal(
                                            rng=numpy.random.RandomState(1)))
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 6 * 6, 3,
                               initialW=chainer.initializers.HeNormal(
                                   rng=numpy.random.RandomState(2)))

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


def make_optimizer(inverse, step_rule, kl_clip, inverse_delay=0,
                   doubly_factored_from=None, lr=0.05):
    return chainerkfac.optimizers.KFAC(
        lr=lr, momentum=0.9, cov_ema_decay=0.9, inverse=inverse,
        step_rule=step_rule, kl_clip=kl_clip, inverse_delay=inverse_delay,
        doubly_factored_from=doubly_factored_from,
        factor_interval={'A': schedules.Adaptive(threshold=0.2),
                         'G': lambda t: 1 if t < 4 else 2},
        inverse_interval=3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('start', type=int)
    parser.add_argument('stop', type=int)
    parser.add_argument('out')
    parser.add_argument('--resume')
    parser.add_argument('--resume-rank', type=int,
                        help='every rank loads this rank\'s file')
    parser.add_argument('--inverse', default='cholesky')
    parser.add_argument('--distributed', action='store_true')
    parser.add_argument('--mlp', action='store_true')
    parser.add_argument('--inverse-delay', type=int, default=0)
    parser.add_argument('--doubly-factored-from', type=int, default=None)
    parser.add_argument('--double', action='store_true',
                        help='a float64 model and data')
    parser.add_argument('--step-rule', default='kl_graft')
    parser.add_argument('--kl-clip', type=float, default=None)
    parser.add_argument('--lr', type=float, default=0.05)
    args = parser.parse_args()
    numpy.random.seed(0)  # SplitMLP's default initializers draw from it
    dtype = numpy.float64 if args.double else numpy.float32
    with chainer.using_config('dtype', dtype):
        model = split_model.SplitMLP(36) if args.mlp else CNN()
    optimizer = make_optimizer(args.inverse, args.step_rule, args.kl_clip,
                               args.inverse_delay, args.doubly_factored_from,
                               lr=args.lr)
    rank, size, suffix = 0, 1, ''
    if args.distributed:
        comm = chainerkfac.create_communicator('naive')
        rank, size, suffix = comm.rank, comm.size, '.rank{}'.format(comm.rank)
        optimizer = chainerkfac.create_multi_node_optimizer(
            optimizer, comm, max_load_imbalance=1.0 if args.mlp else 1.1)
    optimizer.setup(model)
    if args.resume:
        # Its own file, or, on another number of processes, those
        # chainerkfac.snapshot_files gives it: the first whole, the others
        # into the optimizer only.
        paths = chainerkfac.snapshot_files(args.resume, rank, size) \
            if args.resume_rank is None else \
            ['{}.rank{}.npz'.format(args.resume, args.resume_rank)]
        for i, path in enumerate(paths):
            state = numpy.load(path)
            if i == 0:
                chainer.serializers.NpzDeserializer(
                    state, path='model/').load(model)
            chainer.serializers.NpzDeserializer(
                state, path='optimizer/').load(optimizer)
        assert optimizer.t == args.start, optimizer.t
    for step in range(args.start, args.stop):
        rng = numpy.random.RandomState(100 + step)
        x = rng.randn(6, 1, 6, 6).astype(dtype)
        t = rng.randint(0, 3, 6)
        b = 6 // size
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         x[rank * b:(rank + 1) * b],
                         t[rank * b:(rank + 1) * b])
    target = {}
    chainer.serializers.DictionarySerializer(target, path='model/').save(model)
    chainer.serializers.DictionarySerializer(
        target, path='optimizer/').save(optimizer)
    numpy.savez(args.out + suffix, **target)


if __name__ == '__main__':
    main()
