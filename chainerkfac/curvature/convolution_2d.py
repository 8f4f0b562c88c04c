"""Fisher block of :class:`chainer.links.Convolution2D` (KFC convention)."""
from chainer import backend

from chainerkfac.curvature import kronecker


class Convolution2DBlock(kronecker.KroneckerBlock):
    """``A ⊗ G`` with ``A`` over im2col patches (stride, pad, dilation).

    Grouped convolutions (``groups > 1``) are not supported: their weight is
    block-diagonal across groups, which one ``A ⊗ G`` pair cannot express.
    Such links fall back to momentum SGD.
    """

    @classmethod
    def unsupported_reason(cls, link):
        if getattr(link, 'groups', 1) > 1:
            return 'groups={} (grouped convolution)'.format(link.groups)
        return None

    def input_columns(self, x):
        """im2col written straight into ``(c kh kw, n oh ow)`` columns.

        One strided copy per kernel tap, in the layout of
        ``W.reshape(out, c kh kw)``; a 1x1 convolution without padding only
        needs its (strided) input.
        """
        link = self.link
        kh, kw = (link.ksize if isinstance(link.ksize, tuple)
                  else (link.ksize, link.ksize))
        (sy, sx), (ph, pw), (dy, dx) = link.stride, link.pad, link.dilate
        xp = backend.get_array_module(x)
        n, c, h, w = x.shape
        oh = (h + 2 * ph - dy * (kh - 1) - 1) // sy + 1
        ow = (w + 2 * pw - dx * (kw - 1) - 1) // sx + 1
        xt = x.transpose(1, 0, 2, 3)
        if kh == kw == 1 and ph == pw == 0:
            taps = xt[:, :, :sy * oh:sy, :sx * ow:sx]
            return xp.ascontiguousarray(taps).reshape(c, -1), n
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
        return cols.reshape(c * kh * kw, -1), n

    def output_columns(self, gy):
        n, out = gy.shape[:2]
        xp = backend.get_array_module(gy)
        Q = xp.ascontiguousarray(gy.reshape(n, out, -1).transpose(1, 0, 2))
        return Q.reshape(out, -1), n

