"""Inverses off the critical path (``inverse_delay``, Ba et al. 2017 §3.1):
the inverse in effect at each step against dense inverses of the factors
recorded at every step."""
import copy
import threading

import numpy
import pytest

import chainerkfac
from chainerkfac import linalg
from tests.device import host, place, send
from tests.test_update import MLP, data, loss_fn


def dense_apply(A, G, damping, grad):
    """``G_d⁻¹ ∇ A_d⁻¹`` with factored Tikhonov damping, densely."""
    damping_A, damping_G = linalg.factored_damping((A, G), damping)
    return (numpy.linalg.inv(G + damping_G * numpy.eye(len(G))) @ grad
            @ numpy.linalg.inv(A + damping_A * numpy.eye(len(A))))


@pytest.mark.parametrize('delay', [1, 2, 3])
def test_an_inverse_takes_effect_delay_steps_after_its_factors(delay):
    numpy.random.seed(0)
    model = place(MLP())
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.05, cov_ema_decay=0.5, factor_interval=1, inverse_interval=2,
        inverse_delay=delay)
    optimizer.setup(model)
    block = optimizer.blocks[0]
    probe = numpy.random.RandomState(1).randn(5, 7)
    factors, used = {}, []
    for step in range(1, 13):
        optimizer.update(loss_fn(model), *send(*data(seed=step)))
        factors[step] = (host(block.factor['A']).copy(),
                         host(block.factor['G']).copy())
        applied = host(block.form.apply(send(probe)))
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
            optimizer.setup(place(MLP()))
        for step in steps:
            optimizer.update(loss_fn(optimizer.target),
                             *send(*data(seed=step)))
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
            numpy.testing.assert_array_equal(host(p.array), host(q.array),
                                             err_msg=name)


def test_inverse_delay_must_be_a_count():
    with pytest.raises(ValueError, match='KFAC inverse_delay must be an int '
                       '>= 0, got -1'):
        chainerkfac.optimizers.KFAC(inverse_delay=-1)


def dense_apply_exact(A, G, damping, grad):
    """``(A ⊗ G + λ I)⁻¹ ∇`` (the eigen inverse's exact damping), through
    the factors' eigendecompositions."""
    da, qa = numpy.linalg.eigh(A)
    dg, qg = numpy.linalg.eigh(G)
    return qg @ ((qg.T @ grad @ qa) / (numpy.outer(dg, da) + damping)) \
        @ qa.T


def sources_in_effect(monkeypatch, delay, inverse='cholesky', steps=12):
    """The step whose factors built the first block's inverse in effect
    at each step, ``inverse_interval=1``, and the threads every block's
    inverses were built on."""
    numpy.random.seed(0)
    model = place(MLP())
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.05, cov_ema_decay=0.5, factor_interval=1, inverse_interval=1,
        inverse_delay=delay, inverse=inverse)
    optimizer.setup(model)
    block = optimizer.blocks[0]
    threads = []
    build = block.family.build

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return build(*args)
    monkeypatch.setattr(block.family, 'build', recorded)
    probe = numpy.random.RandomState(1).randn(5, 7)
    factors, used = {}, []
    for step in range(1, steps + 1):
        optimizer.update(loss_fn(model), *send(*data(seed=step)))
        factors[step] = (host(block.factor['A']).copy(),
                         host(block.factor['G']).copy())
        applied = host(block.form.apply(send(probe)))
        dense = dense_apply if inverse == 'cholesky' else dense_apply_exact
        used.append(next(t for t, (A, G) in factors.items()
                         if numpy.allclose(
                             applied, dense(A, G, optimizer.damping, probe),
                             rtol=1e-9, atol=1e-12)))
    return used, threads, len(optimizer.blocks)


@pytest.mark.parametrize('inverse', ['cholesky', 'eigen'])
@pytest.mark.parametrize('delay,expected', [
    # One inverse on its way at a time: step t puts in place the one of
    # step t - d and starts the next, a refresh every d steps.
    (1, [1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]),
    (2, [1, 1, 1, 2, 2, 4, 4, 6, 6, 8, 8, 10]),
    (3, [1, 1, 1, 1, 2, 2, 2, 5, 5, 5, 8, 8])])
def test_every_step_refreshes_as_the_one_in_flight_allows(
        monkeypatch, delay, expected, inverse):
    used, threads, blocks = sources_in_effect(monkeypatch, delay, inverse)
    assert used == expected
    # Each block's first inverse at once, every later one on the worker.
    worker = [name.startswith('chainerkfac-inverse') for name in threads]
    assert not any(worker[:blocks]) and len(worker) > blocks \
        and all(worker[blocks:]), threads
