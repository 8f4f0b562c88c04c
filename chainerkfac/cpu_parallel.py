"""Per-block curvature work spread over CPU threads.

BLAS parallelises each matrix call over its threads. The curvature stage of
K-FAC is many short, independent calls (inverses and preconditioning
products of every block), where handing work between BLAS threads costs more
than it saves: on this project's 2-core machine, preconditioning ResNet-50
with every width divided by 4 took 0.41 s a step with 2 OpenBLAS threads and
0.05 s with 1 (benchmarks/step_time.py). So while the stage runs, BLAS is
held to one thread and the blocks are spread over as many Python threads as
BLAS had (BLAS and LAPACK release the GIL), largest first. With one BLAS
thread (e.g. ``OMP_NUM_THREADS=1`` under ``mpiexec``) the blocks simply run
in order. Blocks on a GPU always run in order on the calling thread.
"""
import concurrent.futures

import numpy
import threadpoolctl
from chainer import backend

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


def map_blocks(function, blocks):
    """``[function(block) for block in blocks]``, on CPU threads if it pays.

    ``function`` must touch nothing but its own block.
    """
    if not blocks:
        return []
    if backend.get_array_module(blocks[0].params()[0].array) is not numpy:
        return [function(block) for block in blocks]
    controller = _controller().select(user_api='blas')
    workers = max([lib.num_threads for lib in controller.lib_controllers]
                  + [1])
    with controller.limit(limits=1):
        if workers == 1 or len(blocks) == 1:
            return [function(block) for block in blocks]
        # Largest first, so that no big block starts last.
        order = sorted(range(len(blocks)),
                       key=lambda i: -blocks[i].state_bytes())
        results = dict(zip(order, _pool(workers).map(
            lambda i: function(blocks[i]), order)))
    return [results[i] for i in range(len(blocks))]
