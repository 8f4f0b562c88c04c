"""Timing instruments shared by the benchmark scripts.

Nothing here edits the library: stage times come from wrapping the methods of
the Fisher blocks (and of the optimizer and communicator) with timers at run
time, which :func:`instrument` does once per process. Timers are *exclusive*:
time spent in a nested stage (the hooks' ``forward_statistics`` inside the
model's forward, ``update_inverse`` inside the optimizer's update) counts
for that stage only.

Stages, as in the profile figure of Osawa et al. (CVPR 2019)::

    forward         the model's forward pass (without the hooks' statistics)
    backward        backward pass (without the hooks' statistics)
    statistics      forward_statistics + backward_statistics (the hooks),
                    take_statistics, update_factors (EMA, change rate, checks)
    communication   the communicator's collectives (0 in one process)
    inversion       FisherBlock.update_inverse (building the inverse form)
    precondition    the stages' precondition (gradient, F^-1 grad, write
                    back; the parts of split blocks)
    update          everything else in optimizer.update (finite-gradient
                    checks, the momentum update rule, hooks, bookkeeping)
"""
import collections
import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import numpy

#: Coarse stages of the breakdown (column order of the tables).
STAGES = ('forward', 'backward', 'statistics', 'communication', 'inversion',
          'precondition', 'update')

#: Fine-grained timer name -> coarse stage.
FINE_TO_STAGE = {
    'forward': 'forward',
    'backward': 'backward',
    'stats_forward': 'statistics',
    'stats_backward': 'statistics',
    'stats_take': 'statistics',
    'factor_update': 'statistics',
    'communication': 'communication',
    'inversion': 'inversion',
    'precondition': 'precondition',
    'inversion_pool': 'inversion',        # patches.parallel2: a thread pool
    'precondition_pool': 'precondition',  # timed as a whole
    'finite_check': 'update',
    'optimizer': 'update',
}


class StageTimer:
    """Exclusive wall time per named stage, with call counts.

    ``enter(name)`` / ``leave()`` nest; the time between two events goes to
    the innermost open stage of the calling thread. Time measured on other
    threads than the creator's (the library's per-block thread pool,
    :mod:`chainerkfac.cpu_parallel`) is kept apart, summed over threads, in
    :attr:`worker_totals`; :meth:`coarse` splits the wall time of the pool
    (stage ``curvature_pool``) between the stages that ran in it, in
    proportion to their thread-summed times.

    ``synchronize`` (see :func:`synchronizer`) is called at every stage
    boundary before the clock is read, so that a GPU's queued work counts
    for the stage that queued it; it also costs the overlap of the host's
    kernel launches with the device's work, so step totals are taken
    without it unless a breakdown is asked for.
    """

    def __init__(self, synchronize=None):
        self._synchronize = synchronize
        self.totals = collections.defaultdict(float)
        self.worker_totals = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._thread = threading.get_ident()
        self._threads = {}
        self._lock = threading.Lock()

    def _state(self):
        tid = threading.get_ident()
        state = self._threads.get(tid)
        if state is None:
            state = self._threads[tid] = [[], None]
        return tid, state

    def enter(self, name):
        if self._synchronize is not None:
            self._synchronize()
        now = time.perf_counter()
        tid, state = self._state()
        stack = state[0]
        totals = self.totals if tid == self._thread else self.worker_totals
        with self._lock:
            if stack:
                totals[stack[-1]] += now - state[1]
            self.calls[name] += 1
        stack.append(name)
        state[1] = now

    def leave(self):
        if self._synchronize is not None:
            self._synchronize()
        now = time.perf_counter()
        tid, state = self._state()
        totals = self.totals if tid == self._thread else self.worker_totals
        with self._lock:
            totals[state[0].pop()] += now - state[1]
        state[1] = now

    @contextlib.contextmanager
    def stage(self, name):
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def reset(self):
        self.totals.clear()
        self.worker_totals.clear()
        self.calls.clear()

    def fine(self):
        """Main-thread stages, plus the pool's wall time split between the
        stages that ran on worker threads."""
        out = dict(self.totals)
        pool = out.pop('curvature_pool', 0.0)
        work = {k: v for k, v in self.worker_totals.items() if v > 0}
        if pool and work:
            total = sum(work.values())
            for k, v in work.items():
                out[k] = out.get(k, 0.0) + pool * v / total
        elif pool:
            out['optimizer'] = out.get('optimizer', 0.0) + pool
        return out

    def coarse(self):
        out = dict.fromkeys(STAGES, 0.0)
        for name, value in self.fine().items():
            out[FINE_TO_STAGE.get(name, 'update')] += value
        return out


