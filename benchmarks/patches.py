"""Proposed changes to the library, applied at run time for A/B timing.

Each entry of :data:`PATCHES` builds a :class:`harness.Patch` that replaces
methods of the library's classes while it is applied; ``step_time.py``
applies it only around the steps of the configuration named
``CONFIG+PATCH`` (e.g. ``kfac_1+lean_inverse``), so patched and unpatched
configurations run interleaved in one process. The numerics are the
library's own (the tests in ``benchmarks/check_patches.py`` compare them);
only the arithmetic's order and layout change.

These are proposals for ``chainerkfac/``; the benchmark never edits it.
"""
import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import numpy
from chainer import backend

import harness
from chainerkfac import linalg
from chainerkfac.curvature import convolution_2d
from chainerkfac.curvature import kronecker


# -- Inverses: fewer copies around potrf / potri -----------------------------

_lapack_cache = {}


def _damped_inverse_lean(M, damping):
    xp = backend.get_array_module(M)
    if xp is not numpy:
        return _original_damped_inverse(M, damping)
    from scipy.linalg import lapack
    d = M.shape[0]
    damped = M.copy()
    damped.reshape(-1)[::d + 1] += damping
    key = damped.dtype.char
    if key not in _lapack_cache:
        _lapack_cache[key] = lapack.get_lapack_funcs(('potrf', 'potri'),
                                                     (damped,))
    potrf, potri = _lapack_cache[key]
    # damped.T is Fortran-ordered and (symmetric) equal to damped: LAPACK
    # works on it in place, without the copy f2py makes of a C array.
    c, info = potrf(damped.T, lower=False, clean=False, overwrite_a=True)
    if info == 0:
        inv, info = potri(c, lower=False, overwrite_c=True)
        if info == 0:
            inv = inv.T  # C-ordered; its lower triangle holds the result
            upper = numpy.triu_indices(d, 1)
            inv[upper] = inv.T[upper]
            # One finiteness check of the result covers M too: a NaN or
            # Inf in M cannot give a finite inverse.
            if numpy.isfinite(inv.sum()):
                return inv
    return _original_damped_inverse(M, damping)


_original_damped_inverse = linalg.damped_inverse


def _kronecker_compute_inverse_lean(self, damping):
    if self.inverse == 'eigen':
        return _original_compute_inverse(self, damping)
    A, G = self.factor['A'], self.factor['G']
    damping_A, damping_G = linalg.factored_damping(A, G, damping)
    return {'A_inv': _damped_inverse_lean(A, damping_A),
            'G_inv': _damped_inverse_lean(G, damping_G)}


_original_compute_inverse = kronecker.KroneckerBlock.__dict__[
    'compute_inverse']
_original_compute_inverse = getattr(_original_compute_inverse,
                                    '_bench_original',
                                    _original_compute_inverse)


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


def lean_inverse():
    return harness.Patch('lean_inverse', [
        (kronecker.KroneckerBlock, 'compute_inverse',
         _kronecker_compute_inverse_lean),
    ], doc='potrf/potri in place, symmetrise in place, one finiteness '
           'check on the result')


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


def all_fixes():
    parts = [lean_inverse(), fused_finite()]
    return harness.Patch('all', [r for p in parts for r in p.replacements],
                         doc=' + '.join(p.name for p in parts))


PATCHES = {
    'lean_inverse': lean_inverse,
    'fused_finite': fused_finite,
    'all': all_fixes,
    'subsample4': subsample(4),
}
