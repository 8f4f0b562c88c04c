"""Trains a small CNN with K-FAC on a fixed global batch; writes the result.

    mpiexec -n N python kfac_equivalence.py OUT.npz [--batch-norm]
    python kfac_equivalence.py OUT.npz --single [--acc-iters N] [--batch-norm]
    ... [--mlp [H1,H2]] [--max-load-imbalance X] [--min-shared-dim D]
    ... [--every-step | --inverse-interval N]
    ... [--device @cupy:0] [--communicator pure_nccl]
    ... [--float16] [--transport-dtype float16] [--conv-factors reduced]
    ... [--doubly-factored-from 16]   (fc1's 4 x 2 x 2 input: Ψ ⊗ K ⊗ G)
    ... [--lr 0.05]

The bound on the KL change is on, at a bound it reaches on most steps; its
scale per step is saved with the parameters (``update_scale``).
Each rank takes its contiguous shard of every global batch, so N ranks with
per-rank batch b see exactly the samples one process sees with batch N b.
With ``--batch-norm`` the CNN normalises each rank's batch on its own; one
process reproduces that with ``--acc-iters N``, which runs the N shards as
micro-batches. Rank 0 writes the parameters; every rank checks that its
replica is identical to rank 0's. ``--mlp`` trains
:class:`tests.split_model.SplitMLP` instead, whose blocks the distributed
runs split over ranks; rank 0 then prints the parts of every block as
JSON (``parts: {...}``: ranks, bounds and the form of the inverses).
``--min-shared-dim`` lowers the size from which the ranks of a split block
share its Cholesky factorization, so that small models take that path.
``--float16`` trains the CNN in float16 at a static loss scale of 1024;
``--transport-dtype float16`` sends factors and gradients as float16.
"""
import argparse
import json

import chainerkfac  # NOQA  (NumPy-2 shims before Chainer)
import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy

from chainerkfac import schedules
from chainerkfac.curvature import cost
from tests import split_model

GLOBAL_BATCH = 24  # divisible by 2, 3 and 4 ranks
STEPS = 7


class CNN(chainer.Chain):
    def __init__(self, batch_norm=False, dtype=numpy.float64):
        super().__init__()
        with chainer.using_config('dtype', dtype), self.init_scope():
            self.conv1 = L.Convolution2D(2, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4) if batch_norm else None
            self.conv2 = L.Convolution2D(4, 4, 3, stride=2, nobias=True)
            self.fc1 = L.Linear(16, 8)
            self.fc2 = L.Linear(8, 3)
            self.emb = L.EmbedID(3, 2)  # outside K-FAC: plain momentum SGD

    def forward(self, x, t):
        h = self.conv1(x)
        if self.bn is not None:
            h = self.bn(h)
        h = F.relu(self.conv2(F.relu(h)))
        h = self.fc2(F.tanh(self.fc1(h))) + F.sum(self.emb(t)) * 0.1
        return F.softmax_cross_entropy(h, t)


