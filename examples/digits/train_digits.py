"""K-FAC vs MomentumSGD on scikit-learn's bundled digits (real 8x8 images).

    python examples/digits/train_digits.py [--epochs 10] [--batchsize 512]
        [--out result/digits]

Trains the same small CNN with BatchNorm twice, from the same initial
weights and data order, once with each optimizer; prints both validation
curves and saves them as ``OUT/digits.png``. The only difference between the
two runs is the line that builds the optimizer.
"""
import argparse
import json
import os

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
from chainer import training
from chainer.training import extensions


class SmallCNN(chainer.Chain):
    """conv-BN-relu x2 and a linear classifier: every link gets K-FAC."""

    def __init__(self, n_out=10):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(1, 16, 3, pad=1)
            self.bn1 = L.BatchNormalization(16)
            self.conv2 = L.Convolution2D(16, 32, 3, stride=2, pad=1)
            self.bn2 = L.BatchNormalization(32)
            self.fc = L.Linear(32 * 4 * 4, n_out)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.fc(h)


def load_digits(seed=0):
    """Train/validation split of the 1,797 digits, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits
    digits = sklearn_digits()
    x = (digits.images / 16.0).astype(numpy.float32)[:, None]
    y = digits.target.astype(numpy.int32)
    order = numpy.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_val = 397
    return (chainer.datasets.TupleDataset(x[n_val:], y[n_val:]),
            chainer.datasets.TupleDataset(x[:n_val], y[:n_val]))


OPTIMIZERS = {
    # The one-line swap: the update-norm guard's bound grows with the batch
    # (kl_clip_batch), so batch 512 needs no option of its own.
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
