"""The flop model of issue #5: K-FAC's work relative to forward+backward.

    PYTHONPATH=. .venv/bin/python benchmarks/flops.py [--model resnet50]
    PYTHONPATH=. .venv/bin/python benchmarks/flops.py --inversions

``--inversions`` also times the damped inverse of one random float32 factor
of every size the model has (``linalg.damped_inverse``, best of 3) and
writes them to ``results/flops.json``: what the small factors cost
together is what batching their inversions could save at most.

Shapes come from one forward pass at batch 1 with a link hook; counts are
per step at ``--batch``:

* forward+backward: 3 x the forward's multiply-adds x 2 (convolutions and
  Linear layers only; BatchNorm and ReLU are memory-bound, not counted);
* A factor: ``2 n T d_A^2`` as a GEMM (``n T d_A^2`` as the ``syrk`` NumPy
  uses for ``Q @ Q.T``), T output positions, ``d_A = c kh kw (+1)``; as
  computed, a convolution where ``shifted_gram_pays`` counts the products
  of ``shifted_gram`` instead (:func:`shifted_gram_flops`);
* G factor: ``2 n T d_G^2`` (``syrk``: half);
* inverses: ``d_A^3 + d_G^3`` (Cholesky ``potrf`` + ``potri``);
* preconditioning: ``2 d_G d_A (d_A + d_G)`` (two GEMMs).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chainerkfac  # NOQA
import time

import chainer
import chainer.links as L
import numpy

import harness
import models as models_module
from chainerkfac import linalg
from chainerkfac.curvature import convolution_2d

#: Factors up to this dimension count as small.
SMALL = 256


def shifted_gram_flops(n, c, h, w, ksize, pad):
    """Flops of ``convolution_2d.shifted_gram`` on an ``(n, c, h, w)``
    input: one product per offset over the spaced-out input (``syrk`` for
    the zero offset) and one per border window of every tap pair."""
    kh, kw = ksize
    length = n * (h + kh - 1) * (w + kw - 1)
    stride = w + kw - 1
    total, seen = 0, set()
    for _, _, (dy, dx), rows, cols, out_rows, out_cols in \
            convolution_2d.tap_pairs(h, w, ksize, pad):
        if (dy, dx) not in seen:
            seen.add((dy, dx))
            shift = dy * stride + dx
            total += c * c * length if shift == 0 else \
                2 * c * c * (length - shift)
        windows = ([(r, cols) for r in out_rows]
                   + [(rows, q) for q in out_cols]
                   + [(r, q) for r in out_rows for q in out_cols])
        total += sum(2 * c * c * n * (r[1] - r[0]) * (q[1] - q[0])
                     for r, q in windows)
    return total


class _Shapes(chainer.LinkHook):
    name = 'bench_shapes'

    def __init__(self):
        self.rows = []

    def forward_postprocess(self, args):
        link = args.link
        if isinstance(link, (L.Convolution2D, L.Linear)):
            x = args.args[0]
            y = args.out
            W = link.W
            has_bias = getattr(link, 'b', None) is not None
            d_a = W.size // W.shape[0] + int(has_bias)
            d_g = W.shape[0]
            T = int(numpy.prod(y.shape[2:])) if y.ndim > 2 else 1
            shifted = None
            if isinstance(link, L.Convolution2D) and \
                    convolution_2d.shifted_gram_pays(link, x.shape):
                k = link.ksize
                shifted = (x.shape[1:], k if isinstance(k, tuple) else (k, k),
                           link.pad)
            self.rows.append({'kind': type(link).__name__, 'd_A': d_a,
                              'd_G': d_g, 'T': T, 'shifted': shifted,
                              'macs_per_sample': T * (W.size // W.shape[0])
                              * d_g})
            del x


def layer_shapes(model_name):
    """One row per Linear or Convolution2D layer of the model."""
    factory, in_shape, _ = models_module.MODELS[model_name]
    model = factory()
    hook = _Shapes()
    x = numpy.zeros((1,) + in_shape, dtype=numpy.float32)
    with hook, chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        model(x)
    return hook


def inversion_times(model_name='resnet50', seed=0):
    """Seconds of ``linalg.damped_inverse`` per factor size of the model."""
    rows = layer_shapes(model_name).rows
    dims = [r[k] for r in rows for k in ('d_A', 'd_G')]
    rng = numpy.random.RandomState(seed)
    sizes = {}
    for d in sorted(set(dims)):
        X = rng.standard_normal((d, 2 * d)).astype(numpy.float32)
        M = X @ X.T / (2 * d)
        best = float('inf')
        for _ in range(3):
            t0 = time.perf_counter()
            linalg.damped_inverse(M, 1e-3)
            best = min(best, time.perf_counter() - t0)
        sizes[d] = {'count': dims.count(d), 'seconds': best}
    small = [d for d in sizes if d <= SMALL]
    return {
        'model': model_name, 'factors': len(dims), 'small_max_dim': SMALL,
        'small_factors': sum(sizes[d]['count'] for d in small),
        'total_seconds': sum(v['count'] * v['seconds']
                             for v in sizes.values()),
        'small_seconds': sum(sizes[d]['count'] * sizes[d]['seconds']
                             for d in small),
        'sizes': sizes, 'environment': harness.environment()}


def flop_model(model_name='resnet50', batch=32):
    hook = layer_shapes(model_name)
    n = batch
    fb = sum(6 * n * r['macs_per_sample'] for r in hook.rows)
    conv = [r for r in hook.rows if r['kind'] == 'Convolution2D']
    a_gemm = sum(2 * n * r['T'] * r['d_A'] ** 2 for r in hook.rows)
    a_conv = sum(2 * n * r['T'] * r['d_A'] ** 2 for r in conv)
    a_computed = sum(
        shifted_gram_flops(n, *r['shifted'][0], r['shifted'][1],
                           r['shifted'][2]) if r['shifted']
        else n * r['T'] * r['d_A'] ** 2 for r in hook.rows)
    g_gemm = sum(2 * n * r['T'] * r['d_G'] ** 2 for r in hook.rows)
    inv = sum(r['d_A'] ** 3 + r['d_G'] ** 3 for r in hook.rows)
    pre = sum(2 * r['d_G'] * r['d_A'] * (r['d_A'] + r['d_G'])
              for r in hook.rows)
    return {
        'model': model_name, 'batch': batch, 'layers': len(hook.rows),
        'forward_backward_gflop': fb / 1e9,
        'relative': {
            'A factors (GEMM)': a_gemm / fb,
            'A factors, conv only (GEMM)': a_conv / fb,
            'A factors (syrk, as NumPy runs Q @ Q.T)': a_gemm / 2 / fb,
            'A factors as computed (shifted products, else syrk)':
                a_computed / fb,
            'G factors (GEMM)': g_gemm / fb,
            'G factors (syrk)': g_gemm / 2 / fb,
            'inverses (potrf + potri)': inv / fb,
            'preconditioning': pre / fb,
        },
        'largest_d_A': max(r['d_A'] for r in hook.rows),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--model', default='resnet50')
    parser.add_argument('--batch', type=int, default=32)
    parser.add_argument('--inversions', action='store_true',
                        help='also time the inverses (results/flops.json)')
    args = parser.parse_args()
    m = flop_model(args.model, args.batch)
    print('{} batch {}: forward+backward {:.0f} GFLOP'.format(
        m['model'], m['batch'], m['forward_backward_gflop']))
    for k, v in m['relative'].items():
        print('  {:52s} {:.3f}'.format(k, v))
    if args.inversions:
        inv = inversion_times(args.model)
        print('inverses of all {} factors: {}; the {} of dimension <= {}: '
              '{}'.format(inv['factors'], harness.fmt_s(inv['total_seconds']),
                          inv['small_factors'], SMALL,
                          harness.fmt_s(inv['small_seconds'])))
        print('written', harness.write_json('flops.json', inv))


if __name__ == '__main__':
    main()
