"""Checks that the proposed changes of ``patches.py`` keep the numerics.

    PYTHONPATH=. .venv/bin/python benchmarks/check_patches.py

Runs two K-FAC steps on the small CNN (and ResNet-50 width/4 at 32x32, and
the MLP) with and without each patch, from the same weights and batch (the
first with a zero learning rate, so that the second folds the same
statistics into the factors), and prints the largest relative difference
of the factors, inverses and parameters (float32 round-off: about 1e-6 for
factors; inverses of ill-conditioned damped factors amplify it). Not a
timed test.
"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chainerkfac  # NOQA
import chainer
import chainer.functions as F
import numpy

import models
import patches


def state_after_steps(model, x, t, patch, steps=2):
    model = copy.deepcopy(model)
    opt = chainerkfac.optimizers.KFAC(lr=1e-2, damping=1e-3)
    opt.setup(model)
    if patch is not None:
        patch.apply()
    try:
        for i in range(steps):
            opt.lr = 1e-2 if i == steps - 1 else 0.0
            model.cleargrads()
            loss = F.softmax_cross_entropy(model(x), t)
            loss.backward()
            opt.update()
    finally:
        if patch is not None:
            patch.revert()
    out = {}
    for b in opt.blocks:
        for f, v in b.factor.items():
            out[b.name + '/' + f] = v
        for k, v in (b.form.arrays if b.form else {}).items():
            out[b.name + '/' + k] = v
    for name, p in model.namedparams():
        out['param' + name] = p.array
    return out


def main():
    rng = numpy.random.RandomState(0)
    worst = 0.0
    cases = [('small_cnn', models.SmallCNN(10), (8, 3, 16, 16)),
             ('resnet50_w4', models.ResNet50(10, width_divisor=4),
              (4, 3, 32, 32)),
             ('mlp', models.MLP(), (16, 784))]
    for name, model, shape in cases:
        x = rng.standard_normal(shape).astype(numpy.float32)
        t = rng.randint(0, 10, shape[0]).astype(numpy.int32)
        with chainer.no_backprop_mode():
            model(x)
        ref = state_after_steps(model, x, t, None)
        for pname in sorted(patches.PATCHES):
            got = state_after_steps(model, x, t, patches.PATCHES[pname]())
            errs = []
            for key, value in ref.items():
                scale = float(numpy.abs(value).max()) or 1.0
                errs.append((float(numpy.abs(got[key] - value).max())
                             / scale, key))
            groups = {}
            for err, key in errs:
                kind = ('param' if key.startswith('param') else
                        'inverse' if '_inv' in key or 'eig' in key
                        else 'factor')
                groups[kind] = max(groups.get(kind, (0.0, '')), (err, key))
            worst = max(worst, groups['factor'][0])
            print('{:12s} {:13s} max relative difference: {}'.format(
                name, pname, ', '.join(
                    '{} {:.1e} ({})'.format(k, e, n)
                    for k, (e, n) in sorted(groups.items()))))
    print('worst factor difference', '{:.2e}'.format(worst))
    return worst


if __name__ == '__main__':
    sys.exit(0 if main() < 1e-3 else 1)
