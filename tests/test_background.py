"""Inverses off the critical path (``inverse_delay``, Ba et al. 2017 §3.1):
the inverse in effect at each step against dense inverses of the factors
recorded at every step."""
import copy

import numpy
import pytest

import chainerkfac
from chainerkfac import linalg
from tests.test_update import MLP, data, loss_fn


def dense_apply(A, G, damping, grad):
    """``G_d⁻¹ ∇ A_d⁻¹`` with factored Tikhonov damping, densely."""
    damping_A, damping_G = linalg.factored_damping((A, G), damping)
    return (numpy.linalg.inv(G + damping_G * numpy.eye(len(G))) @ grad
            @ numpy.linalg.inv(A + damping_A * numpy.eye(len(A))))


@pytest.mark.parametrize('delay', [1, 2, 3])
def test_an_inverse_takes_effect_delay_steps_after_its_factors(delay):
    numpy.random.seed(0)
    model = MLP()
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.05, cov_ema_decay=0.5, factor_interval=1, inverse_interval=2,
        inverse_delay=delay)
    optimizer.setup(model)
    block = optimizer.blocks[0]
    probe = numpy.random.RandomState(1).randn(5, 7)
    factors, used = {}, []
    for step in range(1, 13):
        optimizer.update(loss_fn(model), *data(seed=step))
        factors[step] = block.factor['A'].copy(), block.factor['G'].copy()
        applied = block.form.apply(probe)
        # The step whose factors built the inverse in effect now.
        matches = [t for t, (A, G) in factors.items() if numpy.allclose(
            applied, dense_apply(A, G, optimizer.damping, probe),
            rtol=1e-9, atol=1e-12)]
        assert len(matches) == 1, (step, matches)
        used.append((step, matches[0]))
    # The first inverse at once; every later one exactly `delay` steps
    # after the refresh that built it, and none sooner.
    assert used[0] == (1, 1)
    taken = [(step, t) for step, t in used[1:] if t != 1]
    assert taken and all(step - t >= delay for step, t in taken)
    changes = [(step, t) for (step, t), (_, before) in zip(used[1:], used)
               if t != before]
    assert changes and all(step - t == delay for step, t in changes)


def test_delayed_runs_repeat_and_copies_keep_the_pending_inverse():
    def run(steps, optimizer=None):
        if optimizer is None:
            numpy.random.seed(0)
            optimizer = chainerkfac.optimizers.KFAC(
                lr=0.05, inverse_interval=2, inverse_delay=2,
                factor_interval=1)
            optimizer.setup(MLP())
        for step in steps:
            optimizer.update(loss_fn(optimizer.target), *data(seed=step))
        return optimizer

    first = run(range(8))
    # Step 3's inverses take effect at step 5: on their way after step 4.
    again = run(range(4))
    assert all(block.pending is not None for block in again.blocks)
    copied = run(range(4, 8), copy.deepcopy(again))
    run(range(4, 8), again)
    for other in (again, copied):
        for (name, p), (_, q) in zip(first.target.namedparams(),
                                     other.target.namedparams()):
            numpy.testing.assert_array_equal(p.array, q.array,
                                             err_msg=name)


def test_inverse_delay_must_be_a_count():
    with pytest.raises(ValueError, match='KFAC inverse_delay must be an int '
                       '>= 0, got -1'):
        chainerkfac.optimizers.KFAC(inverse_delay=-1)