class MLP(split_model.SplitMLP):
    def __init__(self, hidden):
        with chainer.using_config('dtype', numpy.float64):
            super().__init__(2 * 6 * 6, hidden=hidden)

    def forward(self, x, t):
        return F.softmax_cross_entropy(super().forward(x), t)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('out')
    parser.add_argument('--single', action='store_true')
    parser.add_argument('--inverse', default='cholesky')
    parser.add_argument('--acc-iters', type=int, default=1)
    parser.add_argument('--batch-norm', action='store_true')
    parser.add_argument('--mlp', nargs='?', const='50,80', default=None,
                        metavar='H1,H2', help='SplitMLP and its hidden widths')
    parser.add_argument('--max-load-imbalance', default='1.1',
                        help="a number, or 'none': one rank per block")
    parser.add_argument('--every-step', action='store_true',
                        help='refresh factors and inverses every step')
    parser.add_argument('--inverse-interval', type=int, default=3)
    parser.add_argument('--device', default='@numpy',
                        help='Chainer device of the model and batches')
    parser.add_argument('--communicator', default='naive')
    parser.add_argument('--chainermn', action='store_true',
                        help="ChainerMN's communicator of that name, as a "
                        'ChainerMN user creates it')
    parser.add_argument('--min-shared-dim', type=int, default=None)
    parser.add_argument('--float16', action='store_true')
    parser.add_argument('--transport-dtype', default=None)
    parser.add_argument('--step-rule', default='kl_graft')
    parser.add_argument('--kl-clip', type=float, default=1e-5)
    parser.add_argument('--conv-factors', default='expanded')
    parser.add_argument('--doubly-factored-from', type=int, default=None)
    parser.add_argument('--lr', type=float, default=0.05)
    args = parser.parse_args()
    if args.min_shared_dim is not None:
        cost.SHARED_FACTORIZATION_MIN_DIM = args.min_shared_dim
    device = chainer.get_device(args.device)
    device.use()
    numpy.random.seed(0)
    dtype = numpy.float16 if args.float16 else numpy.float64
    model = (MLP(tuple(int(h) for h in args.mlp.split(',')))
             if args.mlp else CNN(args.batch_norm, dtype))
    optimizer = chainerkfac.optimizers.KFAC(
        lr=args.lr, momentum=0.9, damping=1e-2, cov_ema_decay=0.8,
        inverse=args.inverse, weight_decay=1e-3,
        factor_interval=1 if args.every_step else {
            'A': schedules.Adaptive(threshold=0.3), 'G': 2},
        inverse_interval=1 if args.every_step else args.inverse_interval,
        acc_iters=args.acc_iters, kl_clip=args.kl_clip,
        step_rule=args.step_rule, conv_factors=args.conv_factors,
        doubly_factored_from=args.doubly_factored_from)
    if args.float16:
        optimizer.loss_scaling(scale=1024)
    rank, size = 0, 1
    if not args.single:
        comm = (chainermn.create_communicator(args.communicator)
                if args.chainermn
                else chainerkfac.create_communicator(
                    args.communicator, transport_dtype=args.transport_dtype))
        rank, size = comm.rank, comm.size
        # Different initial weights on other ranks: setup must broadcast.
        if rank:
            for p in model.params():
                p.array[...] = 7.0
        optimizer = chainerkfac.create_multi_node_optimizer(
            optimizer, comm, max_load_imbalance=(
                None if args.max_load_imbalance == 'none'
                else float(args.max_load_imbalance)))
    optimizer.setup(model.to_device(device))
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    b = GLOBAL_BATCH // size
    reporter, scales = chainer.Reporter(), []
    for step in range(STEPS):
        rng = numpy.random.RandomState(step)
        x = rng.randn(GLOBAL_BATCH, 2, 6, 6).astype(dtype)
        t = rng.randint(0, 3, GLOBAL_BATCH).astype(numpy.int32)
        observation = {}
        with reporter.scope(observation):
            optimizer.update(model, device.send(x[rank * b:(rank + 1) * b]),
                             device.send(t[rank * b:(rank + 1) * b]))
        scales.append(observation['kfac/update_scale'])
    host = chainer.backend.CpuDevice().send
    params = {n: host(p.array) for n, p in model.namedparams()}
    # The bound's scale of every step: the same on every rank.
    params['update_scale'] = numpy.asarray(scales)
    if args.batch_norm and not args.single:
        # Averaged over ranks every step: the replicas agree on them too.
        params['avg_mean'] = host(model.bn.avg_mean)
    if not args.single:
        reference = comm.bcast_obj(params if rank == 0 else None)
        for name, value in params.items():
            assert numpy.array_equal(value, reference[name],
                                     equal_nan=True), \
                'rank {} replica differs in {}'.format(rank, name)
    if rank == 0:
        numpy.savez(args.out, **params)
        if not args.single:
            stages = optimizer.stages
            splits = stages.split.splits

            def layout(i):
                if i not in splits:
                    return [None, None]
                return [splits[i].bounds,
                        'explicit' if splits[i].explicit else 'cholesky']

            print('parts: ' + json.dumps({
                block.name: [stages.assignment.shards[i]] + layout(i)
                for i, block in enumerate(optimizer.blocks)}), flush=True)


if __name__ == '__main__':
    main()
