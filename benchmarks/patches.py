"""Proposed changes to the library, applied at run time for A/B timing.

Each entry of :data:`PATCHES` builds a :class:`harness.Patch` that replaces
methods of the library's classes while it is applied; ``step_time.py``
applies it only around the steps of the configuration named
``CONFIG+PATCH`` (e.g. ``kfac_1+fast_stats``), so patched and unpatched
configurations run interleaved in one process. The numerics are the
library's own (the tests in ``benchmarks/check_patches.py`` compare them);
only the arithmetic's order and layout change.

These are proposals for ``chainerkfac/``; the benchmark never edits it.
"""
import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import numpy
from chainer import backend

import harness
from chainerkfac import hooks
from chainerkfac import linalg
from chainerkfac.curvature import base
from chainerkfac.curvature import batch_normalization
from chainerkfac.curvature import convolution_2d
from chainerkfac.curvature import kronecker


# -- Kronecker factors: columns of (d, n T) instead of rows of (n T, d) ------

def _conv_columns(block, x):
    """im2col written directly as a (c kh kw, n oh ow) matrix.

    Chainer's ``im2col_cpu`` builds ``(n, c, kh, kw, oh, ow)``, which the
    library then transposes into rows ``(n oh ow, c kh kw)``: two passes
    over the largest array of the step. Writing each (j, i) tap straight
    into ``(c, kh, kw, n, oh, ow)`` needs one pass and no transposition, and
    a 1x1 convolution without padding needs no im2col at all.
    """
    link = block.link
    kh, kw = (link.ksize if isinstance(link.ksize, tuple)
              else (link.ksize, link.ksize))
    sy, sx = link.stride
    ph, pw = link.pad
    dy, dx = link.dilate
    xp = backend.get_array_module(x)
    n, c, h, w = x.shape
    oh = (h + 2 * ph - dy * (kh - 1) - 1) // sy + 1
    ow = (w + 2 * pw - dx * (kw - 1) - 1) // sx + 1
    xt = x.transpose(1, 0, 2, 3)  # (c, n, h, w), a view
    if kh == kw == 1 and ph == pw == 0:
        cols = xt[:, :, :sy * oh:sy, :sx * ow:sx]
        return xp.ascontiguousarray(cols).reshape(c, n * oh * ow), n
    if ph or pw:
        padded = xp.zeros((c, n, h + 2 * ph, w + 2 * pw), dtype=x.dtype)
        padded[:, :, ph:ph + h, pw:pw + w] = xt
    else:
        padded = xt
    cols = xp.empty((c, kh, kw, n, oh, ow), dtype=x.dtype)
    for j in range(kh):
        for i in range(kw):
            cols[:, j, i] = padded[:, :, j * dy:j * dy + sy * oh:sy,
                                   i * dx:i * dx + sx * ow:sx]
    return cols.reshape(c * kh * kw, n * oh * ow), n


def _linear_columns(block, x):
    n = x.shape[0]
    d = block.link.W.shape[1]
    return x.reshape(-1, d).T, n


def _forward_statistics_columns(self, x, wanted):
    if 'A' in wanted:
        if isinstance(self, convolution_2d.Convolution2DBlock):
            Q, n = _conv_columns(self, x)
        else:
            Q, n = _linear_columns(self, x)
        xp = backend.get_array_module(Q)
        d = Q.shape[0]
        if self.has_bias:
            A = xp.empty((d + 1, d + 1), dtype=Q.dtype)
            # Q @ Q.T of one buffer: NumPy dispatches it to syrk.
            A[:d, :d] = Q @ Q.T
            A[:d, d] = A[d, :d] = Q.sum(axis=1)
            A[d, d] = Q.shape[1]
        else:
            A = Q @ Q.T
        self._accumulate('A', A, n)
    return True if 'G' in wanted else None


