"""Fisher block of :class:`chainer.links.Convolution2D` (KFC convention).

``A`` sums ``a aᵀ`` over every output position of every sample. With
``spatial_subsample = s > 1`` only every ``s``-th output row and column
(about ``T / s²`` of the ``T`` positions) contribute, and ``A`` is rescaled
to the full count: under KFC's spatial homogeneity (Grosse & Martens 2016
§3) every position has the same statistics, so a subset of them estimates
the sum. This divides the work of the largest statistics (im2col and
``Q Qᵀ``) by about ``s²``.

``conv_factors='reduced'`` (Ba et al. 2017, appendix A; the convention in
:mod:`chainerkfac.curvature.kronecker`) takes both factors from each
sample's patches and output gradients summed over positions: no im2col,
and products over ``n`` columns instead of ``n T``
(:func:`tap_sums`).

A stride-1 convolution on a large input skips im2col
(:func:`shifted_gram`):
the block of ``A`` for kernel taps ``t`` and ``u`` is a sum of ``x[p]
x[p + u - t]ᵀ`` over a window of input positions ``p``, the same sum for
every pair with the same offset ``u - t`` up to the window's border.
"""
from chainer import backend
import numpy

from chainerkfac.curvature import kronecker


def _outside(full, kept):
    """The parts of interval ``full`` outside its sub-interval ``kept``."""
    (lo, hi), (a, b) = full, kept
    return [part for part in ((lo, a), (b, hi)) if part[0] < part[1]]


def _channels_innermost(v):
    """Whether the channels, axis 0 of ``v``, lie next to each other in
    memory (an NCHW array stored channels-last, as Chainer's CPU
    convolutions and every elementwise function after them leave it)."""
    return abs(v.strides[0]) == v.itemsize


def channel_columns(v):
    """``v`` of shape ``(c, ...)`` as a ``(c, m)`` matrix, copied only if it
    must be and then in the order of its memory.

    Gathering a channels-last array into channels-first rows is a
    transposing copy that costs more than the product over its columns
    (on ResNet-50 at 224 x 224 twice the ``syrk`` of a 1x1 convolution's
    ``A``); a channels-last array is returned as the transpose of its
    ``(m, c)`` rows, which BLAS takes as it is.
    """
    c = v.shape[0]
    if _channels_innermost(v):
        return v.transpose(tuple(range(1, v.ndim)) + (0,)).reshape(-1, c).T
    return v.reshape(c, -1)


def _kernel(link):
    return (link.ksize if isinstance(link.ksize, tuple)
            else (link.ksize, link.ksize))


def shifted_gram_pays(link, shape, spatial_subsample=1):
    """Whether the ``A`` of ``link`` on inputs of ``shape`` comes from
    :func:`shifted_gram`: stride and dilation 1, a kernel larger than 1x1,
    every position kept, and an output at least 4 kernel borders across (at
    7 x 7 a 3x3 convolution's border sums cost as much as they save)."""
    (kh, kw), (ph, pw) = _kernel(link), link.pad
    h, w = shape[2:]
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    return (link.stride == link.dilate == (1, 1) and spatial_subsample == 1
            and kh * kw > 1 and oh >= 4 * (kh - 1) and ow >= 4 * (kw - 1))