def synchronizer(device):
    """A function waiting for the work queued on Chainer ``device``, or
    None for the CPU (NumPy runs synchronously)."""
    if device.xp is numpy:
        return None
    return device.device.synchronize


class DevicePeakMemory:
    """The most bytes CuPy's default memory pool had in use inside a
    ``with`` block, counted from its use on entering.

    A CuPy memory hook reads the pool after every allocation; the pool's
    cached free blocks are not counted.
    """

    def __init__(self):
        import cupy

        class Hook(cupy.cuda.MemoryHook):
            name = 'DevicePeakMemory'

            def malloc_postprocess(hook, **kwargs):
                self.peak = max(self.peak, self._pool.used_bytes())

        self._pool = cupy.get_default_memory_pool()
        self._hook = Hook()
        self.peak = self.base = 0

    def __enter__(self):
        self.peak = self.base = self._pool.used_bytes()
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        self._hook.__exit__(*exc)

    @property
    def bytes(self):
        return self.peak - self.base


class _NullTimer(StageTimer):
    def enter(self, name):
        pass

    def leave(self):
        pass


#: The timer the wrapped methods report to; :func:`use_timer` swaps it.
_current = [_NullTimer()]


@contextlib.contextmanager
def use_timer(timer):
    old = _current[0]
    _current[0] = timer
    try:
        yield timer
    finally:
        _current[0] = old


def _wrap(cls, method_name, stage):
    original = cls.__dict__[method_name]
    if getattr(original, '_bench_wrapped', False):
        return

    @functools.wraps(original)
    def timed(*args, **kwargs):
        timer = _current[0]
        timer.enter(stage)
        try:
            return original(*args, **kwargs)
        finally:
            timer.leave()
    timed._bench_wrapped = True
    timed._bench_stage = stage
    timed._bench_original = original
    setattr(cls, method_name, timed)


def _wrap_function(module, name, stage):
    original = getattr(module, name)
    if getattr(original, '_bench_wrapped', False):
        return

    @functools.wraps(original)
    def timed(*args, **kwargs):
        timer = _current[0]
        timer.enter(stage)
        try:
            return original(*args, **kwargs)
        finally:
            timer.leave()
    timed._bench_wrapped = True
    timed._bench_stage = stage
    setattr(module, name, timed)


_instrumented = [False]


def instrument():
    """Wraps the library's stage methods with timers (idempotent)."""
    if _instrumented[0]:
        return
    _instrumented[0] = True
    import chainerkfac
    from chainerkfac.curvature import base, kronecker, batch_normalization
    plan = [
        ('forward_statistics', 'stats_forward'),
        ('backward_statistics', 'stats_backward'),
        ('take_statistics', 'stats_take'),
        ('update_factors', 'factor_update'),
        ('update_inverse', 'inversion'),
        ('precondition', 'precondition'),
    ]
    classes = [base.FisherBlock, kronecker.KroneckerBlock,
               batch_normalization.BatchNormalizationBlock]
    for extra in chainerkfac.curvature.registry._blocks.values():
        if extra not in classes:
            classes.append(extra)
    for cls in classes:
        for name, stage in plan:
            if name in cls.__dict__:
                _wrap(cls, name, stage)
    from chainerkfac.optimizers import nonfinite
    _wrap(nonfinite.FiniteChecks, '_check_finite_gradients', 'finite_check')
    from chainerkfac.optimizers import stages
    _wrap(stages.LocalStages, 'precondition', 'precondition')
    try:
        from chainerkfac.distributed import multi_node_optimizer
        _wrap(multi_node_optimizer.HybridParallelStages, 'precondition',
              'precondition')
    except ImportError:  # pragma: no cover
        pass
    try:
        from chainerkfac import cpu_parallel
        _wrap_function(cpu_parallel, 'map_blocks', 'curvature_pool')
    except ImportError:  # a library without the per-block thread pool
        pass
    try:
        from chainerkfac.distributed import communicator
        for name in ('reduce_scatter_v', 'all_gather_v', 'alltoall_v',
                     'allreduce_mean', 'bcast_array', 'group_bcast'):
            if name in communicator.KfacCommunicatorMixin.__dict__:
                _wrap(communicator.KfacCommunicatorMixin, name,
                      'communication')
    except ImportError:  # pragma: no cover
        pass
    try:
        from chainerkfac.distributed import cholesky
        _wrap_function(cholesky, 'shared_cholesky', 'inversion')
    except ImportError:  # a library without shared factorizations
        pass


