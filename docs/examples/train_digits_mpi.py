"""Distributed K-FAC on scikit-learn's bundled digits.

    mpiexec -n 2 python docs/examples/train_digits_mpi.py [--epochs 5]
        [--batchsize 64] [--out result/digits_mpi] [--resume SNAPSHOT]

The single-process example (train_digits.py) with the four changes ChainerMN
asks for: a communicator, a multi-node optimizer, a scattered dataset and a
multi-node evaluator. ``--batchsize`` is per process: the global mini-batch
is ``batchsize x number of processes``.

Each process saves its own snapshot every epoch,
``OUT/snapshot_epoch_<E>.rank<R>``, because each process keeps the K-FAC
factors of the layers it owns. ``--resume OUT/snapshot_epoch_<E>`` makes
every process load its own file, or, started on another number of
processes, the files ``chainerkfac.load_snapshot`` gives it.
"""
import argparse

import chainerkfac  # first: makes Chainer 7.8.1 import on NumPy 2
import chainer
import chainer.links as L
import chainermn
from chainer import training
from chainer.training import extensions
# The single-process example's model and data (this script's folder).
from train_digits import CNN, digits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--epochs', type=int, default=5)
    parser.add_argument('--batchsize', type=int, default=64,
                        help='images per process')
    parser.add_argument('--out', default='result/digits_mpi')
    parser.add_argument('--resume', help='OUT/snapshot_epoch_<E>')
    args = parser.parse_args()

    # 'naive': MPI on NumPy arrays. On GPUs use 'pure_nccl' and
    # chainer.cuda.get_device_from_id(comm.intra_rank).use().
    comm = chainerkfac.create_communicator('naive')

    # Rank 0 loads the data; scatter_dataset gives every rank its shard.
    train, test = digits() if comm.rank == 0 else (None, None)
    train = chainermn.scatter_dataset(train, comm, shuffle=True)
    test = chainermn.scatter_dataset(test, comm)

    model = L.Classifier(CNN())
    optimizer = chainerkfac.create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(lr=0.1, momentum=0.9), comm)
    optimizer.setup(model)  # also broadcasts rank 0's initial weights
    if comm.rank == 0:
        print(optimizer.describe())

    train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(
        test, len(test), repeat=False, shuffle=False)
    updater = training.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (args.epochs, 'epoch'), out=args.out)
    # Each rank evaluates its shard; the results are averaged over ranks.
    trainer.extend(chainermn.create_multi_node_evaluator(
        extensions.Evaluator(test_iter, model), comm))
    # One snapshot per rank: every rank holds the factors of its own layers.
    trainer.extend(extensions.snapshot(
        filename='snapshot_epoch_{.updater.epoch}.rank%d' % comm.rank),
        trigger=(1, 'epoch'))
    if comm.rank == 0:
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'validation/main/loss',
             'validation/main/accuracy', 'kfac/bytes/reduce_scatter_v',
             'elapsed_time']))
    if args.resume:
        chainerkfac.load_snapshot(args.resume, trainer, optimizer, comm)
    trainer.run()


if __name__ == '__main__':
    main()
