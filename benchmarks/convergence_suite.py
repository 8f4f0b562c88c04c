"""K-FAC at MomentumSGD's learning rates: the one-line swap, model by model.

    PYTHONPATH=. .venv/bin/python benchmarks/convergence_suite.py
    PYTHONPATH=. .venv/bin/python benchmarks/convergence_suite.py \\
        --kfac '{"kl_clip": null}' --name no_guard   # a variant of K-FAC

scikit-learn's digits (1,397 training / 400 validation images, 8x8), batch
64, 200 iterations, momentum 0.9, a grid of learning rates and several
seeds, on five models: a tanh MLP (64-100-100-10), a VGG-style CNN without
BatchNorm (4 convolutions, 2 linear layers), the same with BatchNorm, a
small ResNet and a plain deep CNN (ten convolutions). Each (model, lr,
seed) trains ``MomentumSGD(lr, 0.9)`` and ``KFAC(lr, 0.9, **options)`` from
the same weights and data with ``optimizer.update(lossfun, x, t)``. Cells:
final validation accuracy and loss (mean over seeds), and whether a run
diverged (a non-finite value, or a final training loss above the first).
The goals: no K-FAC divergence; its best over lrs at least MomentumSGD's.
Writes ``results/convergence_suite.json``, variant ``--name``.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.functions as F
import chainer.links as L
import numpy

import harness

sys.path.insert(0, os.path.join(os.path.dirname(HERE), 'examples',
                                'imagenet'))
import schemes  # NOQA  (the example's Trainer extensions)


class MLP(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(64, 100)
            self.l2 = L.Linear(100, 100)
            self.l3 = L.Linear(100, 10)

    def forward(self, x):
        h = F.tanh(self.l1(x))
        return self.l3(F.tanh(self.l2(h)))


class VGG(chainer.Chain):
    """Two conv-conv-pool stages (16, 32 channels) and two linear layers;
    ``batch_norm`` puts a BatchNormalization after every convolution."""

    def __init__(self, batch_norm):
        super().__init__()
        self.batch_norm = batch_norm
        with self.init_scope():
            self.c1 = L.Convolution2D(1, 16, 3, pad=1)
            self.c2 = L.Convolution2D(16, 16, 3, pad=1)
            self.c3 = L.Convolution2D(16, 32, 3, pad=1)
            self.c4 = L.Convolution2D(32, 32, 3, pad=1)
            if batch_norm:
                self.b1 = L.BatchNormalization(16)
                self.b2 = L.BatchNormalization(16)
                self.b3 = L.BatchNormalization(32)
                self.b4 = L.BatchNormalization(32)
            self.f1 = L.Linear(32 * 2 * 2, 64)
            self.f2 = L.Linear(64, 10)

    def _conv(self, i, h):
        h = getattr(self, 'c{}'.format(i))(h)
        if self.batch_norm:
            h = getattr(self, 'b{}'.format(i))(h)
        return F.relu(h)

    def forward(self, x):
        h = F.max_pooling_2d(self._conv(2, self._conv(1, x)), 2)
        h = F.max_pooling_2d(self._conv(4, self._conv(3, h)), 2)
        return self.f2(F.relu(self.f1(h)))


class SmallResNet(chainer.Chain):
    """A stem, two residual blocks (16 channels at 8x8, 32 at 4x4) with
    BatchNorm, global average pooling and a linear classifier."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.stem = L.Convolution2D(1, 16, 3, pad=1, nobias=True)
            self.bn0 = L.BatchNormalization(16)
            self.a1 = L.Convolution2D(16, 16, 3, pad=1, nobias=True)
            self.an1 = L.BatchNormalization(16)
            self.a2 = L.Convolution2D(16, 16, 3, pad=1, nobias=True)
            self.an2 = L.BatchNormalization(16)
            self.b1 = L.Convolution2D(16, 32, 3, 2, 1, nobias=True)
            self.bn1 = L.BatchNormalization(32)
            self.b2 = L.Convolution2D(32, 32, 3, pad=1, nobias=True)
            self.bn2 = L.BatchNormalization(32)
            self.short = L.Convolution2D(16, 32, 1, 2, nobias=True)
            self.bns = L.BatchNormalization(32)
            self.fc = L.Linear(32, 10)

    def forward(self, x):
        h = F.relu(self.bn0(self.stem(x)))
        r = F.relu(self.an1(self.a1(h)))
        h = F.relu(h + self.an2(self.a2(r)))
        r = F.relu(self.bn1(self.b1(h)))
        h = F.relu(self.bns(self.short(h)) + self.bn2(self.b2(r)))
        return self.fc(F.average(h, axis=(2, 3)))