def instrument_communicator(comm):
    """Times the object collectives of one communicator instance too."""
    for name in ('allreduce_obj', 'bcast_obj', 'allreduce_grad',
                 'multi_node_mean_grad', 'bcast_data'):
        if not hasattr(comm, name):
            continue
        original = getattr(comm, name)

        def timed(*args, _original=original, **kwargs):
            timer = _current[0]
            timer.enter('communication')
            try:
                return _original(*args, **kwargs)
            finally:
                timer.leave()
        setattr(comm, name, timed)


class Patch:
    """A reversible set of attribute replacements (a proposed code change
    applied at run time, for A/B runs interleaved with the original)."""

    def __init__(self, name, replacements, doc=''):
        self.name = name
        self.replacements = replacements  # [(owner, attr, new)]
        self.doc = doc
        self._saved = None

    def apply(self):
        self._saved = [(owner, attr, owner.__dict__.get(attr))
                       for owner, attr, _ in self.replacements]
        for owner, attr, new in self.replacements:
            old = owner.__dict__.get(attr)
            if getattr(old, '_bench_wrapped', False):
                new = _rewrap(new, old)
            setattr(owner, attr, new)

    def revert(self):
        for owner, attr, old in reversed(self._saved):
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._saved = None

    @contextlib.contextmanager
    def applied(self):
        self.apply()
        try:
            yield
        finally:
            self.revert()


def _rewrap(new, wrapped_old):
    """Keeps the stage timer around a replaced (already timed) method."""
    stage = wrapped_old._bench_stage

    @functools.wraps(new)
    def timed(*args, **kwargs):
        timer = _current[0]
        timer.enter(stage)
        try:
            return new(*args, **kwargs)
        finally:
            timer.leave()
    timed._bench_wrapped = True
    timed._bench_stage = stage
    return timed


# -- training -----------------------------------------------------------------

def train_step(model, optimizer, x, t):
    """One classification step, timed: softmax cross-entropy of
    ``model(x)`` against ``t``, backward, ``optimizer.update()``. Returns
    ``(loss, seconds)``."""
    import chainer.functions as F
    t0 = time.perf_counter()
    model.cleargrads()
    loss = F.softmax_cross_entropy(model(x), t)
    loss.backward()
    value = float(loss.array)
    del loss
    optimizer.update()
    return value, time.perf_counter() - t0


# -- statistics ---------------------------------------------------------------

def summary(values):
    """Median, quartiles, min, max and count of a list of seconds."""
    values = sorted(values)
    if not values:
        return None
    q = numpy.percentile(values, [25, 50, 75])
    return {'median': float(q[1]), 'p25': float(q[0]), 'p75': float(q[2]),
            'min': values[0], 'max': values[-1],
            'mean': float(statistics.fmean(values)), 'n': len(values)}


def fmt_s(seconds):
    if seconds is None:
        return '-'
    if seconds >= 1:
        return '{:.2f} s'.format(seconds)
    return '{:.1f} ms'.format(seconds * 1e3)


def fmt_bytes(n):
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if abs(n) < 1024 or unit == 'GiB':
            return ('{:.0f} {}' if unit == 'B' else '{:.1f} {}').format(
                n, unit)
        n /= 1024


