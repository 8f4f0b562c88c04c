"""Rank script: Polyak averaging under mpiexec -n 2, every rank the same.

    mpiexec -n 2 python polyak_averaging.py sgd|kfac

``sgd``: MomentumSGD under ``chainermn.create_multi_node_optimizer`` (a
ChainerMN communicator), which leaves each rank its own BatchNorm running
statistics; ``kfac``: K-FAC under ``chainerkfac.create_multi_node_optimizer``
(a chainerkfac communicator), which averages them every step. Each rank
trains on its own batches, folds the weights into a
:class:`chainerkfac.PolyakAveraging` with ``comm`` after every step, and
checks: every rank's averages equal rank 0's bit for bit; the parameters'
average is the debiased EMA of the recorded weights, and the statistics'
that of the ranks' mean statistics (computed here by hand); an
``AveragedEvaluator`` under ``chainermn.create_multi_node_evaluator``
reports the same numbers on every rank. Prints "rank R: ok".
"""
import sys

import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer
import chainer.links as L
import chainermn
import numpy

from tests.rank_checks import BatchNormMLP

DECAY = 0.8
STEPS = 6


def arrays(model):
    """``{name: copy}`` of what the average covers."""
    out = {name: p.array.copy() for name, p in model.namedparams()}
    out['/predictor/bn/avg_mean'] = model.predictor.bn.avg_mean.copy()
    out['/predictor/bn/avg_var'] = model.predictor.bn.avg_var.copy()
    return out


def main(name):
    if name == 'sgd':
        comm = chainermn.create_communicator('naive')
        optimizer = chainermn.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.1), comm)
    else:
        comm = chainerkfac.create_communicator('naive')
        optimizer = chainerkfac.create_multi_node_optimizer(
            chainerkfac.optimizers.KFAC(lr=0.1), comm)
    numpy.random.seed(0)
    model = L.Classifier(BatchNormMLP())
    optimizer.setup(model)
    averaging = chainerkfac.PolyakAveraging(model, DECAY, comm)
    rng = numpy.random.RandomState(comm.rank)
    recorded = []
    for _ in range(STEPS):
        x = rng.randn(8, 3).astype(numpy.float32) + comm.rank
        t = rng.randint(0, 2, 8).astype(numpy.int32)
        optimizer.update(model, x, t)
        averaging.update()
        recorded.append(comm.mpi_comm.allgather(arrays(model)))

    mine = {k: v.copy() for k, v in averaging._averages.items()}
    ranks = comm.mpi_comm.allgather(mine)
    for key in mine:
        numpy.testing.assert_array_equal(ranks[0][key], mine[key],
                                         err_msg=key)
    statistics = ('/predictor/bn/avg_mean', '/predictor/bn/avg_var')
    last = recorded[-1]
    live_differ = any(not numpy.array_equal(last[0][k], last[1][k])
                      for k in statistics)
    # ChainerMN leaves the statistics per rank (what makes comm needed);
    # chainerkfac's stages average them.
    assert live_differ == (name == 'sgd'), live_differ
    for key in mine:
        z = 0.0
        for step in recorded:
            if key not in statistics:
                # Parameters are the same on every rank.
                numpy.testing.assert_array_equal(step[0][key], step[1][key])
            z = DECAY * z + (1 - DECAY) * numpy.mean(
                [step[r][key].astype(numpy.float64) for r in range(2)],
                axis=0)
        numpy.testing.assert_allclose(mine[key], z / (1 - DECAY ** STEPS),
                                      rtol=1e-5, atol=1e-6, err_msg=key)

    data = chainer.datasets.TupleDataset(
        rng.randn(8, 3).astype(numpy.float32),
        rng.randint(0, 2, 8).astype(numpy.int32))
    evaluator = chainermn.create_multi_node_evaluator(
        chainerkfac.AveragedEvaluator(
            averaging, chainer.iterators.SerialIterator(
                data, 8, repeat=False, shuffle=False), model), comm)
    result = evaluator()
    results = comm.mpi_comm.allgather(result)
    assert results[0] == results[1], results
    assert set(result) == {'main/loss', 'main/accuracy'}, result
    print('rank {}: ok'.format(comm.rank), flush=True)


main(sys.argv[1])