class DeepVGG(chainer.Chain):
    """A plain deep CNN: ten 3x3 convolutions, each followed by
    BatchNormalization and ReLU (16, 16, pool, 32, 32, pool, 64 x 6 at 2x2),
    global average pooling and a linear classifier; no shortcuts."""

    WIDTHS = (16, 16, 'pool', 32, 32, 'pool', 64, 64, 64, 64, 64, 64)

    def __init__(self):
        super().__init__()
        self.plan = []
        channels = 1
        with self.init_scope():
            for width in self.WIDTHS:
                if width == 'pool':
                    self.plan.append(None)
                    continue
                k = len([p for p in self.plan if p is not None])
                setattr(self, 'c{}'.format(k), L.Convolution2D(
                    channels, width, 3, pad=1, nobias=True))
                setattr(self, 'b{}'.format(k), L.BatchNormalization(width))
                self.plan.append(k)
                channels = width
            self.fc = L.Linear(channels, 10)

    def forward(self, x):
        h = x
        for k in self.plan:
            if k is None:
                h = F.max_pooling_2d(h, 2)
            else:
                h = F.relu(getattr(self, 'b{}'.format(k))(
                    getattr(self, 'c{}'.format(k))(h)))
        return self.fc(F.average(h, axis=(2, 3)))


MODELS = {
    'mlp': (MLP, True),
    'cnn': (lambda: VGG(False), False),
    'cnn_bn': (lambda: VGG(True), False),
    'resnet': (SmallResNet, False),
    'deep_cnn': (DeepVGG, False),
}