def table(rows, header):
    """A Markdown table (list of rows of strings)."""
    widths = [max(len(str(r[i])) for r in [header] + rows)
              for i in range(len(header))]
    lines = ['| ' + ' | '.join(str(h).ljust(w)
                               for h, w in zip(header, widths)) + ' |',
             '|' + '|'.join('-' * (w + 2) for w in widths) + '|']
    for r in rows:
        lines.append('| ' + ' | '.join(str(c).ljust(w)
                                       for c, w in zip(r, widths)) + ' |')
    return '\n'.join(lines)


def environment(device=None):
    """What the numbers were measured on (and the GPU of a CuPy
    ``device``)."""
    import chainer
    info = {
        'python': sys.version.split()[0],
        'numpy': numpy.__version__,
        'chainer': chainer.__version__,
        'machine': platform.machine(),
        'cpus': os.cpu_count(),
        'load_average': os.getloadavg() if hasattr(os, 'getloadavg')
        else None,
        'allocator': dict(ALLOCATOR),
        'commit': _commit(),
    }
    try:
        import threadpoolctl
        info['blas'] = [
            {k: p.get(k) for k in ('internal_api', 'version',
                                   'num_threads')}
            for p in threadpoolctl.threadpool_info()]
    except Exception:  # pragma: no cover
        pass
    if device is not None and device.xp is not numpy:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(device.device.id)
        info['gpu'] = {
            'name': props['name'].decode(),
            'memory_bytes': props['totalGlobalMem'],
            'cupy': cupy.__version__,
            'cuda_runtime': cupy.cuda.runtime.runtimeGetVersion(),
            'cuda_driver': cupy.cuda.runtime.driverGetVersion(),
            'cudnn': chainer.backends.cuda.cudnn_enabled}
    return info


def _commit():
    """The repository's commit, with ``+changes`` when tracked files
    differ from it (None outside a Git checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        def git(*args):
            return subprocess.run(['git', '-C', root] + list(args),
                                  capture_output=True, text=True,
                                  check=True).stdout.strip()
        changed = git('status', '--porcelain', '--untracked-files=no')
        return git('rev-parse', '--short', 'HEAD') + (
            '+changes' if changed else '')
    except (OSError, subprocess.CalledProcessError):
        return None


_thread_limit = []

#: How the process's allocator was set up (see :func:`keep_freed_memory`).
ALLOCATOR = {'glibc': 'default'}


def keep_freed_memory():
    """Tells glibc's malloc to keep the memory a process frees.

    By default glibc maps every allocation over 32 MiB afresh and unmaps it
    when freed, and returns free memory at the top of its heap to the
    system, so the next step's arrays are fresh pages again, which cost
    time to fault in (on a virtual machine that hands free pages back to
    its hypervisor, about ten times what rewriting mapped memory costs).
    With ``M_MMAP_MAX = 0`` and a 2 GiB ``M_TRIM_THRESHOLD``, freed memory
    stays in the heap for the next step instead.
    """
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library('c'))
    m_trim_threshold, m_mmap_max = -1, -4
    if not (libc.mallopt(m_mmap_max, 0)
            and libc.mallopt(m_trim_threshold, 2 ** 31 - 1)):
        raise RuntimeError('mallopt failed: not glibc?')
    ALLOCATOR['glibc'] = 'freed memory kept (M_MMAP_MAX 0, ' \
        'M_TRIM_THRESHOLD 2 GiB)'


def limit_threads(n):
    """Caps the BLAS threads for the rest of the process (None: as is)."""
    if n is None:
        return
    import threadpoolctl
    _thread_limit.append(threadpoolctl.threadpool_limits(n))


def results_dir():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        'results')
    os.makedirs(path, exist_ok=True)
    return path


def write_json(name, payload):
    path = os.path.join(results_dir(), name)
    with open(path, 'w') as f:
        json.dump(payload, f, indent=1, sort_keys=False, default=_default)
    return path


def read_json(name):
    """The payload :func:`write_json` wrote as ``name``, or None."""
    path = os.path.join(results_dir(), name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _default(obj):
    if isinstance(obj, (numpy.integer,)):
        return int(obj)
    if isinstance(obj, (numpy.floating,)):
        return float(obj)
    if isinstance(obj, numpy.ndarray):
        return obj.tolist()
    return str(obj)
