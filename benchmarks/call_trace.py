"""How far one update travels through the library: files and hand-offs.

    PYTHONPATH=. .venv/bin/python benchmarks/call_trace.py

``models.SmallCNN`` at 4 channels (convolution → BatchNorm three times,
then a Linear), one process, the defaults. After a few steps (so that the
adaptive intervals have grown), ``sys.setprofile`` follows one stale
update (no factor due) and one refresh update (every factor due:
``factor_interval=1``): every Python call whose code lives in
``chainerkfac/``. Per update it counts the library files entered, the
hand-offs (a call from one library file into another) and the re-entries
into ``optimizers/kfac.py`` (from another library file). Results go to
``results/call_trace.json``.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer.links as L
import numpy

import harness
import models

LIBRARY = os.path.dirname(os.path.abspath(chainerkfac.__file__))
OPTIMIZER = os.path.join(LIBRARY, 'optimizers', 'kfac.py')


def trace(call):
    """``(files, hand_offs, kfac_reentries)`` of the library calls that
    ``call()`` makes."""
    files, hand_offs, reentries = set(), 0, 0
    stack = []

    def profile(frame, event, arg):
        nonlocal hand_offs, reentries
        if event == 'call':
            path = frame.f_code.co_filename
            caller = stack[-1] if stack else None
            if path.startswith(LIBRARY):
                files.add(os.path.relpath(path, LIBRARY))
                if caller is not None and caller != path:
                    hand_offs += 1
                    reentries += path == OPTIMIZER
                stack.append(path)
            else:
                stack.append(caller)
        elif event == 'return' and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return sorted(files), hand_offs, reentries


def measure(factor_interval, warmup):
    numpy.random.seed(0)
    # Three convolution → BatchNorm layers and a Linear, 4 channels wide.
    model = L.Classifier(models.SmallCNN(3, 1, (4, 4, 4)))
    optimizer = chainerkfac.optimizers.KFAC(lr=0.1,
                                            factor_interval=factor_interval)
    optimizer.setup(model)
    rng = numpy.random.RandomState(0)
    x = rng.randn(16, 1, 6, 6).astype(numpy.float32)
    t = rng.randint(0, 3, 16).astype(numpy.int32)
    for _ in range(warmup):
        optimizer.update(model, x, t)
    files, hand_offs, reentries = trace(
        lambda: optimizer.update(model, x, t))
    return {'files': len(files), 'hand_offs': hand_offs,
            'kfac_reentries': reentries, 'file_names': files}


def main():
    # After 9 steps the adaptive intervals put the next refresh at step 16.
    results = {'stale': measure(None, 9), 'refresh': measure(1, 3)}
    for kind, r in results.items():
        print('{}: {} files, {} hand-offs, {} re-entries into kfac.py'.format(
            kind, r['files'], r['hand_offs'], r['kfac_reentries']))
    harness.write_json('call_trace.json', {
        'script': 'call_trace', 'environment': harness.environment(),
        'results': results})


if __name__ == '__main__':
    main()
