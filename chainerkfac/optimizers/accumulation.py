"""The gradients of a step: one batch as ``acc_iters`` micro-batches
(gradient accumulation), their gradients averaged."""
import logging

logger = logging.getLogger(__name__)


def micro_batches(args, kwds, k):
    """``[(args, kwds)]`` of ``k`` micro-batches: every array with a batch
    axis cut into ``k`` equal parts along axis 0, anything else passed to
    each whole."""
    if k == 1:
        return [(args, kwds)]
    sizes = {len(a) for a in list(args) + list(kwds.values())
             if hasattr(a, 'shape') and a.ndim > 0}
    if len(sizes) != 1 or next(iter(sizes)) % k:
        raise ValueError('KFAC acc_iters={} needs batch arrays of one '
                         'length divisible by it, got lengths {}'
                         .format(k, sorted(sizes)))
    m = next(iter(sizes)) // k

    def part(a, i):
        if hasattr(a, 'shape') and a.ndim > 0:
            return a[i * m:(i + 1) * m]
        return a
    return [(tuple(part(a, i) for a in args),
             {key: part(a, i) for key, a in kwds.items()})
            for i in range(k)]


def gradients(optimizer, lossfun, args, kwds):
    """The forward and backward stages: clears the gradients of
    ``optimizer.target`` and accumulates those of ``lossfun`` over
    ``optimizer.acc_iters`` micro-batches of the batch, their mean (at the
    optimizer's loss scale); returns the mean loss."""
    optimizer.target.cleargrads()
    losses = []
    for chunk_args, chunk_kwds in micro_batches(args, kwds,
                                                optimizer.acc_iters):
        with optimizer.timing('forward'):
            loss = lossfun(*chunk_args, **chunk_kwds)
        with optimizer.timing('backward'):
            loss.backward(loss_scale=optimizer.loss_scale)
        # A loss of shape (1,) backpropagates as a scalar one does.
        losses.append(loss.array.reshape(()))
        del loss
    if optimizer.acc_iters > 1:
        for param in optimizer.target.params():
            if param.grad is not None:
                param.grad /= optimizer.acc_iters
        for block in optimizer.blocks:
            block.scale_rows(1 / optimizer.acc_iters)
    return float(sum(losses)) / len(losses)


def again(optimizer, lossfun, args, kwds):
    """:func:`gradients` once more, after lazily initialised links got rank
    0's first weights past this step's backward; ``None`` without
    ``lossfun`` (the step is skipped, with a warning): the gradients came
    from each rank's own weights."""
    if lossfun is None:
        logger.warning(
            'iteration %d skipped: lazily initialised links got rank 0\'s '
            "first weights after this step's backward, whose gradients "
            "came from each rank's own; update(lossfun, *batch) computes "
            'them again instead', optimizer.t + 1)
        return None
    return gradients(optimizer, lossfun, args, kwds)
