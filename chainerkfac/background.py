"""Inverses computed off the critical path (Ba, Grosse & Martens 2017,
§3.1).

With ``KFAC(inverse_delay=d)`` an inverse refreshed from the factors of
step ``t`` is built on a worker thread while steps ``t`` to ``t + d - 1``
go on with the inverse before it, and takes effect at step ``t + d`` (the
step waits for it if it is not done by then). The build works on copies of
the factors, taken at ``t``, so the numbers do not depend on the timing:
every run, single or distributed, resumed or not, takes the same steps.

On the CPU the worker's LAPACK calls release the GIL and run beside the
main thread's; on a GPU the worker builds on a stream of its own, so the
inversion's kernels can overlap the step's.
"""
import concurrent.futures

import numpy
from chainer import backend

_state = {}


def _executor():
    if 'executor' not in _state:
        _state['executor'] = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix='chainerkfac-inverse')
    return _state['executor']


def _on_own_stream(build, device, args):
    import cupy
    with device, cupy.cuda.Stream(non_blocking=True) as stream:
        form = build(*args)
        stream.synchronize()
    return form


def submit(build, factors, damping, reuse):
    """``build(copies of factors, damping, reuse)`` on the worker thread;
    returns a ``concurrent.futures.Future`` of the form."""
    copies = tuple(f.copy() for f in factors)
    device = backend.get_device_from_array(copies[0])
    if device.xp is not numpy:
        # The copies must be complete before another stream reads them.
        device.device.synchronize()
        return _executor().submit(_on_own_stream, build, device.device,
                                  (copies, damping, reuse))
    return _executor().submit(build, copies, damping, reuse)


def result(pending):
    """The form of a pending inverse: a Future's result (waiting for it if
    need be), or the form itself."""
    if isinstance(pending, concurrent.futures.Future):
        return pending.result()
    return pending