def _backward_statistics_columns(self, context, gy):
    n, out = gy.shape[:2]
    xp = backend.get_array_module(gy)
    if gy.ndim == 2:
        R = gy
        T = 1
        G = R.T @ R
    else:
        # (out, n T): one contiguous transposition, then syrk.
        Q = xp.ascontiguousarray(
            gy.reshape(n, out, -1).transpose(1, 0, 2)).reshape(out, -1)
        T = Q.shape[1] // n
        G = Q @ Q.T
    G *= n * n / T
    self._accumulate('G', G, n)


# -- BatchNorm: moments from Chainer's node, fewer passes --------------------

def _bn_forward_statistics(self, x, wanted):
    if 'F' not in wanted:
        return None
    return [x, self._reduce_axes(x), None]


def _bn_backward_statistics(self, context, gy):
    x, axes, node = context
    xp = backend.get_array_module(gy)
    n = gy.shape[0]
    sample_axes = tuple(a for a in axes if a != 0)
    mean = getattr(node, 'mean', None)
    inv_std = getattr(node, 'inv_std', None)
    if mean is None or inv_std is None:
        mean = x.mean(axis=axes)
        inv_std = 1 / xp.sqrt(x.var(axis=axes) + self.link.eps)
    # v = sum gy;  u = sum gy x_hat = inv_std (sum gy x - mean v)
    v = gy.sum(axis=sample_axes).reshape(n, -1)
    columns = []
    if getattr(self.link, 'gamma', None) is not None:
        gx = (gy * x).sum(axis=sample_axes).reshape(n, -1)
        columns.append((gx - mean.ravel() * v) * inv_std.ravel())
    if getattr(self.link, 'beta', None) is not None:
        columns.append(v)
    Z = xp.concatenate(columns, axis=1) * n
    if self.bn_fisher == 'diagonal':
        self._accumulate('F', (Z * Z).sum(axis=0), n)
    else:
        self._accumulate('F', Z.T @ Z, n)


def _hook_backward_preprocess(self, function, in_data, out_grad):
    gy = out_grad[self.output_index]
    if gy is None:
        return
    if isinstance(self.block, batch_normalization.BatchNormalizationBlock):
        # The node's forward computed the batch moments already.
        self.context[2] = function
    self.block.backward_statistics(self.context, gy)


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

def _subsampled_conv_columns(ratio):
    """Every ``ratio``-th output position (per sample) for the A factor,
    rescaled by ``ratio`` so that A keeps its sum-over-positions scale."""
    def columns(block, x):
        Q, n = _conv_columns(block, x)
        T = Q.shape[1] // n
        if T < 2 * ratio:
            return Q, n
        keep = Q.reshape(Q.shape[0], n, T)[:, :, ::ratio]
        Q = numpy.ascontiguousarray(keep).reshape(Q.shape[0], -1)
        return Q * numpy.sqrt(T / keep.shape[2]).astype(Q.dtype), n
    return columns


def _forward_statistics_subsampled(ratio):
    columns = _subsampled_conv_columns(ratio)

    def forward_statistics(self, x, wanted):
        if 'A' in wanted and isinstance(
                self, convolution_2d.Convolution2DBlock):
            Q, n = columns(self, x)
            xp = backend.get_array_module(Q)
            d = Q.shape[0]
            if self.has_bias:
                # The homogeneous 1 is scaled like the kept columns.
                root = float(numpy.sqrt(ratio))
                A = xp.empty((d + 1, d + 1), dtype=Q.dtype)
                A[:d, :d] = Q @ Q.T
                A[:d, d] = A[d, :d] = Q.sum(axis=1) * root
                A[d, d] = Q.shape[1] * ratio
            else:
                A = Q @ Q.T
            self._accumulate('A', A, n)
            return True if 'G' in wanted else None
        return _forward_statistics_columns(self, x, wanted)
    return forward_statistics


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


# -- Curvature stage on one BLAS thread (per worker) --------------------------

_controller = []