def load_digits():
    """1,397 training and 400 validation digits, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits
    digits = sklearn_digits()
    x = (digits.images / 16.0).astype(numpy.float32)[:, None]
    y = digits.target.astype(numpy.int32)
    order = numpy.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[400:], y[400:]), (x[:400], y[:400])


def classifier(model_name, data, seed):
    """``(L.Classifier of the model, train, validation)``: the model's
    initial weights drawn from ``seed``, the digits flattened for the
    MLP."""
    (x_train, y_train), (x_val, y_val) = data
    factory, flat = MODELS[model_name]
    if flat:
        x_train = x_train.reshape(len(x_train), -1)
        x_val = x_val.reshape(len(x_val), -1)
    numpy.random.seed(seed)
    return L.Classifier(factory()), (x_train, y_train), (x_val, y_val)


#: What :func:`run` counts of K-FAC's reports, summed over the run.
REFRESHES = ('factor_refreshes', 'inverse_refreshes')


def run(model_name, make_optimizer, seed, iterations, batchsize, data,
        damping_at=None, trace=None):
    """Trains one model; returns its losses and final validation figures.

    ``damping_at(t)``, if given, sets K-FAC's damping before update ``t``
    (what a Trainer extension such as the ImageNet example's
    ``DampingWarmup`` does). K-FAC's factor and inverse refreshes are
    counted (what its schedules made the run compute). ``trace``, a list,
    receives each update's training loss and K-FAC's reported
    ``kfac/kl`` (the bound's ``q``; NaN for MomentumSGD)."""
    model, (x_train, y_train), (x_val, y_val) = classifier(model_name, data,
                                                           seed)
    optimizer = make_optimizer()
    optimizer.setup(model)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    refreshes = dict.fromkeys(REFRESHES, 0)
    rng = numpy.random.RandomState(seed)
    order, position, losses = rng.permutation(len(x_train)), 0, []
    start = time.perf_counter()
    error = None
    for t in range(iterations):
        if damping_at is not None and hasattr(optimizer, 'damping'):
            optimizer.damping = damping_at(t)
        if position + batchsize > len(order):
            order, position = rng.permutation(len(x_train)), 0
        idx = order[position:position + batchsize]
        position += batchsize
        observation = {}
        try:
            with reporter.scope(observation):
                optimizer.update(model, x_train[idx], y_train[idx])
        except Exception as e:  # a diverged run that raised
            error = '{}: {}'.format(type(e).__name__, e)
            break
        for key in refreshes:
            refreshes[key] += int(observation.get('kfac/' + key, 0))
        losses.append(float(model.loss.array))
        if trace is not None:
            trace.append((losses[-1], float(observation.get('kfac/kl',
                                                            numpy.nan))))
    seconds = time.perf_counter() - start
    with chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        val_loss = float(model(x_val, y_val).array)
        val_acc = float(model.accuracy.array)
    diverged = (error is not None or not numpy.isfinite(val_loss)
                or not numpy.isfinite(losses).all()
                or numpy.mean(losses[-10:]) > losses[0])
    return {'val_accuracy': val_acc, 'val_loss': val_loss,
            'first_loss': losses[0] if losses else None,
            'final_loss': float(numpy.mean(losses[-10:])) if losses
            else None,
            'max_loss': max(losses) if losses else None,
            'diverged': bool(diverged), 'error': error, 'seconds': seconds,
            **refreshes}


def summary(model_name, lr, optimizer_name, runs):
    """One cell of the suite: the means over seeds of ``run``'s results,
    and how many runs diverged; printed as a line."""
    cell = {
        'model': model_name, 'lr': lr, 'optimizer': optimizer_name,
        'val_accuracy': float(numpy.mean([r['val_accuracy'] for r in runs])),
        'val_loss': float(numpy.mean([r['val_loss'] for r in runs])),
        'diverged': sum(r['diverged'] for r in runs),
        'seconds': float(numpy.mean([r['seconds'] for r in runs])),
        'runs': runs}
    cell.update({key: float(numpy.mean([r[key] for r in runs]))
                 for key in REFRESHES})
    print('{:7} lr {:<5} {:13} val acc {:.3f} loss {:9.3g} diverged {}/{} '
          '({:.1f} s, refreshes: {:.0f} factors, {:.0f} inverses)'.format(
              model_name, lr, optimizer_name, cell['val_accuracy'],
              cell['val_loss'], cell['diverged'], len(runs),
              cell['seconds'], cell['factor_refreshes'],
              cell['inverse_refreshes']), flush=True)
    return cell


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--kfac', default='{}',
                        help='KFAC options as JSON (default: none)')
    parser.add_argument('--variants', default=None,
                        help='several K-FAC variants side by side, as JSON '
                        '{name: options}: the cells name them (replaces '
                        '--kfac)')
    harness.add_name_option(parser, 'convergence_suite')
    parser.add_argument('--models', default=','.join(MODELS))
    parser.add_argument('--lrs', default='0.01,0.03,0.1,0.3,1.0')
    parser.add_argument('--seeds', type=int, default=2)
    parser.add_argument('--iterations', type=int, default=200)
    parser.add_argument('--batchsize', type=int, default=64)
    parser.add_argument('--damping-warmup', default=None,
                        help='FACTOR,STEPS: damping from FACTOR times its '
                        'value down to it over STEPS updates, geometrically '
                        '(the ImageNet example\'s DampingWarmup)')
    parser.add_argument('--no-sgd', action='store_true',
                        help='K-FAC only (MomentumSGD from an earlier run)')
    args = parser.parse_args()
    harness.limit_threads(1)
    variants = json.loads(args.variants) if args.variants else {
        'kfac': json.loads(args.kfac)}
    options = variants[next(iter(variants))]
    reported = dict(options)
    data = load_digits()
    lrs = [float(v) for v in args.lrs.split(',')]
    optimizers = {
        name: (lambda opts: lambda lr: chainerkfac.optimizers.KFAC(
            lr=lr, momentum=0.9, **opts))(opts)
        for name, opts in variants.items()}
    if not args.no_sgd:
        optimizers['momentum_sgd'] = lambda lr: chainer.optimizers.MomentumSGD(
            lr=lr, momentum=0.9)
    damping_at = None
    if args.damping_warmup:
        factor, steps = args.damping_warmup.split(',')
        target = options.get('damping', chainerkfac.optimizers.KFAC(
            ).damping)
        warmup = schemes.DampingWarmup(float(factor) * target, target,
                                       int(steps))
        damping_at = warmup.value
        reported['damping_warmup'] = args.damping_warmup
    cells = []
    for model_name in args.models.split(','):
        for lr in lrs:
            for opt_name, make in optimizers.items():
                runs = [run(model_name, lambda: make(lr), seed,
                            args.iterations, args.batchsize, data,
                            damping_at)
                        for seed in range(args.seeds)]
                cells.append(summary(model_name, lr, opt_name, runs))
    # What the options set, and every option as K-FAC then had it.
    payload = {'kfac_options': reported,
               'kfac_option_values': chainerkfac.optimizers.KFAC(
                   **options).option_values(),
               'variants': {name: {
                   'options': opts,
                   'option_values': chainerkfac.optimizers.KFAC(
                       **opts).option_values()}
                   for name, opts in variants.items()},
               'iterations': args.iterations,
               'batchsize': args.batchsize, 'seeds': args.seeds,
               'environment': harness.environment(), 'cells': cells}
    print('wrote', harness.write_variant('convergence_suite', args.name,
                                         payload))


if __name__ == '__main__':
    main()
