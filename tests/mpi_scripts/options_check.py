"""Rank script: KFAC options compared across ranks under mpiexec -n 2.

The same options pass; rank 1 with another value of one option (or
another K-FAC link set, or another max_load_imbalance) must raise the same
ValueError on every rank at setup, naming the option and the ranks, instead
of crashing later in MPI or training silently; so must a hyperparameter
changed on one rank only after setup, at the next step. Prints
"rank R: ok".
"""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer
import chainer.functions as F
import numpy

from chainerkfac.distributed import create_communicator
from tests import rank_checks
from tests.rank_checks import MLP


def build(comm, options, max_load_imbalance=1.1):
    optimizer = chainerkfac.create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(**options), comm,
        max_load_imbalance=max_load_imbalance)
    optimizer.setup(MLP())
    return optimizer


def expect_mismatch(comm, options, *fragments, **kwargs):
    rank_checks.expect_error(comm, ValueError,
                             lambda: build(comm, options, **kwargs),
                             *fragments)


comm = create_communicator('naive')
assert comm.size == 2
odd = comm.rank == 1
build(comm, {'factor_interval': 10, 'lr': 0.1})
expect_mismatch(comm, {'factor_interval': 5 if odd else 10},
                "option 'factor_interval_A'", '10 on rank 0', '5 on rank 1')
expect_mismatch(comm, {'bn_fisher': 'full' if odd else 'diagonal'},
                "option 'bn_fisher'", "'diagonal' on rank 0",
                "'full' on rank 1")
expect_mismatch(comm, {'lr': 0.2 if odd else 0.1}, "option 'lr'",
                '0.1 on rank 0', '0.2 on rank 1')
expect_mismatch(comm, {'inverse_interval': 3 if odd else 1},
                "option 'inverse_interval'")
expect_mismatch(comm, {'precondition': not odd}, "option 'precondition'")
expect_mismatch(comm, {}, "option 'max_load_imbalance'",
                max_load_imbalance=None if odd else 1.1)

# An option changed on one rank only after setup (as an extension that only
# rank 0 runs would): the next step stops both ranks, naming it.
optimizer = build(comm, {'lr': 0.1})
model = optimizer.target
x = numpy.arange(12, dtype=numpy.float32).reshape(4, 3)
t = numpy.array([0, 1, 0, 1], dtype=numpy.int32)


def lossfun(x, t):
    return F.softmax_cross_entropy(model(x), t)


optimizer.update(lossfun, x, t)
if comm.rank == 0:
    optimizer.lr = 0.05
rank_checks.expect_error(
    comm, ValueError, lambda: optimizer.update(lossfun, x, t),
    "option 'lr'", '0.05 on rank 0', '0.1 on rank 1', 'at iteration 2')

# An optimizer hook added on one rank only, after setup: the next step
# stops both ranks, naming the hooks and their settings.
optimizer = build(comm, {'lr': 0.1})
model = optimizer.target
optimizer.update(lossfun, x, t)
if comm.rank == 0:
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
rank_checks.expect_error(
    comm, ValueError, lambda: optimizer.update(lossfun, x, t),
    "option 'optimizer hooks'", 'WeightDecay (pre): rate=0.0001 on rank 0',
    'none on rank 1')
print('rank {}: ok'.format(comm.rank), flush=True)
