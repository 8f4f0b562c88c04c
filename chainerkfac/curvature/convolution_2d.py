"""Fisher block of :class:`chainer.links.Convolution2D` (KFC convention)."""
import numpy
from chainer import backend
from chainer.utils import conv

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

    def input_rows(self, x):
        link = self.link
        kh, kw = link.ksize if isinstance(link.ksize, tuple) else \
            (link.ksize, link.ksize)
        xp = backend.get_array_module(x)
        im2col = conv.im2col_cpu if xp is numpy else conv.im2col_gpu
        cols = im2col(x, kh, kw, link.stride[0], link.stride[1],
                      link.pad[0], link.pad[1], dy=link.dilate[0],
                      dx=link.dilate[1])
        n, c = cols.shape[:2]
        # (n, c, kh, kw, oh, ow) -> rows (n oh ow, c kh kw), matching the
        # layout of W.reshape(out, c kh kw).
        rows = cols.reshape(n, c * kh * kw, -1).transpose(0, 2, 1)
        return rows.reshape(-1, c * kh * kw), n

    def output_rows(self, gy):
        n, out = gy.shape[:2]
        R = gy.reshape(n, out, -1).transpose(0, 2, 1).reshape(-1, out)
        return R, n, R.shape[0] // n
