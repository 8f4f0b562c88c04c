"""K-FAC vs MomentumSGD on scikit-learn's bundled digits (real 8x8 images).

    python examples/digits/train_digits.py [--epochs 10] [--batchsize 512]
        [--out result/digits]

Trains the same small CNN with BatchNorm twice, from the same initial
weights and data order, once with each optimizer; prints both validation
curves and saves them as ``OUT/digits.png``. The only difference between the
two runs is the line that builds the optimizer.
"""
import argparse
import importlib.util
import json
import os

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.links as L
import numpy
from chainer import training
from chainer.training import extensions


def _getting_started():
    """``docs/examples/train_digits.py``, the getting-started example, whose
    model and data this comparison shares."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..',
                        '..', 'docs', 'examples', 'train_digits.py')
    spec = importlib.util.spec_from_file_location('getting_started', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EXAMPLE = _getting_started()
#: The small CNN with BatchNorm and the digits' train/validation split.
SmallCNN, load_digits = _EXAMPLE.CNN, _EXAMPLE.digits


OPTIMIZERS = {
    # The one-line swap: MomentumSGD's learning rate, the natural direction
    # (step_rule 'kl_graft'); the bound on the step's KL change grows like
    # the batch (kl_clip · B / 64).
    'kfac': lambda: chainerkfac.optimizers.KFAC(lr=0.1, momentum=0.9),
    'momentum_sgd': lambda: chainer.optimizers.MomentumSGD(lr=0.1,
                                                           momentum=0.9),
}


def train(make_optimizer, name, epochs, batchsize, out, seed=0,
          verbose=True):
    """Trains with ``make_optimizer()``; returns the per-epoch log."""
    train_set, val_set = load_digits()
    chainer.global_config.cudnn_deterministic = True
    numpy.random.seed(seed)
    model = L.Classifier(SmallCNN())
    optimizer = make_optimizer()
    optimizer.setup(model)
    train_iter = chainer.iterators.SerialIterator(
        train_set, batchsize, shuffle=True)
    val_iter = chainer.iterators.SerialIterator(
        val_set, len(val_set), repeat=False, shuffle=False)
    updater = training.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (epochs, 'epoch'),
                               out=os.path.join(out, name))
    trainer.extend(extensions.Evaluator(val_iter, model))
    trainer.extend(extensions.LogReport())
    if verbose:
        trainer.extend(extensions.PrintReport(
            ['epoch', 'iteration', 'main/loss', 'validation/main/loss',
             'validation/main/accuracy', 'elapsed_time']))
    trainer.run()
    with open(os.path.join(out, name, 'log')) as f:
        return json.load(f)


def plot(logs, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for name, log in logs.items():
        epochs = [e['epoch'] for e in log]
        for ax, key in zip(axes, ('main/loss', 'validation/main/loss',
                                  'validation/main/accuracy')):
            ax.plot(epochs, [e[key] for e in log], label=name)
    axes[0].set(xlabel='epoch', ylabel='training loss', yscale='log')
    axes[1].set(xlabel='epoch', ylabel='validation loss', yscale='log')
    axes[2].set(xlabel='epoch', ylabel='validation accuracy')
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--epochs', type=int, default=10)
    parser.add_argument('--batchsize', type=int, default=512)
    parser.add_argument('--out', default='result/digits')
    args = parser.parse_args()
    logs = {}
    for name in OPTIMIZERS:
        print('== {} =='.format(name))
        logs[name] = train(OPTIMIZERS[name], name, args.epochs,
                           args.batchsize, args.out)
    print('\nvalidation loss / accuracy per epoch')
    print('epoch  ' + '  '.join('{:>20}'.format(n) for n in logs))
    for i in range(args.epochs):
        print('{:>5}  '.format(i + 1) + '  '.join(
            '{:>12.4f} / {:.4f}'.format(
                logs[n][i]['validation/main/loss'],
                logs[n][i]['validation/main/accuracy']) for n in logs))
    path = os.path.join(args.out, 'digits.png')
    plot(logs, path)
    print('plot saved to', path)


if __name__ == '__main__':
    main()