def _tap_window(tap, dilate, stride, pad, size, out):
    """The input indices (a slice) that kernel tap ``tap`` reads along one
    axis of length ``size`` over ``out`` output positions, the padding
    left out: ``tap dilate - pad + p stride`` for ``p < out``."""
    first = max(0, -(-(pad - tap * dilate) // stride))
    last = min(out, (size - 1 + pad - tap * dilate) // stride + 1)
    start = tap * dilate - pad + first * stride
    if last <= first:
        return slice(0, 0)
    return slice(start, start + (last - first - 1) * stride + 1, stride)


def tap_sums(x, ksize, stride, pad, dilate):
    """Each sample's im2col patches summed over the output positions, as
    ``(c kh kw, n)`` columns in the layout of ``W.reshape(out, -1)``.

    Tap ``(j, i)`` reads a strided window of the input, so its sum over
    positions is the window's sum; the padding adds zeros and is left
    out. The rows of each tap row ``j`` are summed once and their columns
    then per tap: ``kh`` reductions over the rows, ``kh kw`` over ``ow``
    columns, against ``kh kw`` over ``oh ow`` positions.
    """
    xp = backend.get_array_module(x)
    (kh, kw), (sy, sx), (ph, pw), (dy, dx) = ksize, stride, pad, dilate
    n, c, h, w = x.shape
    oh = (h + 2 * ph - dy * (kh - 1) - 1) // sy + 1
    ow = (w + 2 * pw - dx * (kw - 1) - 1) // sx + 1
    sums = xp.empty((n, c, kh, kw), dtype=x.dtype)
    for j in range(kh):
        rows = x[:, :, _tap_window(j, dy, sy, ph, h, oh)].sum(axis=2)
        for i in range(kw):
            sums[:, :, j, i] = rows[:, :, _tap_window(
                i, dx, sx, pw, w, ow)].sum(axis=2)
    return sums.reshape(n, -1).T


def tap_pairs(h, w, ksize, pad):
    """The geometry of :func:`shifted_gram` on an ``h x w`` input.

    Yields ``(t, u, (dy, dx), rows, cols, out_rows, out_cols)`` for every
    pair of kernel taps ``t <= u`` (row-major), with ``δ = (dy, dx)`` their
    offset, ``rows`` and ``cols`` the input positions ``p`` with ``p`` and
    ``p + δ`` inside the input, and ``out_rows`` and ``out_cols`` the parts
    of those outside tap ``t``'s window (at most two each).
    """
    (kh, kw), (ph, pw) = ksize, pad
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    for t in range(kh * kw):
        j, i = divmod(t, kw)
        for u in range(t, kh * kw):
            dy, dx = u // kw - j, u % kw - i
            all_rows = (max(0, -dy), min(h, h - dy))
            all_cols = (max(0, -dx), min(w, w - dx))
            rows = (max(j - ph, all_rows[0]), min(j - ph + oh, all_rows[1]))
            cols = (max(i - pw, all_cols[0]), min(i - pw + ow, all_cols[1]))
            yield (t, u, (dy, dx), all_rows, all_cols,
                   _outside(all_rows, rows), _outside(all_cols, cols))


def shifted_gram(x, ksize, pad, out=None):
    """``Q Qᵀ`` for the im2col columns ``Q`` of a stride-1, dilation-1
    convolution, without forming ``Q`` (into ``out`` if given).

    With ``x̃`` the input (channels first), the block of taps ``t = (j,
    i)`` and ``u = t + δ`` is ``Σ_p x̃[p] x̃[p + δ]ᵀ`` over the input
    positions ``p`` that tap ``t`` reads, a window of the output's size
    shifted by ``t - pad``. One product per offset ``δ`` sums over every
    position (``kh kw`` offsets up to symmetry, against the ``(kh kw)²``
    blocks of ``Q Qᵀ``); each pair then subtracts the rows and columns
    outside its window, a border ``kh - 1`` and ``kw - 1`` wide, and adds
    back their corners (:func:`tap_pairs`). The input is laid out with
    ``kh - 1`` zero rows and ``kw - 1`` zero columns after each image, so
    that one flat shift by ``δ`` pairs exactly the positions ``δ`` apart.
    For a 3x3 convolution over 56 x 56 positions this is 3 times fewer
    operations than ``Q Qᵀ`` (as ``syrk``) and no 9-fold copy of the input.
    """
    xp = backend.get_array_module(x)
    (kh, kw) = ksize
    n, c, h, w = x.shape
    xt = x.transpose(1, 0, 2, 3)
    size = (h + kh - 1, w + kw - 1)
    if _channels_innermost(xt):
        # Laid out like the input: the copy moves whole channel vectors.
        spaced = xp.zeros((n,) + size + (c,), dtype=x.dtype).transpose(
            3, 0, 1, 2)
    else:
        spaced = xp.zeros((c, n) + size, dtype=x.dtype)
    spaced[:, :, :h, :w] = xt
    flat = spaced.reshape(c, -1)  # a view in either layout
    length, stride = flat.shape[1], w + kw - 1

    def window(rows, cols, dy, dx):
        a = channel_columns(xt[:, :, rows[0]:rows[1], cols[0]:cols[1]])
        b = channel_columns(xt[:, :, rows[0] + dy:rows[1] + dy,
                               cols[0] + dx:cols[1] + dx])
        return a @ b.T

    k = kh * kw
    gram = xp.empty((c * k, c * k), dtype=x.dtype) if out is None else out
    whole = {}
    for t, u, (dy, dx), all_rows, all_cols, out_rows, out_cols in \
            tap_pairs(h, w, ksize, pad):
        if (dy, dx) not in whole:
            # u >= t makes the flat shift non-negative.
            shift = dy * stride + dx
            whole[dy, dx] = flat[:, :length - shift] @ flat[:, shift:].T
        block = whole[dy, dx]
        if out_rows or out_cols:
            block = block.copy()
        for r in out_rows:
            block -= window(r, all_cols, dy, dx)
        for q in out_cols:
            block -= window(all_rows, q, dy, dx)
            for r in out_rows:
                block += window(r, q, dy, dx)
        # Row and column ch k + t of Q Qᵀ are channel ch at tap t.
        gram[t::k, u::k] = block
        gram[u::k, t::k] = block.T
    return gram


class Convolution2DBlock(kronecker.KroneckerBlock):
    """``A ⊗ G`` with ``A`` over im2col patches (stride, pad, dilation).

    Grouped convolutions (``groups > 1``) are not supported: their weight is
    block-diagonal across groups, which one ``A ⊗ G`` pair cannot express.
    Such links fall back to momentum SGD.
    """

    def __init__(self, link, name, options):
        super().__init__(link, name, options)
        self.spatial_subsample = options.spatial_subsample

    @classmethod
    def unsupported_reason(cls, link):
        if getattr(link, 'groups', 1) > 1:
            return 'groups={} (grouped convolution)'.format(link.groups)
        return None

    def _output_size(self, shape):
        """``(oh, ow)`` and the rows and columns of it that
        ``spatial_subsample`` keeps."""
        link = self.link
        kh, kw = _kernel(link)
        (sy, sx), (ph, pw), (dy, dx) = link.stride, link.pad, link.dilate
        h, w = shape[2:]
        oh = (h + 2 * ph - dy * (kh - 1) - 1) // sy + 1
        ow = (w + 2 * pw - dx * (kw - 1) - 1) // sx + 1
        s = self.spatial_subsample
        return (oh, ow), (-(-oh // s), -(-ow // s))

    def input_positions(self, x):
        kept_h, kept_w = self._output_size(x.shape)[1]
        return kept_h * kept_w

    def input_columns(self, x):
        """im2col written straight into ``(c kh kw, n oh ow)`` columns.

        One strided copy per kernel tap, in the layout of
        ``W.reshape(out, c kh kw)``; a 1x1 convolution without padding only
        needs its (strided) input. With ``spatial_subsample = s`` the taps
        step over every ``s``-th output row and column, and the columns
        stand for ``n T_kept / T`` samples, which rescales ``A`` to all
        ``T`` positions when the block divides by the sample count.
        """
        link = self.link
        kh, kw = _kernel(link)
        (sy, sx), (ph, pw), (dy, dx) = link.stride, link.pad, link.dilate
        s = self.spatial_subsample
        xp = backend.get_array_module(x)
        n, c, h, w = x.shape
        (oh, ow), (kept_h, kept_w) = self._output_size(x.shape)
        samples = n * (kept_h * kept_w) / (oh * ow) if s > 1 else n
        xt = x.transpose(1, 0, 2, 3)
        if kh == kw == 1 and ph == pw == 0:
            taps = xt[:, :, :sy * oh:sy * s, :sx * ow:sx * s]
            return channel_columns(taps), samples
        if ph or pw:
            padded = xp.zeros((c, n, h + 2 * ph, w + 2 * pw), dtype=x.dtype)
            padded[:, :, ph:ph + h, pw:pw + w] = xt
        else:
            padded = xt
        cols = xp.empty((c, kh, kw, n, kept_h, kept_w), dtype=x.dtype)
        for j in range(kh):
            for i in range(kw):
                cols[:, j, i] = padded[:, :, j * dy:j * dy + sy * oh:sy * s,
                                       i * dx:i * dx + sx * ow:sx * s]
        return cols.reshape(c * kh * kw, -1), samples

    def input_moments(self, x, sums, out=None):
        """:func:`~chainerkfac.curvature.convolution_2d.shifted_gram` where
        :func:`~chainerkfac.curvature.convolution_2d.shifted_gram_pays` on
        the CPU, else im2col columns.

        On a GPU, one im2col of the batch and one product launch far fewer
        kernels than the shifted sums' many small products.
        """
        link = self.link
        if backend.get_array_module(x) is not numpy or not shifted_gram_pays(
                link, x.shape, self.spatial_subsample):
            return super().input_moments(x, sums, out)
        (kh, kw), (ph, pw) = _kernel(link), link.pad
        n = len(x)
        (oh, ow), _ = self._output_size(x.shape)
        row_sums = None
        if sums:
            # Tap (j, i) reads input rows j - ph ... j - ph + oh - 1.
            total = x.sum(axis=0)
            xp = backend.get_array_module(x)
            row_sums = xp.stack([
                total[:, max(j - ph, 0):j - ph + oh,
                      max(i - pw, 0):i - pw + ow].sum(axis=(1, 2))
                for j in range(kh) for i in range(kw)], axis=1).ravel()
        return (shifted_gram(x, (kh, kw), (ph, pw), out), row_sums,
                n * oh * ow, n)

    def input_position_sums(self, x):
        link = self.link
        return tap_sums(x, _kernel(link), link.stride, link.pad,
                        link.dilate), len(x)

    def output_position_sums(self, gy):
        return gy.reshape(gy.shape[0], gy.shape[1], -1).sum(axis=2).T, \
            len(gy)

    def output_columns(self, gy):
        n, out = gy.shape[:2]
        xp = backend.get_array_module(gy)
        Q = xp.ascontiguousarray(gy.reshape(n, out, -1).transpose(1, 0, 2))
        return Q.reshape(out, -1), n
