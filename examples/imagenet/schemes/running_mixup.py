"""Running mixup (Osawa et al. §4.1), as the updater's batch converter.

Mixup (Zhang et al. 2018) trains on convex combinations of samples. The
running variant mixes each new batch with the previous step's *mixed* batch,
so older samples keep contributing with geometrically decaying weights::

    λ ~ Beta(α, α),  λ <- max(λ, 1 - λ)
    x̃_t = λ x_t + (1 - λ) x̃_{t-1}
    ỹ_t = λ y_t + (1 - λ) ỹ_{t-1}          (y_t one-hot)

``max(λ, 1 - λ) >= 1/2`` keeps the current sample dominant (the original
implementation's choice). As in that implementation one λ is drawn per
sample, and the first batch (no previous one) is used as it is. Row ``i`` of
a batch is mixed with row ``i`` of the previous mixed batch; the iterator
shuffles, so these are unrelated images.

The converter returns ``(x̃, t, ỹ)``: ``t`` (the current hard labels) is kept
for the accuracy, ``ỹ`` is the target of the loss (:mod:`soft_target`).
"""
import numpy
from chainer import backend
from chainer import dataset
from chainer import serializer as serializer_module


class RunningMixup(dataset.Converter):
    """Converter applying running mixup to each training batch.

    It concatenates the examples ``(x, t)`` to the device like
    ``concat_examples`` before mixing.

    Args:
        alpha (float): Parameter α of the Beta distribution.
        n_classes (int): Number of classes (length of the one-hot labels).
        seed (int or None): Seed of the λ generator.

    State: the previous mixed batch ``(x̃_{t-1}, ỹ_{t-1})`` is saved by
    :meth:`serialize`, so a resumed run continues the recursion. The state of
    the λ generator is not saved: after a resume λ is drawn from the
    generator created with ``seed``. A batch whose shape differs from the
    previous one (e.g. after changing the batch size) restarts the recursion.
    """

    def __init__(self, alpha, n_classes, seed=None):
        if not alpha > 0:
            raise ValueError('mixup alpha must be positive, got {}'
                             .format(alpha))
        self.alpha = alpha
        self.n_classes = n_classes
        self.rng = numpy.random.default_rng(seed)
        self.previous = None  # (x̃_{t-1}, ỹ_{t-1})

    def sample_lambda(self, n):
        """Draws ``n`` values of ``max(λ, 1 - λ)``, ``λ ~ Beta(α, α)``."""
        lam = self.rng.beta(self.alpha, self.alpha, size=n)
        return numpy.maximum(lam, 1.0 - lam)

    def __call__(self, batch, device=None):
        x, t = dataset.concat_examples(batch, device)
        xp = backend.get_array_module(x)
        y = xp.eye(self.n_classes, dtype=x.dtype)[t]
        if self.previous is not None and self.previous[0].shape == x.shape:
            # The saved state may come from a snapshot on the other device.
            prev_x, prev_y = (xp.asarray(a) for a in self.previous)
            lam = xp.asarray(self.sample_lambda(len(x)), dtype=x.dtype)
            lam_x = lam.reshape((-1,) + (1,) * (x.ndim - 1))
            x = lam_x * x + (1 - lam_x) * prev_x
            y = lam[:, None] * y + (1 - lam[:, None]) * prev_y
        self.previous = (x, y)
        return x, t, y

    def serialize(self, serializer):
        if isinstance(serializer, serializer_module.Deserializer):
            x = serializer('x', None)
            y = serializer('y', None)
            self.previous = None if x is None else (x, y)
        else:
            x, y = self.previous or (None, None)
            serializer('x', x)
            serializer('y', y)
