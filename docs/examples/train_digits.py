"""K-FAC on scikit-learn's bundled digits, in one process.

    python docs/examples/train_digits.py [--epochs 5] [--out result/digits]

A small convolutional network with BatchNormalization learns the 1,797 8x8
digit images; every link of it gets K-FAC. The script is a plain Chainer
training script: only the line that builds the optimizer names chainerkfac.
"""
import argparse

import chainerkfac  # first: makes Chainer 7.8.1 import on NumPy 2
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
from chainer import training
from chainer.training import extensions
from sklearn.datasets import load_digits


class CNN(chainer.Chain):
    """Two conv-BN-ReLU layers and a linear classifier."""

    def __init__(self, n_out=10):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(1, 16, ksize=3, pad=1)
            self.bn1 = L.BatchNormalization(16)
            self.conv2 = L.Convolution2D(16, 32, ksize=3, stride=2, pad=1)
            self.bn2 = L.BatchNormalization(32)
            self.fc = L.Linear(32 * 4 * 4, n_out)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.fc(h)


def digits(n_test=397, seed=0):
    """Shuffled train and test sets of (1x8x8 image in [0, 1], label)."""
    data = load_digits()
    x = (data.images / 16).astype(numpy.float32)[:, None]
    t = data.target.astype(numpy.int32)
    order = numpy.random.RandomState(seed).permutation(len(x))
    x, t = x[order], t[order]
    return (chainer.datasets.TupleDataset(x[n_test:], t[n_test:]),
            chainer.datasets.TupleDataset(x[:n_test], t[:n_test]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--epochs', type=int, default=5)
    parser.add_argument('--batchsize', type=int, default=128)
    parser.add_argument('--out', default='result/digits')
    args = parser.parse_args()

    train, test = digits()
    model = L.Classifier(CNN())
    # optimizer = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    optimizer = chainerkfac.optimizers.KFAC(lr=0.1, momentum=0.9)
    optimizer.setup(model)
    print(optimizer.describe())

    train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(
        test, len(test), repeat=False, shuffle=False)
    updater = training.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (args.epochs, 'epoch'), out=args.out)
    trainer.extend(extensions.Evaluator(test_iter, model))
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss',
         'validation/main/accuracy', 'kfac/damping', 'elapsed_time']))
    trainer.run()


if __name__ == '__main__':
    main()
