"""Gradient accumulation: one batch as ``acc_iters`` micro-batches."""


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
