"""Fisher block of :class:`chainer.links.Convolution2D` (KFC convention).

``A`` sums ``a aᵀ`` over every output position of every sample. With
``spatial_subsample = s > 1`` only every ``s``-th output row and column
(about ``T / s²`` of the ``T`` positions) contribute, and ``A`` is rescaled
to the full count (Ba et al. 2017, appendix A: the A factor of a convolution
is estimated well from a subset of its positions); this divides the work of
the largest statistics (im2col and ``Q Qᵀ``) by about ``s²``.
"""
from chainer import backend

from chainerkfac.curvature import kronecker


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
        kh, kw = (link.ksize if isinstance(link.ksize, tuple)
                  else (link.ksize, link.ksize))
        (sy, sx), (ph, pw), (dy, dx) = link.stride, link.pad, link.dilate
        s = self.spatial_subsample
        xp = backend.get_array_module(x)
        n, c, h, w = x.shape
        oh = (h + 2 * ph - dy * (kh - 1) - 1) // sy + 1
        ow = (w + 2 * pw - dx * (kw - 1) - 1) // sx + 1
        kept_h, kept_w = -(-oh // s), -(-ow // s)
        samples = n * (kept_h * kept_w) / (oh * ow) if s > 1 else n
        xt = x.transpose(1, 0, 2, 3)
        if kh == kw == 1 and ph == pw == 0:
            taps = xt[:, :, :sy * oh:sy * s, :sx * ow:sx * s]
            return xp.ascontiguousarray(taps).reshape(c, -1), samples
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

    def output_columns(self, gy):
        n, out = gy.shape[:2]
        xp = backend.get_array_module(gy)
        Q = xp.ascontiguousarray(gy.reshape(n, out, -1).transpose(1, 0, 2))
        return Q.reshape(out, -1), n

