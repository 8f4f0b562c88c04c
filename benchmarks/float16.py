"""K-FAC on a half-precision model against the same model in float32
(issue #24).

    PYTHONPATH=. .venv/bin/python benchmarks/float16.py

The digits CNN with BatchNorm of :mod:`convergence_suite` (``cnn_bn``),
batch 64, ``KFAC(lr=0.03, momentum=0.9)`` with its defaults but factors
refreshed every step, 300 steps,
the same initial weights and batches for each precision: float32; float16
parameters and activations at a static loss scale of 1024 and with
Chainer's dynamic loss scaling; ``chainer.mixed16`` (float32 parameters,
float16 activations) at both. K-FAC keeps its statistics, factors,
inverses and preconditioned gradients in float32 whatever the model's
dtype. Reports each run's final validation accuracy and loss, its
difference from float32 (the goal: within 1 point), the steps skipped and
the final loss scale. Writes ``results/float16.json``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.functions as F
import chainer.links as L
import numpy

import convergence_suite
import harness

ITERATIONS = 300
BATCH = 64
LR = 0.03

#: name: (the model's dtype config, loss scale: None, a number, 'dynamic').
RUNS = {
    'float32': (numpy.float32, None),
    'float16, loss scale 1024': (numpy.float16, 1024),
    'float16, dynamic loss scale': (numpy.float16, 'dynamic'),
    'mixed16, loss scale 1024': (chainer.mixed16, 1024),
    'mixed16, dynamic loss scale': (chainer.mixed16, 'dynamic'),
}


def train(dtype, loss_scale, data, seed=0):
    (x, y), (x_val, y_val) = data
    half = dtype != numpy.float32
    if half:
        x, x_val = x.astype(numpy.float16), x_val.astype(numpy.float16)
    numpy.random.seed(seed)
    with chainer.using_config('dtype', dtype):
        model = L.Classifier(convergence_suite.VGG(True))
    optimizer = chainerkfac.optimizers.KFAC(lr=LR, momentum=0.9,
                                            factor_interval=1)
    optimizer.setup(model)
    if loss_scale == 'dynamic':
        optimizer.loss_scaling()
    elif loss_scale is not None:
        optimizer.loss_scaling(scale=loss_scale)
    rng = numpy.random.RandomState(seed)
    skipped = 0
    with chainer.using_config('dtype', dtype):
        for _ in range(ITERATIONS):
            idx = rng.choice(len(x), BATCH, replace=False)
            observation = {}
            with chainer.Reporter().scope(observation):
                optimizer.update(
                    lambda x, t: F.softmax_cross_entropy(model.predictor(x),
                                                         t), x[idx], y[idx])
            skipped += observation['kfac/skipped_steps']
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            scores = model.predictor(x_val)
            accuracy = float(F.accuracy(scores, y_val).array)
            loss = float(F.softmax_cross_entropy(
                F.cast(scores, numpy.float32), y_val).array)
    return {'val_accuracy': accuracy, 'val_loss': loss, 'skipped': skipped,
            'final_loss_scale': optimizer._loss_scale}


def main():
    harness.limit_threads(1)
    data = convergence_suite.load_digits()
    runs = {name: train(dtype, scale, data)
            for name, (dtype, scale) in RUNS.items()}
    reference = runs['float32']['val_accuracy']
    rows = []
    for name, run in runs.items():
        run['points_from_float32'] = 100 * (run['val_accuracy'] - reference)
        rows.append([name, '{:.3f}'.format(run['val_accuracy']),
                     '{:+.1f}'.format(run['points_from_float32']),
                     '{:.3f}'.format(run['val_loss']), str(run['skipped']),
                     '{:g}'.format(run['final_loss_scale'] or 1)])
    print(harness.table(rows, ['precision', 'val. accuracy', 'points',
                               'val. loss', 'skipped', 'loss scale']))
    result = {'environment': harness.environment(), 'model': 'cnn_bn',
              'iterations': ITERATIONS, 'batch': BATCH, 'lr': LR,
              'goal': 'within 1 point of float32', 'runs': runs,
              'met': all(abs(r['points_from_float32']) <= 1
                         for r in runs.values())}
    print('written', harness.write_json('float16.json', result))


if __name__ == '__main__':
    main()