def _blas_controller():
    if not _controller:
        import threadpoolctl
        _controller.append(threadpoolctl.ThreadpoolController())
    return _controller[0]


def _original(cls, name):
    f = cls.__dict__[name]
    return getattr(f, '_bench_original', f)


def _update_curvature_blas1(original):
    # OpenBLAS with 2 threads makes potrf/potri and the many small GEMMs of
    # this stage 3x slower than with 1 (thread hand-offs between short
    # calls); forward/backward keep every thread.
    def update_curvature(self, stats):
        with _blas_controller().limit(limits=1, user_api='blas'):
            return original(self, stats)
    return update_curvature


def _update_curvature_parallel(workers):
    """The library's update_curvature with the inverses and the
    preconditioning of the blocks spread over ``workers`` Python threads of
    one BLAS thread each (LAPACK and BLAS release the GIL), largest first."""
    def update_curvature(self, stats):
        import chainer
        from chainerkfac.curvature import base as base_module
        step = self.t
        hp = self.hyperparam
        owned = list(self._stages.owned(self.blocks))
        rates = {}
        with _blas_controller().limit(limits=1, user_api='blas'):
            for block in owned:
                if block in stats:
                    try:
                        rates[block] = block.update_factors(
                            step, stats[block], hp.cov_ema_decay)
                    except base_module.NonFiniteError:
                        if self.nonfinite == 'raise':
                            raise

            def invert(block):
                return block.update_inverse(step,
                                            block.effective_damping(hp))

            def precondition(block):
                block.precondition(hp.weight_decay)

            order = sorted(owned, key=lambda b: -b.state_bytes())
            pool = _pool(workers)
            timer = harness._current[0]
            timer.enter('inversion_pool')
            try:
                inverse_refreshes = sum(pool.map(invert, order))
            finally:
                timer.leave()
            timer.enter('precondition_pool')
            try:
                list(pool.map(precondition, order))
            finally:
                timer.leave()
        self._stages.gather(self, rates)
        measured = [r for block_rates in rates.values()
                    for r in block_rates.values() if r is not None]
        report = {'kfac/damping': hp.damping,
                  'kfac/factor_refreshes': sum(map(len, rates.values())),
                  'kfac/inverse_refreshes': inverse_refreshes,
                  'kfac/skipped_steps': 0}
        if measured:
            report['kfac/change_rate'] = sum(measured) / len(measured)
        chainer.report(report)
    return update_curvature


_pools = {}


def _pool(workers):
    import concurrent.futures
    if workers not in _pools:
        _pools[workers] = concurrent.futures.ThreadPoolExecutor(workers)
    return _pools[workers]


def _update_curvature_precondition_seq(self, stats):
    """Inverses in the library's per-block pool (one BLAS thread each),
    then every block's preconditioning in order with all BLAS threads: on
    stale steps the pool and the thread limit are skipped entirely."""
    import chainer
    from chainerkfac import cpu_parallel
    from chainerkfac.curvature import base as base_module
    step = self.t
    hp = self.hyperparam
    rates = {}
    owned = self._stages.owned(self.blocks)
    for block in owned:
        if block in stats:
            try:
                rates[block] = block.update_factors(
                    step, stats[block], hp.cov_ema_decay)
            except base_module.NonFiniteError:
                if self.nonfinite == 'raise':
                    raise

    def due(block):
        damping = block.effective_damping(hp)
        return (all(block.factor[f] is not None for f in block.factors)
                and (block._factors_changed
                     or damping != block._damping_used)
                and block.inverse_schedule.due(step))

    refresh = [b for b in owned if due(b)]
    inverse_refreshes = sum(cpu_parallel.map_blocks(
        lambda b: b.update_inverse(step, b.effective_damping(hp)),
        refresh)) if refresh else 0
    timer = harness._current[0]
    for block in owned:
        block.precondition(hp.weight_decay)
    del timer
    self._stages.gather(self, rates)
    measured = [r for block_rates in rates.values()
                for r in block_rates.values() if r is not None]
    report = {'kfac/damping': hp.damping,
              'kfac/factor_refreshes': sum(map(len, rates.values())),
              'kfac/inverse_refreshes': inverse_refreshes,
              'kfac/skipped_steps': 0}
    if measured:
        report['kfac/change_rate'] = sum(measured) / len(measured)
    chainer.report(report)


