"""Weight rescaling, "Normalizing Weights" (van Laarhoven 2017; Osawa §4.5).

After each update the weight W of every Convolution2D and Linear link is
rescaled towards the norm a He-initialised layer has::

    W <- W min(1, sqrt(2 d_out) / (‖W‖ + ε)),   ε = 1e-9

with d_out its output dimension (Linear) or channels (Convolution2D). Only
shrinking is applied (the scale is capped at 1), as in the original
implementation. Biases and BatchNormalization parameters are untouched: the
BatchNormalization that follows a convolution makes the network invariant to
the convolution's scale, and growing norms would only shrink the effective
step size.
"""
import math

import chainer.links as L
from chainer import backend


class WeightRescaling:
    """Optimizer hook, run after each update (``timing = 'post'``)."""

    name = 'WeightRescaling'
    timing = 'post'
    eps = 1e-9

    def __call__(self, optimizer):
        for link in optimizer.target.links():
            if not isinstance(link, (L.Convolution2D, L.Linear)):
                continue
            w = link.W.array
            if w is None:
                continue
            xp = backend.get_array_module(w)
            # Scaling by min(1, .) on the device avoids a host sync per
            # layer; a factor of exactly 1 leaves the weight unchanged.
            target = math.sqrt(2.0 * w.shape[0])
            norm = xp.linalg.norm(w.ravel())
            w *= xp.minimum(1, target / (norm + self.eps)).astype(w.dtype)
