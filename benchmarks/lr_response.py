"""Does the learning rate set the step? Update norms against MomentumSGD.

    PYTHONPATH=. .venv/bin/python benchmarks/lr_response.py

On the convergence suite's five models (scikit-learn digits, batch 64,
momentum 0.9), each optimizer trains ``--steps`` updates from the same
weights on the same batches three times: at lr 0.1, at lr 0.01, and at lr
0.1 decayed linearly to 0 over the run. Reported per model and optimizer:
the mean update norm ``‖w_t − w_{t−1}‖`` at 0.1 over that at 0.01, and the
mean of the last 10 updates of the decayed run over those of the run at
0.1 (MomentumSGD: about 10 and well below 1). The goal (issue #33): K-FAC's
ratios within 1.5x of MomentumSGD's. Writes ``results/lr_response.json``,
as its variant ``--name`` (the default one without it).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import numpy

import convergence_suite
import harness

#: name -> K-FAC options; ``momentum_sgd`` is MomentumSGD.
OPTIMIZERS = {
    'momentum_sgd': None,
    'kfac': {},
}


def update_norms(model_name, options, lr_at, steps, seed, data):
    """The update norm of every step, the lr set to ``lr_at(t)`` first."""
    model, (x, y), _ = convergence_suite.classifier(model_name, data, seed)
    optimizer = chainer.optimizers.MomentumSGD(momentum=0.9) \
        if options is None else chainerkfac.optimizers.KFAC(
            momentum=0.9, **options)
    optimizer.setup(model)
    rng = numpy.random.RandomState(seed)
    norms = []
    for t in range(steps):
        optimizer.lr = lr_at(t)
        idx = rng.choice(len(x), 64, replace=False)
        before = [p.array.copy() for p in model.params()]
        optimizer.update(model, x[idx], y[idx])
        norms.append(float(numpy.sqrt(sum(
            ((p.array - b) ** 2).sum()
            for p, b in zip(model.params(), before)))))
    return numpy.asarray(norms)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(
        convergence_suite.MODELS))
    parser.add_argument('--steps', type=int, default=40)
    parser.add_argument('--seeds', type=int, default=3)
    harness.add_name_option(parser, 'lr_response')
    parser.add_argument('--variants', default=None,
                        help='K-FAC variants as JSON {name: options} '
                        'instead of the defaults')
    args = parser.parse_args()
    harness.limit_threads(1)
    optimizers = dict(OPTIMIZERS)
    if args.variants:
        optimizers = dict({'momentum_sgd': None}, **json.loads(args.variants))
    data = convergence_suite.load_digits()
    steps = args.steps
    schedules = {'0.1': lambda t: 0.1, '0.01': lambda t: 0.01,
                 'decayed': lambda t: 0.1 * (1 - t / steps)}
    rows, cells = [], []
    for model_name in args.models.split(','):
        sgd = None
        for name, options in optimizers.items():
            ratio_lr, ratio_decay = [], []
            for seed in range(args.seeds):
                norms = {key: update_norms(model_name, options, lr_at, steps,
                                           seed, data)
                         for key, lr_at in schedules.items()}
                ratio_lr.append(norms['0.1'].mean() / norms['0.01'].mean())
                ratio_decay.append(norms['decayed'][-10:].mean()
                                   / norms['0.1'][-10:].mean())
            cell = {'model': model_name, 'optimizer': name,
                    'options': options,
                    'ratio_lr': float(numpy.mean(ratio_lr)),
                    'ratio_decay': float(numpy.mean(ratio_decay))}
            if name == 'momentum_sgd':
                sgd = cell
            else:
                cell['vs_sgd'] = [cell['ratio_lr'] / sgd['ratio_lr'],
                                  cell['ratio_decay'] / sgd['ratio_decay']]
                cell['within_1.5x'] = all(1 / 1.5 < v < 1.5
                                          for v in cell['vs_sgd'])
            cells.append(cell)
            rows.append([model_name, name, '{:.2f}'.format(cell['ratio_lr']),
                         '{:.2f}'.format(cell['ratio_decay'])] + (
                ['', '', ''] if name == 'momentum_sgd' else
                ['{:.2f}'.format(cell['vs_sgd'][0]),
                 '{:.2f}'.format(cell['vs_sgd'][1]),
                 'yes' if cell['within_1.5x'] else 'no']))
            print(' '.join(rows[-1]), flush=True)
    text = harness.table(rows, [
        'model', 'optimizer', 'norm lr 0.1 / lr 0.01',
        'norm decayed / constant (last 10)', 'lr ratio vs SGD',
        'decay ratio vs SGD', 'within 1.5x'])
    print(text)
    print('wrote', harness.write_variant('lr_response', args.name, {
        'steps': steps, 'seeds': args.seeds, 'batchsize': 64,
        'environment': harness.environment(), 'cells': cells,
        'table': text}))


if __name__ == '__main__':
    main()