def precondition_seq():
    from chainerkfac.optimizers import kfac
    return harness.Patch('precondition_seq', [
        (kfac.KFAC, 'update_curvature', _update_curvature_precondition_seq)],
        doc='only the due inverses go to the per-block pool (one BLAS '
            'thread each); preconditioning runs in order with all BLAS '
            'threads, so stale steps skip the pool and the thread limit')


def blas1():
    from chainerkfac.optimizers import kfac
    original = _original(kfac.KFAC, 'update_curvature')
    return harness.Patch('blas1', [
        (kfac.KFAC, 'update_curvature', _update_curvature_blas1(original))],
        doc='update_curvature under threadpoolctl limit of 1 BLAS thread')


def parallel2():
    from chainerkfac.optimizers import kfac
    return harness.Patch('parallel2', [
        (kfac.KFAC, 'update_curvature', _update_curvature_parallel(2))],
        doc='1 BLAS thread; inverses + preconditioning of the blocks in a '
            'pool of 2 Python threads, largest block first')


def fast_stats():
    return harness.Patch('fast_stats', [
        (kronecker.KroneckerBlock, 'forward_statistics',
         _forward_statistics_columns),
        (kronecker.KroneckerBlock, 'backward_statistics',
         _backward_statistics_columns),
        (batch_normalization.BatchNormalizationBlock, 'forward_statistics',
         _bn_forward_statistics),
        (batch_normalization.BatchNormalizationBlock, 'backward_statistics',
         _bn_backward_statistics),
        (hooks.OutputGradientHook, 'backward_preprocess',
         _hook_backward_preprocess),
    ], doc='Kronecker statistics as (d, nT) columns and Q @ Q.T (no '
           'transposed copy; no im2col for 1x1 convs); BatchNorm moments '
           'taken from Chainer\'s node and u = inv_std (sum gy x - mean v)')


def bn_stats():
    return harness.Patch('bn_stats', [
        (batch_normalization.BatchNormalizationBlock, 'forward_statistics',
         _bn_forward_statistics),
        (batch_normalization.BatchNormalizationBlock, 'backward_statistics',
         _bn_backward_statistics),
        (hooks.OutputGradientHook, 'backward_preprocess',
         _hook_backward_preprocess),
    ], doc='BatchNorm statistics only: moments taken from Chainer\'s '
           'BatchNormalization node in the backward hook instead of '
           'x.mean/x.var in the forward hook, and u = inv_std (sum gy x - '
           'mean v) instead of forming x_hat')


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
        p = fast_stats()
        p.replacements[0] = (kronecker.KroneckerBlock, 'forward_statistics',
                             _forward_statistics_subsampled(ratio))
        p.name = 'subsample{}'.format(ratio)
        p.doc = ('fast_stats, and the conv A factor from every {}-th output '
                 'position (rescaled)'.format(ratio))
        return p
    return make


def all_fixes():
    # The (d, nT) columns and the per-block thread pool are in the library
    # since f027fa3 / 39a8d91; what remains proposed:
    parts = [bn_stats(), lean_inverse(), fused_finite()]
    return harness.Patch('all', [r for p in parts for r in p.replacements],
                         doc=' + '.join(p.name for p in parts))


PATCHES = {
    'fast_stats': fast_stats,
    'lean_inverse': lean_inverse,
    'fused_finite': fused_finite,
    'bn_stats': bn_stats,
    'precondition_seq': precondition_seq,
    'blas1': blas1,
    'parallel2': parallel2,
    'all': all_fixes,
    'subsample4': subsample(4),
}

del base
