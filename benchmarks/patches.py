"""Proposed changes to the library, applied at run time for A/B timing.

Each entry of :data:`PATCHES` builds a :class:`harness.Patch` that replaces
methods of the library's classes while it is applied; ``step_time.py``
applies it only around the steps of the configuration named
``CONFIG+PATCH`` (e.g. ``kfac_1+subsample4``), so patched and unpatched
configurations run interleaved in one process. The numerics are the
library's own (the tests in ``benchmarks/check_patches.py`` compare them);
only the arithmetic's order and layout change.

These are proposals for ``chainerkfac/``; the benchmark never edits it.
"""
import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import numpy
from chainer import backend

import harness
from chainerkfac.curvature import convolution_2d


# -- Sub-sampled conv A factor (Ba et al. 2017, appendix A) ------------------

def _subsampled_input_columns(ratio):
    """The library's im2col columns of every ``ratio``-th output position
    (per sample), rescaled by ``sqrt(T / kept)`` so that ``Q Qᵀ`` keeps its
    sum-over-positions scale. For convolutions without bias (ResNet's): the
    bias row of A would need the same rescaling."""
    original = convolution_2d.Convolution2DBlock.input_columns

    def input_columns(self, x):
        if self.has_bias:
            raise NotImplementedError('subsampling needs nobias convolutions')
        Q, n = original(self, x)
        T = Q.shape[1] // n
        if T < 2 * ratio:
            return Q, n
        keep = Q.reshape(Q.shape[0], n, T)[:, :, ::ratio]
        xp = backend.get_array_module(Q)
        Q = xp.ascontiguousarray(keep).reshape(Q.shape[0], -1)
        return Q * numpy.sqrt(T / keep.shape[2]).astype(Q.dtype), n
    return input_columns


# -- Finite checks: one reduction per gradient, no boolean temporaries -------

def _check_finite_gradients_fused(self):
    for name, param in self.target.namedparams():
        xp = param.device.xp
        if not bool(xp.isfinite(param.grad.sum(dtype=xp.float64))):
            return _original_check_finite(self)
    return True


_original_check_finite = None


def _setup_finite():
    global _original_check_finite
    from chainerkfac.optimizers import kfac
    f = kfac.KFAC.__dict__['_check_finite_gradients']
    _original_check_finite = getattr(f, '_bench_original', f)


def fused_finite():
    _setup_finite()
    from chainerkfac.optimizers import kfac
    return harness.Patch('fused_finite', [
        (kfac.KFAC, '_check_finite_gradients',
         _check_finite_gradients_fused)],
        doc='isfinite(grad.sum(float64)) per parameter')


def subsample(ratio):
    def make():
        return harness.Patch('subsample{}'.format(ratio), [
            (convolution_2d.Convolution2DBlock, 'input_columns',
             _subsampled_input_columns(ratio))],
            doc='the conv A factor from every {}-th output position '
                '(rescaled)'.format(ratio))
    return make


PATCHES = {
    'fused_finite': fused_finite,
    'subsample4': subsample(4),
}
