"""A model whose Kronecker blocks distributed K-FAC splits over ranks.

At an inverse interval of 3, preconditioning these layers costs more than
inverting their factors, so with ``max_load_imbalance=1.0`` the assignment
splits them on 3 or 4 ranks: ``fc1`` (A larger than G) by columns of
``G⁻¹ ∇W̄ A⁻¹``, ``fc2`` (G larger than A) by rows.
"""
import chainer
import chainer.functions as F
import chainer.links as L


class SplitMLP(chainer.Chain):
    def __init__(self, n_in, n_out=3, hidden=(50, 80)):
        super().__init__()
        h1, h2 = hidden
        with self.init_scope():
            self.fc1 = L.Linear(n_in, h1)
            self.fc2 = L.Linear(h1, h2)
            self.fc3 = L.Linear(h2, n_out)

    def forward(self, x):
        h = F.tanh(self.fc1(x.reshape(len(x), -1)))
        return self.fc3(F.tanh(self.fc2(h)))
