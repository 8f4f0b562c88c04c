# chainerkfac applies the NumPy-2 shims before anything imports Chainer.
import chainerkfac  # NOQA
