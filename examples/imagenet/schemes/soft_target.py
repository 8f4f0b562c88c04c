"""Soft-target cross entropy and the classifier that trains on it.

With mixed targets ỹ (rows summing to 1, :mod:`running_mixup`) the loss is::

    L = -(1/n) Σ_i Σ_c ỹ_ic log softmax(z_i)_c

which equals the usual softmax cross entropy when ỹ is one-hot. The original
implementation reported the hard-label cross entropy while back-propagating
the soft one; here the reported ``loss`` is the value that is differentiated.
"""
import chainer
import chainer.functions as F


def soft_target_cross_entropy(z, y):
    """Mean over the batch of ``-Σ_c y_c log softmax(z)_c``.

    Args:
        z: Class scores (n, C).
        y: Target distributions (n, C).
    """
    return -F.sum(y * F.log_softmax(z)) / z.shape[0]


class SoftTargetClassifier(chainer.Chain):
    """Wraps a predictor; its loss uses soft targets when they are given.

    ``model(x, t)`` returns the softmax cross entropy against the labels
    ``t``; ``model(x, t, y)`` (what :class:`RunningMixup` feeds) returns
    :func:`soft_target_cross_entropy` against ``y``. Either way it reports
    that loss as ``loss`` and the top-1 accuracy of the scores against ``t``
    (the current batch's labels, the largest component of a mixed target)
    as ``accuracy``.
    """

    def __init__(self, predictor):
        super().__init__()
        with self.init_scope():
            self.predictor = predictor

    def forward(self, x, t, y=None):
        z = self.predictor(x)
        if y is None:
            loss = F.softmax_cross_entropy(z, t)
        else:
            loss = soft_target_cross_entropy(z, y)
        chainer.report({'loss': loss, 'accuracy': F.accuracy(z, t)}, self)
        return loss
