"""Measuring instruments shared by the benchmark scripts.

Stage times come from the library's own timing hook
(:mod:`chainerkfac.timing`): a script sets a
:class:`chainerkfac.timing.StageTimer` as the optimizer's ``stage_timer``
and times the forward and backward passes it runs itself with the same
timer. Nothing here edits or patches the library.
"""
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy

from chainerkfac import timing

#: Coarse stages of the breakdown (column order of the tables).
STAGES = timing.STAGES


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


# -- training -----------------------------------------------------------------

def train_step(model, optimizer, x, t):
    """One classification step, timed: softmax cross-entropy of
    ``model(x)`` against ``t``, backward, ``optimizer.update()``; a
    ``chainer.links.Classifier`` is passed to ``optimizer.update(model, x,
    t)`` instead (K-FAC's ``step_rule='adaptive'`` needs it). Returns
    ``(loss, seconds)``."""
    import chainer.functions as F
    import chainer.links as L
    t0 = time.perf_counter()
    if isinstance(model, L.Classifier):
        optimizer.update(model, x, t)
        return float(model.loss.array), time.perf_counter() - t0
    model.cleargrads()
    loss = F.softmax_cross_entropy(model(x), t)
    loss.backward()
    value = float(loss.array)
    del loss
    optimizer.update()
    return value, time.perf_counter() - t0


def timed_step(model, optimizer, x, t, timer, synchronize=None):
    """One classification step (as :func:`train_step`) with its stages in
    ``timer``: the forward and backward passes timed here, K-FAC's stages
    by its own timing hook, another optimizer's update as ``'update'``.
    ``synchronize`` waits for a GPU before each reading of the step's
    clock. Returns the seconds of the whole step."""
    import chainer.functions as F
    sync = synchronize or (lambda: None)
    kfac = hasattr(optimizer, 'stage_timer')
    if kfac:
        optimizer.stage_timer = timer
    try:
        sync()
        t0 = time.perf_counter()
        model.cleargrads()
        with timer.stage('forward'):
            loss = F.softmax_cross_entropy(model(x), t)
        with timer.stage('backward'):
            loss.backward()
        del loss
        if kfac:
            optimizer.update()
        else:
            with timer.stage('update'):
                optimizer.update()
        sync()
        return time.perf_counter() - t0
    finally:
        if kfac:
            optimizer.stage_timer = None


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


def fmt_spread(summary):
    """``'median (p25-p75)'`` of a :func:`summary`, in seconds."""
    return '{} ({}-{})'.format(fmt_s(summary['median']),
                               fmt_s(summary['p25']), fmt_s(summary['p75']))


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


#: A JSON list of numbers (or nulls), as json.dumps indents it.
_NUMBER = r'(?:-?[0-9][0-9.eE+-]*|null|true|false|NaN|-?Infinity)'
_FLAT_LIST = re.compile(r'\[\s*(?:{0}\s*,\s*)*{0}\s*\]'.format(_NUMBER))


def write_json(name, payload):
    """Writes ``payload`` as ``name`` under ``results/`` (or at ``name``,
    an absolute path), whole or not at all: into a temporary file, then
    renamed over the old one. Indented, but a list of numbers (a curve's
    point) on one line: curves of thousands of points stay readable
    without a line per number."""
    path = os.path.join(results_dir(), name)
    text = _FLAT_LIST.sub(
        lambda m: ' '.join(m.group(0).split()).replace('[ ', '[')
        .replace(' ]', ']'),
        json.dumps(payload, indent=1, sort_keys=False, default=_default))
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.',
                               suffix='.json')
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, 'w') as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def read_json(name):
    """The payload :func:`write_json` wrote as ``name``, or None."""
    path = os.path.join(results_dir(), name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# -- variants -----------------------------------------------------------------
#
# A script whose runs differ by their options keeps them all in one file,
# ``results/<script>.json``: ``{"script": ..., "variants": {name: payload}}``,
# the payload being what one run of the script writes. A script's
# ``--name NAME`` picks the variant a run writes (``default`` without it);
# its figures' files are ``<script>.png`` or ``<script>_<NAME>...png``.

#: The variant a script writes without ``--name``.
DEFAULT = 'default'


def stem(script, name=DEFAULT):
    """``script``, or ``script_name`` for a variant other than the
    default: the start of its figures' file names."""
    return script if name == DEFAULT else '{}_{}'.format(script, name)


def add_name_option(parser, script):
    """``--name NAME`` on an argparse ``parser``: the variant a run of
    ``script`` writes."""
    parser.add_argument('--name', default=DEFAULT,
                        help='the variant of results/{}.json to write '
                        '(default: {})'.format(script, DEFAULT))


def read_variants(script, out=None):
    """``{name: payload}`` of every variant in ``results/<script>.json``
    (or in the file ``out``, a run kept outside ``results/``), the default
    first ({} when the file is not there)."""
    return (read_json(os.path.abspath(out) if out else script + '.json')
            or {}).get('variants', {})


def read_variant(script, name=DEFAULT, out=None):
    """The payload of variant ``name`` of ``script`` (in the file ``out``
    if given), or None."""
    return read_variants(script, out).get(name)


def write_variant(script, name, payload, out=None):
    """Stores ``payload`` as variant ``name`` of ``results/<script>.json``
    (or of the file ``out``), keeping the other variants, and returns the
    file's path. Runs writing the same folder at the same time wait for
    each other (a lock on it), so neither loses the other's variant."""
    path = os.path.abspath(out) if out else os.path.join(
        results_dir(), script + '.json')
    import fcntl
    lock = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        variants = read_variants(script, out)
        variants[name] = payload
        return write_json(path, {
            'script': script,
            'variants': {n: variants[n] for n in sorted(
                variants, key=lambda n: (n != DEFAULT, n))}})
    finally:
        os.close(lock)


def _default(obj):
    if isinstance(obj, (numpy.integer,)):
        return int(obj)
    if isinstance(obj, (numpy.floating,)):
        return float(obj)
    if isinstance(obj, numpy.ndarray):
        return obj.tolist()
    return str(obj)
