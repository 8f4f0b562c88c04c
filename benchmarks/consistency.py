"""What the cross-rank consistency checks cost (issue #24).

    PYTHONPATH=. .venv/bin/python benchmarks/consistency.py

Every step under MPI computes a digest of the optimizer's options
(:func:`chainerkfac.distributed.consistency.options_digest`) and sends it
as one more element per rank in the all-gather the step already makes;
set-up compares the options and the parameters (one object all-gather
each). Times, for ResNet-50 (161 K-FAC blocks) on one CPU thread: the
digest (median of 2,000 calls), and the two set-up comparisons' local work
(building what is compared). Writes ``results/consistency.json``.
"""
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
from chainerkfac.distributed import consistency

import harness
import models


def main():
    harness.limit_threads(1)
    model = models.ResNet50(1000)
    optimizer = chainerkfac.optimizers.KFAC()
    optimizer.setup(model)
    digest = [t / 100 for t in timeit.repeat(
        lambda: consistency.options_digest(optimizer), number=100,
        repeat=20)]
    options = [t / 10 for t in timeit.repeat(
        lambda: list(optimizer.option_values().items()), number=10,
        repeat=5)]
    structure = [t for t in timeit.repeat(
        lambda: [(n, tuple(p.shape)) for n, p in sorted(model.namedparams())],
        number=1, repeat=5)]
    result = {'environment': harness.environment(), 'model': 'resnet50',
              'blocks': len(optimizer.blocks),
              'digest_per_step': harness.summary(digest),
              'setup_options': harness.summary(options),
              'setup_structure': harness.summary(structure)}
    rows = [[name, '{:.1f} µs'.format(result[key]['median'] * 1e6)]
            for name, key in (
        ('options digest, every step', 'digest_per_step'),
        ('options compared at setup (local part)', 'setup_options'),
        ('parameters compared at setup (local part)', 'setup_structure'))]
    print(harness.table(rows, ['check', 'median time']))
    print('written', harness.write_json('consistency.json', result))


if __name__ == '__main__':
    main()
