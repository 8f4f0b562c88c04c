"""Changes to the library, applied at run time for A/B timing.

Each entry of :data:`PATCHES` builds a :class:`harness.Patch` that replaces
methods of the library's classes while it is applied; ``step_time.py``
applies it only around the steps of the configuration named
``CONFIG+PATCH`` (e.g. ``kfac_1+fused_finite``), so patched and unpatched
configurations run interleaved in one process. The numerics are the
library's own (the tests in ``benchmarks/check_patches.py`` compare them);
only the arithmetic's order and layout change.

These are proposals for ``chainerkfac/``, or its previous implementation of
a lever, to measure it before and after; the benchmark never edits it.
"""
import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)

import harness


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
    from chainerkfac.optimizers import nonfinite
    f = nonfinite.FiniteChecks.__dict__['_check_finite_gradients']
    _original_check_finite = getattr(f, '_bench_original', f)


def fused_finite():
    _setup_finite()
    from chainerkfac.optimizers import nonfinite
    return harness.Patch('fused_finite', [
        (nonfinite.FiniteChecks, '_check_finite_gradients',
         _check_finite_gradients_fused)],
        doc='isfinite(grad.sum(float64)) per parameter')


# -- Convolution A factors by im2col and syrk everywhere ----------------------

def im2col():
    """The A factors as before :func:`shifted_gram
    <chainerkfac.curvature.convolution_2d.shifted_gram>`: im2col and
    ``Q Qᵀ`` for every convolution, to time that lever side by side."""
    from chainerkfac.curvature import convolution_2d
    from chainerkfac.curvature import kronecker
    return harness.Patch('im2col', [
        (convolution_2d.Convolution2DBlock, 'input_moments',
         kronecker.KroneckerBlock.input_moments)],
        doc='A factors of every convolution by im2col and syrk (the '
            'previous implementation)')


# -- Kronecker factors from the whole batch's columns at once -----------------

def whole_batch():
    """Every ``Q Qᵀ`` over the whole batch's columns, as before
    :func:`sample_chunks <chainerkfac.curvature.kronecker.sample_chunks>`:
    one copy of the batch for each 1x1 convolution's ``A`` and every
    convolution's ``G``."""
    from chainerkfac.curvature import kronecker
    return harness.Patch('whole_batch', [
        (kronecker, 'sample_chunks',
         lambda n, dim, positions: [slice(0, n)])],
        doc='Kronecker factors from the columns of the whole batch at '
            'once (the previous implementation)')


def im2col_whole_batch():
    """:func:`im2col` and :func:`whole_batch` together: one im2col of the
    whole batch and one product per factor, the fewest kernel launches (a
    candidate for GPUs, where memory is plentiful and launches cost)."""
    replacements = im2col().replacements + whole_batch().replacements
    return harness.Patch('im2col_whole_batch', replacements,
                         doc='A by im2col, every factor from the whole '
                             'batch at once')


# -- Factor updates with factor-sized temporaries -----------------------------

def _take_statistics_copying(self, loss_scale=None):
    # The batch means in new arrays, as a division out of place made them.
    return {f: v.copy() for f, v in
            _original_take_statistics(self, loss_scale).items()}


_original_take_statistics = None


def _update_factors_copying(self, step, stats, decay):
    from chainer import backend
    rates = {}
    for f, new in stats.items():
        xp = backend.get_array_module(new)
        if not bool(xp.isfinite(new).all()):
            raise ValueError('non-finite {} factor'.format(f))
        old, rate = self.factor[f], None
        if old is None:
            self.factor[f] = new
        else:
            updated = new if decay == 0 else \
                decay * old + (1 - decay) * new
            old_norm = float(xp.linalg.norm(old))
            if old_norm > 0:
                rate = float(xp.linalg.norm(updated - old)) / old_norm
            self.factor[f] = updated
        rates[f] = rate
        self.schedules[f].mark(step, rate)
        self._factors_changed = True
    return rates


def fresh_ema():
    """The batch means and ``C <- d C + (1 - d) C_new`` with new arrays, as
    before the factors were updated in place."""
    global _original_take_statistics
    from chainerkfac.curvature import base
    f = base.FisherBlock.__dict__['take_statistics']
    _original_take_statistics = getattr(f, '_bench_original', f)
    return harness.Patch('fresh_ema', [
        (base.FisherBlock, 'take_statistics', _take_statistics_copying),
        (base.FisherBlock, 'update_factors', _update_factors_copying)],
        doc='batch means and factor averages into new arrays (the '
            'previous implementation)')


# -- Statistics into new arrays on every refresh ----------------------------

def _statistics_out_fresh(self, factor, shape, like):
    from chainer import backend
    return backend.get_array_module(like).empty(shape, dtype=like.dtype)


def _discard_statistics_dropping(self):
    self._sum = dict.fromkeys(self.factors)
    self._count = dict.fromkeys(self.factors, 0)


def fresh_sums():
    """Every refresh's statistics in new arrays, dropped once folded, as
    before :meth:`FisherBlock.statistics_out
    <chainerkfac.curvature.base.FisherBlock.statistics_out>` kept the sums
    from refresh to refresh."""
    from chainerkfac.curvature import base
    return harness.Patch('fresh_sums', [
        (base.FisherBlock, 'statistics_out', _statistics_out_fresh),
        (base.FisherBlock, 'discard_statistics',
         _discard_statistics_dropping)],
        doc='statistics into new arrays on every refresh (the previous '
            'implementation)')


# -- Convolution inputs gathered channels-first -----------------------------

def _never_channels_last(v):
    return False


def channels_first():
    """Every convolution input copied into channels-first rows before its
    products, as before :func:`channel_columns
    <chainerkfac.curvature.convolution_2d.channel_columns>` followed the
    input's memory layout."""
    from chainerkfac.curvature import convolution_2d
    return harness.Patch('channels_first', [
        (convolution_2d, '_channels_innermost', _never_channels_last)],
        doc='convolution inputs gathered into channels-first rows (the '
            'previous implementation)')


PATCHES = {
    'fused_finite': fused_finite,
    'im2col': im2col,
    'whole_batch': whole_batch,
    'im2col_whole_batch': im2col_whole_batch,
    'fresh_ema': fresh_ema,
    'fresh_sums': fresh_sums,
    'channels_first': channels_first,
}
