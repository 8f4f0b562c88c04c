"""Per-block curvature work spread over CPU threads.

BLAS parallelises each matrix call over its threads. That pays for large
calls only: for the many modest inverses and preconditioning products of a
K-FAC step, handing work between OpenBLAS threads costs more than it saves,
and far more when another process competes for the cores (its threads then
spin waiting for each other); the largest factors still gain from every
thread (the figures: benchmarks/tuning_measurements.md, "The cost of a
K-FAC step").

So :func:`map_blocks` runs a block whose work reaches :data:`SERIAL_FLOPS`
on the calling thread with every BLAS thread, and spreads the smaller ones,
largest first, over as many Python threads as BLAS had, each holding BLAS to
one thread (BLAS and LAPACK release the GIL). With one BLAS thread (e.g.
``OMP_NUM_THREADS=1`` under ``mpiexec``) every block simply runs in order.
Blocks on a GPU always run in order on the calling thread.
"""
import concurrent.futures

import numpy
import threadpoolctl

# Importing SciPy's LAPACK loads its own BLAS, which the controller must see.
from scipy.linalg import lapack  # NOQA

_state = {}


def _controller():
    if 'controller' not in _state:
        _state['controller'] = threadpoolctl.ThreadpoolController()
    return _state['controller']


def _pool(workers):
    if _state.get('workers') != workers:
        if 'pool' in _state:
            _state['pool'].shutdown()
        _state['pool'] = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix='chainerkfac')
        _state['workers'] = workers
    return _state['pool']


#: Floating-point operations from which one block's work runs alone with
#: every BLAS thread (a Cholesky inverse of a factor of about 1300, or the
#: preconditioning of a 1024 x 785 layer).
SERIAL_FLOPS = 2e9


def map_blocks(function, blocks, flops):
    """``[function(block) for block in blocks]``, on CPU threads if it pays.

    ``flops(block)`` is the work ``function`` does on a block; ``function``
    must touch nothing but its own block.
    """
    if not blocks:
        return []
    if blocks[0].link.xp is not numpy:
        return [function(block) for block in blocks]
    controller = _controller().select(user_api='blas')
    workers = max([lib.num_threads for lib in controller.lib_controllers]
                  + [1])
    work = [flops(block) for block in blocks]
    results = {}
    small = []
    for i, block in enumerate(blocks):
        if workers == 1 or work[i] >= SERIAL_FLOPS:
            results[i] = function(block)
        else:
            small.append(i)
    if small:
        # Largest first, so that no big block starts last.
        small.sort(key=lambda i: -work[i])
        with controller.limit(limits=1):
            if len(small) == 1:
                results[small[0]] = function(blocks[small[0]])
            else:
                results.update(zip(small, _pool(workers).map(
                    lambda i: function(blocks[i]), small)))
    return [results[i] for i in range(len(blocks))]


def block_work(cost_name):
    """``block -> flops`` of one stage (``'inverse_cost'``,
    ``'precondition_cost'``), from the block's cost model (0 for a custom
    block without one), for :func:`map_blocks`."""
    def flops(block):
        cost = block.cost()
        return 0 if cost is None else getattr(cost, cost_name)
    return flops
