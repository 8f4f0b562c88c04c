"""What the rank scripts of tests/mpi_scripts share: a tiny MLP (and one
with BatchNorm) and the check that a call raises the expected error on
this rank."""
import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer

import chainer
import chainer.functions as F
import chainer.links as L


class MLP(chainer.Chain):
    """3 -> 4 -> 2 by default; ``extra`` adds a link the forward pass does
    not use (a model that differs only in its parameters)."""

    def __init__(self, n_in=3, n_hidden=4, extra=False):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, 2)
            if extra:
                self.l3 = L.Linear(2, 2)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


class BatchNormMLP(chainer.Chain):
    """Linear, BatchNorm, Linear (3 -> 5 -> 2): parameters and running
    statistics."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 5)
            self.bn = L.BatchNormalization(5)
            self.l2 = L.Linear(5, 2)

    def forward(self, x):
        return self.l2(F.relu(self.bn(self.l1(x))))


def expect_error(comm, error, call, *fragments):
    """Runs ``call()``, which must raise ``error`` with every fragment in
    its message; prints ``rank R: MESSAGE``."""
    try:
        call()
    except error as e:
        message = str(e)
    else:
        raise AssertionError('rank {}: no error'.format(comm.rank))
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    print('rank {}: {}'.format(comm.rank, message), flush=True)
