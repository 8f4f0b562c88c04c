"""One K-FAC step against dense Kronecker-product computations."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac.distributed import split
from tests import brute_force
from tests import snapshot_helpers
from tests.device import host, place, send


class MLP(chainer.Chain):
    def __init__(self, dtype=numpy.float64, nobias=False):
        super().__init__()
        with chainer.using_config('dtype', dtype), self.init_scope():
            self.l1 = L.Linear(6, 5, nobias=nobias)
            self.l2 = L.Linear(5, 3, nobias=nobias)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def loss_fn(model):
    return lambda x, t: F.softmax_cross_entropy(model(x), t)


def data(n=16, seed=0, dtype=numpy.float64):
    rng = numpy.random.RandomState(seed)
    return rng.randn(n, 6).astype(dtype), rng.randint(0, 3, n)


def reference_copy(model, x, t):
    """A copy of ``model`` holding the raw gradients of batch (x, t)."""
    ref = MLP(model.l1.W.dtype, nobias=model.l1.b is None)
    ref.copyparams(model)
    ref.cleargrads()
    loss_fn(ref)(x, t).backward()
    return ref


def full_gradient(link):
    if link.b is None:
        return host(link.W.grad)
    return numpy.concatenate([host(link.W.grad), host(link.b.grad)[:, None]],
                             axis=1)


def dense_step_scales(rule, solved, kl_clip, lr, batch):
    """The step rule's ``ρ_b`` and the bound's ``ν`` from dense arrays:
    ``solved[name] = (g, V)``."""
    rho = {name: 1.0 for name in solved}
    if rule == 'kl_graft':
        # One scale: the natural step with the KL change of the step each
        # block would take at SGD's length, ‖g_b‖ / ‖V_b‖ times V_b.
        grafted = sum(numpy.vdot(g, g) / numpy.vdot(V, V) * numpy.vdot(V, g)
                      for g, V in solved.values())
        natural = sum(numpy.vdot(V, g) for g, V in solved.values())
        # ... grown like the batch: B / 64.
        rho = {name: numpy.sqrt(batch / 64 * grafted / natural)
               for name in solved}
    kl = lr ** 2 * sum(rho[name] ** 2 * numpy.vdot(V, g)
                       for name, (g, V) in solved.items())
    nu = 1.0 if kl_clip is None else \
        min(1.0, numpy.sqrt(kl_clip * batch / 64 / kl))
    return rho, kl, nu


# An inverse used once is kept as Cholesky factors (triangular solves); one
# expected to serve many steps is formed explicitly.
@pytest.mark.parametrize('inverse,inverse_interval,state', [
    ('cholesky', 1, 'A_chol'),
    ('cholesky', 100, 'A_inv'),
    ('eigen', 1, 'A_eigvecs')])
@pytest.mark.parametrize('dtype,rtol', [(numpy.float64, 1e-5),
                                        (numpy.float32, 2e-3)])
@pytest.mark.parametrize('rule,kl_clip', [
    ('natural', 1e-4), ('natural', None), ('kl_graft', None),
    ('kl_graft', 1e-4)])
@pytest.mark.parametrize('nobias', [False, True])
def test_one_step_equals_dense_kronecker_solve(inverse, inverse_interval,
                                               state, dtype, rtol, rule,
                                               kl_clip, nobias):
    # V_b = F̂_b⁻¹ g_b by a dense solve; the step rule's ρ_b and the
    # bound's ν = min(1, sqrt(κ / (lr² Σ_b ρ_b² ⟨V_b, g_b⟩))),
    # κ = kl_clip · 16 / 64 for this batch of 16, by their formulas; then
    # w <- w - lr ρ_b ν V_b (momentum 0). Without a bias (a convolution
    # before BatchNorm) the block's gradient is a view of W.grad, which V
    # overwrites: its sums must be ⟨V, g⟩ and ⟨g, g⟩, not ⟨V, V⟩.
    damping, lr = 1e-2, 0.5
    numpy.random.seed(0)
    model = place(MLP(dtype, nobias))
    opt = chainerkfac.optimizers.KFAC(lr=lr, momentum=0.0, damping=damping,
                                      inverse=inverse,
                                      inverse_interval=inverse_interval,
                                      step_rule=rule, kl_clip=kl_clip)
    opt.setup(model)
    x, t = data(dtype=dtype)
    before = {n: host(p.array).astype(numpy.float64)
              for n, p in model.namedparams()}
    # Raw gradients of the same batch, computed independently on the CPU.
    ref = reference_copy(model, x, t)
    observation = {}
    with chainer.Reporter().scope(observation):
        opt.update(loss_fn(model), *send(x, t))
    solved = {}
    for block in opt.blocks:
        assert state in block.form.arrays
        A = host(block.factor['A']).astype(numpy.float64)
        G = host(block.factor['G']).astype(numpy.float64)
        grad = full_gradient(getattr(ref, block.name)).astype(numpy.float64)
        if inverse == 'cholesky':
            A_d, G_d = brute_force.factored_damping(A, G, damping)
            dense = numpy.kron(A_d, G_d)
        else:
            dense = numpy.kron(A, G) + damping * numpy.eye(len(A) * len(G))
        solved[block.name] = grad, brute_force.unvec(
            numpy.linalg.solve(dense, brute_force.vec(grad)), grad.shape)
    rho, kl, nu = dense_step_scales(rule, solved, kl_clip, lr, len(x))
    if kl_clip is not None:
        assert nu < 0.5  # the bound acts here
    numpy.testing.assert_allclose(observation['kfac/kl'], kl,
                                  rtol=rtol)
    numpy.testing.assert_allclose(observation['kfac/update_scale'], nu,
                                  rtol=rtol)
    for name, (_, V) in solved.items():
        step = lr * rho[name] * nu * V
        link = getattr(model, name)
        W_new = before['/' + name + '/W'] - step[:, :link.W.shape[1]]
        numpy.testing.assert_allclose(host(link.W.array), W_new, rtol=rtol,
                                      atol=rtol * abs(W_new).max())
        if not nobias:
            b_new = before['/' + name + '/b'] - step[:, -1]
            numpy.testing.assert_allclose(host(link.b.array), b_new,
                                          rtol=rtol,
                                          atol=rtol * abs(b_new).max())


@pytest.mark.parametrize('kl_clip,acc_iters,manual,batch', [
    (1e-4, 1, 0, 16), (1e-4, 2, 0, 16), (1e-4, 1, 1, 16), (1e-4, 1, 4, 16),
    (1e-4, 1, 0, 48), (1e-4, 1, 0, 256), (0.1, 1, 0, 16)])
def test_bound_grows_like_the_batch(kl_clip, acc_iters, manual, batch):
    # κ = kl_clip · B / 64, B the whole batch however it was fed
    # (micro-batches of acc_iters, or the user's own forward and backward
    # passes, ``manual`` of them).
    model = place(MLP())
    # A learning rate at which the bound acts at every one of these.
    opt = chainerkfac.optimizers.KFAC(
        lr=0.5 if kl_clip < 0.01 and batch < 64 else 20.0, kl_clip=kl_clip,
        acc_iters=acc_iters)
    opt.setup(model)
    x, t = send(*data(n=batch))
    observation = {}
    with chainer.Reporter().scope(observation):
        if manual:
            model.cleargrads()
            for xs, ts in zip(numpy.split(x, manual), numpy.split(t, manual)):
                loss_fn(model)(xs, ts).backward()
            opt.update()
        else:
            opt.update(loss_fn(model), x, t)
    bound = kl_clip * batch / 64
    expected = min(1.0, numpy.sqrt(bound / observation['kfac/kl']))
    assert expected < 1  # the bound acts at every one of these
    numpy.testing.assert_allclose(observation['kfac/update_scale'], expected,
                                  rtol=1e-12)


def test_batch_of_one_linear_block_is_exact_empirical_fisher():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    x, t = data(n=1)
    ref = reference_copy(model, x, t)
    opt.update(loss_fn(model), *send(x, t))
    for block in opt.blocks:
        g = brute_force.vec(full_gradient(getattr(ref, block.name)))
        numpy.testing.assert_allclose(
            numpy.kron(host(block.factor['A']), host(block.factor['G'])),
            numpy.outer(g, g), rtol=1e-10, atol=1e-14)


def run(optimizer, model, steps, hooks=()):
    optimizer.setup(place(model))
    for hook in hooks:
        optimizer.add_hook(hook)
    for i in range(steps):
        x, t = data(seed=i, dtype=model.l1.W.dtype)
        optimizer.update(loss_fn(model), *send(x, t))
    return {n: host(p.array).copy() for n, p in model.namedparams()}


@pytest.mark.parametrize('hooks', [
    (), (chainer.optimizer_hooks.WeightDecay(1e-3),
         chainer.optimizer_hooks.GradientClipping(0.5),
         chainer.optimizer_hooks.Lasso(1e-4))])
def test_without_preconditioning_is_momentum_sgd_bit_for_bit(hooks):
    init = MLP(numpy.float32)
    results = []
    for opt in (chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9),
                chainerkfac.optimizers.KFAC(lr=0.1, momentum=0.9,
                                            precondition=False)):
        model = init.copy(mode='copy')
        results.append(run(opt, model, 5, hooks))
    for name in results[0]:
        assert numpy.array_equal(results[0][name], results[1][name]), name


def test_optimizer_hooks_act_before_preconditioning():
    # Chainer's WeightDecay hook adds rate * w (biases too) to the gradient
    # that K-FAC then preconditions with the unchanged damping.
    rate, damping, lr = 0.05, 1e-2, 0.5
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC(lr=lr, momentum=0.0, damping=damping,
                                      step_rule='natural', kl_clip=None)
    opt.setup(model)
    opt.add_hook(chainer.optimizer_hooks.WeightDecay(rate))
    x, t = data()
    ref = reference_copy(model, x, t)
    opt.update(loss_fn(model), *send(x, t))
    for block in opt.blocks:
        link = getattr(ref, block.name)
        grad = full_gradient(link) + rate * numpy.concatenate(
            [link.W.array, link.b.array[:, None]], axis=1)
        A_d, G_d = brute_force.factored_damping(
            host(block.factor['A']), host(block.factor['G']), damping)
        V = brute_force.unvec(numpy.linalg.solve(numpy.kron(A_d, G_d),
                                                 brute_force.vec(grad)),
                              grad.shape)
        numpy.testing.assert_allclose(host(getattr(model, block.name).b.array),
                                      link.b.array - lr * V[:, -1],
                                      rtol=1e-8)


def test_momentum_update_rule():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC(lr=0.3, momentum=0.5, damping=1e-2,
                                      cov_ema_decay=0.0)
    opt.setup(model)
    w0 = host(model.l1.W.array).copy()
    x, t = send(*data())
    opt.update(loss_fn(model), x, t)
    w1 = host(model.l1.W.array).copy()
    v1 = w1 - w0
    opt.update(loss_fn(model), x, t)
    # v2 = 0.5 v1 - lr V2, with V2 the preconditioned gradient of step 2.
    V2 = host(model.l1.W.grad)
    # (w1 + v2) - w1 rounds at the scale of w1, not of v2.
    numpy.testing.assert_allclose(host(model.l1.W.array) - w1,
                                  0.5 * v1 - 0.3 * V2, rtol=1e-12,
                                  atol=1e-14 * numpy.abs(w1).max())


def test_paper_weight_decay_adds_to_gradient_and_damping():
    damping, decay, lr = 1e-2, 1e-1, 0.5
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC(lr=lr, momentum=0.0, damping=damping,
                                      weight_decay=decay, step_rule='natural',
                                      kl_clip=None)
    opt.setup(model)
    x, t = data()
    ref = reference_copy(model, x, t)
    opt.update(loss_fn(model), *send(x, t))
    block = opt.blocks[0]
    link = getattr(ref, block.name)
    grad = full_gradient(link)
    grad[:, :-1] += decay * link.W.array
    A_d, G_d = brute_force.factored_damping(
        host(block.factor['A']), host(block.factor['G']), damping + decay)
    V = brute_force.unvec(numpy.linalg.solve(numpy.kron(A_d, G_d),
                                             brute_force.vec(grad)),
                          grad.shape)
    numpy.testing.assert_allclose(host(getattr(model, block.name).W.array),
                                  link.W.array - lr * V[:, :-1], rtol=1e-8)


def test_accumulation_equals_one_big_batch():
    init = MLP()
    results = []
    for acc_iters in (1, 4):
        model = place(init.copy(mode='copy'))
        opt = chainerkfac.optimizers.KFAC(lr=0.1, acc_iters=acc_iters)
        opt.setup(model)
        for i in range(3):
            x, t = data(n=16, seed=i)
            opt.update(loss_fn(model), *send(x, t))
        results.append(model)
    for (n, p), (_, q) in zip(results[0].namedparams(),
                              results[1].namedparams()):
        numpy.testing.assert_allclose(host(p.array), host(q.array),
                                      rtol=1e-10)


def test_accumulation_rejects_uneven_batches():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC(acc_iters=3)
    opt.setup(model)
    with pytest.raises(ValueError, match='acc_iters=3'):
        opt.update(loss_fn(model), *send(*data(n=16)))


def test_singular_factor_gives_finite_update():
    # Zero activations without bias: A = 0, π falls back to 1.
    link = place(L.Linear(4, 3, nobias=True))
    opt = chainerkfac.optimizers.KFAC(lr=0.1)
    opt.setup(link)
    x = send(numpy.zeros((5, 4), dtype=numpy.float32))
    opt.update(lambda x: F.sum(link(x) ** 2) + F.sum(link.W), x)
    assert numpy.isfinite(host(link.W.array)).all()
    numpy.testing.assert_allclose(host(opt.blocks[0].factor['A']), 0)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_damped_inverse_and_cholesky_never_nan(dtype):
    linalg = chainerkfac.linalg
    rng = numpy.random.RandomState(0)
    v = rng.randn(6, 1)
    indefinite = send((v @ v.T - 1e-3 * numpy.eye(6)).astype(dtype))
    inv = host(linalg.damped_inverse(indefinite, 0.0))
    L = host(linalg.damped_cholesky(indefinite, 0.0))
    assert numpy.isfinite(inv).all() and numpy.isfinite(L).all()
    numpy.testing.assert_allclose(inv, inv.T, rtol=1e-6)
    numpy.testing.assert_array_equal(L, numpy.tril(L))
    # Both describe the same floored matrix.
    numpy.testing.assert_allclose(inv @ (L @ L.T), numpy.eye(6), atol=1e-3)
    zero = send(numpy.zeros((3, 3), dtype=dtype))
    numpy.testing.assert_allclose(host(linalg.damped_inverse(zero, 1e-4)),
                                  numpy.eye(3) * 1e4, rtol=1e-5)
    numpy.testing.assert_allclose(host(linalg.damped_cholesky(zero, 1e-4)),
                                  numpy.eye(3) * 1e-2, rtol=1e-5)


def test_cholesky_precondition_equals_inverse_products():
    linalg = chainerkfac.linalg
    rng = numpy.random.RandomState(1)
    A, G = send(*(X @ X.T for X in (rng.randn(7, 9), rng.randn(4, 5))))
    grad = send(rng.randn(4, 7))
    A_inv, G_inv = linalg.damped_inverse(A, 0.1), linalg.damped_inverse(G, 0.2)
    expected = linalg.kronecker_precondition(grad, A_inv, G_inv)
    L_A, L_G = linalg.damped_cholesky(A, 0.1), linalg.damped_cholesky(G, 0.2)
    got = linalg.cholesky_precondition(grad, L_A, L_G)
    expected = host(expected)
    numpy.testing.assert_allclose(host(got), expected, rtol=1e-10)
    # One factor explicit and the other Cholesky, for split blocks: parts
    # of the explicit inverse give parts of V.
    rows = [linalg.mixed_precondition(grad, G_inv=G_inv[r], A_chol=L_A)
            for r in (slice(0, 1), slice(1, 4))]
    columns = [linalg.mixed_precondition(grad, A_inv=A_inv[:, c], G_chol=L_G)
               for c in (slice(0, 5), slice(5, 7))]
    numpy.testing.assert_allclose(
        numpy.concatenate([host(r) for r in rows]), expected, rtol=1e-10)
    numpy.testing.assert_allclose(
        numpy.concatenate([host(c) for c in columns], axis=1), expected,
        rtol=1e-10)


@pytest.mark.parametrize('nobias, shared', [(False, 'A'), (True, 'G')])
def test_cholesky_form_leaves_the_larger_factor_to_its_ranks(
        nobias, shared, monkeypatch):
    # A split block in the 'cholesky' form: a refresh inverts the smaller
    # factor and leaves the larger one damped, for the block's ranks to
    # factor together (from SHARED_FACTORIZATION_MIN_DIM on, lowered here);
    # alone, the owner factors it as an unsplit block.
    linalg = chainerkfac.linalg
    monkeypatch.setattr(chainerkfac.curvature.cost,
                        'SHARED_FACTORIZATION_MIN_DIM', 6)
    d_in, d_out = (6, 3) if shared == 'A' else (3, 6)
    rng = numpy.random.RandomState(2)
    link = place(L.Linear(d_in, d_out, nobias=nobias,
                          initialW=rng.randn(d_out, d_in)))
    # The step's damping (1e-3) differs from the refreshes' below.
    opt = chainerkfac.optimizers.KFAC(lr=0.1, damping=1e-3)
    opt.setup(link)
    x = send(rng.randn(8, d_in).astype(numpy.float32))
    opt.update(lambda x: F.sum(link(x) ** 2), x)
    block = opt.blocks[0]

    def fix_split():
        # One part, as the stages split a block over the ranks of one.
        whole = split.Split.length(block.dims(), False)
        layout = split.Split(block.dims(), False, [(0, whole)], (0,))
        block.fix_form(layout.build)
        return layout

    layout = fix_split()
    block.update_inverse(opt.t + 1, 1e-2)
    f = layout.cholesky
    other = 'G' if f == 'A' else 'A'
    damped = block.form.arrays[f + '_chol']
    assert f == shared and layout.shared
    assert sorted(block.form.arrays) == sorted([f + '_chol', other + '_inv'])
    damping = dict(zip('AG', linalg.factored_damping(
        (block.factor['A'], block.factor['G']), 1e-2)))
    numpy.testing.assert_allclose(
        host(damped), host(linalg.add_diagonal(block.factor[f], damping[f])))
    chol = split.cholesky_alone(block, layout)
    numpy.testing.assert_allclose(
        host(chol), host(linalg.damped_cholesky(block.factor[f], damping[f])))
    block.form = block.form.with_cholesky(chol)
    grad = block.gradient()
    expected = linalg.kronecker_precondition(
        grad, linalg.damped_inverse(block.factor['A'], damping['A']),
        linalg.damped_inverse(block.factor['G'], damping['G']))
    numpy.testing.assert_allclose(
        host(layout.part_form(block.form, 0).apply(grad)), host(expected),
        rtol=1e-4)
    # A smaller factor than that the owner factors at once, alone.
    monkeypatch.setattr(chainerkfac.curvature.cost,
                        'SHARED_FACTORIZATION_MIN_DIM', len(damped) + 1)
    layout = fix_split()
    assert not layout.shared
    block.update_inverse(opt.t + 2, 2e-2)
    numpy.testing.assert_allclose(
        host(block.form.arrays[f + '_chol']),
        host(linalg.damped_cholesky(block.factor[f], dict(zip(
            'AG', linalg.factored_damping((block.factor['A'],
                                           block.factor['G']), 2e-2)))[f])))


def test_nan_gradient_raises_by_default():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    x, t = data()
    x[0, 0] = numpy.nan
    with pytest.raises(chainerkfac.NonFiniteError, match='l1'):
        opt.update(loss_fn(model), *send(x, t))


@pytest.mark.parametrize('bad', [numpy.nan, numpy.inf, -numpy.inf])
def test_finite_checks_find_the_bad_array_among_many(bad):
    rng = numpy.random.RandomState(2)
    arrays = [rng.randn(*shape).astype(dtype) for shape, dtype in zip(
        [(3, 4), (5,), (2, 3, 3), (1,), (7, 2)] * 3,
        [numpy.float32, numpy.float64, numpy.float16] * 5)]
    check = chainerkfac.optimizers.nonfinite.all_finite
    assert check(send(*arrays)) == [True] * len(arrays)
    arrays[7][1, 2, 0] = bad
    expected = [i != 7 for i in range(len(arrays))]
    assert check(send(*arrays)) == expected


def test_nan_gradient_skipped_when_configured():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC(nonfinite='skip')
    opt.setup(model)
    before = {n: host(p.array).copy() for n, p in model.namedparams()}
    x, t = data()
    x[0, 0] = numpy.nan
    reporter = chainer.Reporter()
    observation = {}
    with reporter.scope(observation):
        opt.update(loss_fn(model), *send(x, t))
    assert observation['kfac/skipped_steps'] == 1
    for n, p in model.namedparams():
        numpy.testing.assert_array_equal(host(p.array), before[n])
    assert all(b.factor['A'] is None for b in opt.blocks)
    opt.update(loss_fn(model), *send(*data()))
    assert all(b.ready() for b in opt.blocks)


@pytest.mark.parametrize('kwargs,message', [
    ({'lr': -1}, 'lr'), ({'momentum': 1.0}, 'momentum'),
    ({'damping': 0}, 'damping'), ({'cov_ema_decay': 1.0}, 'cov_ema_decay'),
    ({'inverse': 'svd'}, 'inverse'), ({'bn_fisher': 'block'}, 'bn_fisher'),
    ({'factor_interval': 0}, 'factor_interval'),
    ({'factor_interval': {'A': 1}}, 'factor_interval'),
    ({'inverse_interval': 'often'}, 'inverse_interval'),
    ({'acc_iters': 0}, 'acc_iters'), ({'nonfinite': 'ignore'}, 'nonfinite'),
    ({'spatial_subsample': 1.5}, 'spatial_subsample'),
    ({'batch_subsample': 0}, 'batch_subsample'),
    ({'conv_factors': 'mean'}, 'conv_factors'),
    ({'conv_factors': 'reduced', 'spatial_subsample': 2},
     "spatial_subsample must be 1 with conv_factors='reduced'"),
    ({'max_skipped_steps': 0}, 'max_skipped_steps'),
    ({'lr': '0.1'}, 'lr must be a real number >= 0'),
    ({'lr': None}, 'lr must be'), ({'damping': True}, 'damping must be'),
    ({'kl_clip': '1e-4'}, 'kl_clip must be'),
])
def test_bad_hyperparameters_name_the_problem(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        chainerkfac.optimizers.KFAC(**kwargs)


@pytest.mark.parametrize('name,value', [
    ('damping', -1), ('lr', '0.1'), ('momentum', 1.5), ('kl_clip', 0)])
def test_hyperparameters_set_at_run_time_are_checked_at_the_next_update(
        name, value):
    # As an extension (ExponentialShift, LinearShift) or a user would.
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    opt.update(loss_fn(model), *send(*data()))
    setattr(opt, name, value)
    before = {n: host(p.array).copy() for n, p in model.namedparams()}
    message = r'{} must be .* \(at iteration 2\)'.format(name)
    with pytest.raises(ValueError, match=message):
        opt.update(loss_fn(model), *send(*data()))
    for n, p in model.namedparams():
        numpy.testing.assert_array_equal(host(p.array), before[n])


def test_update_before_setup_names_setup():
    opt = chainerkfac.optimizers.KFAC()
    with pytest.raises(RuntimeError, match='before setup'):
        opt.update()


def test_reports_and_describe():
    model = MLP()
    model.add_link('emb', L.EmbedID(3, 2))
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(place(model))
    text = opt.describe()
    assert 'l1' in text and 'K-FAC' in text and '/emb/W' in text
    assert 'momentum SGD: no Fisher block for EmbedID' in text
    reporter = chainer.Reporter()
    observation = {}
    with reporter.scope(observation):
        opt.update(loss_fn(model), *send(*data()))
    assert observation['kfac/factor_refreshes'] == 4
    assert observation['kfac/inverse_refreshes'] == 2
    observation = {}
    with reporter.scope(observation):
        opt.update(loss_fn(model), *send(*data()))
    assert observation['kfac/change_rate'] > 0


def test_manual_loop_equals_update_with_lossfun():
    init = MLP()
    a, b = place(init.copy(mode='copy')), place(init.copy(mode='copy'))
    opt_a = chainerkfac.optimizers.KFAC(lr=0.1)
    opt_a.setup(a)
    opt_b = chainerkfac.optimizers.KFAC(lr=0.1)
    opt_b.setup(b)
    for i in range(3):
        x, t = send(*data(seed=i))
        opt_a.update(loss_fn(a), x, t)
        b.cleargrads()
        loss_fn(b)(x, t).backward()
        opt_b.update()
    for (n, p), (_, q) in zip(a.namedparams(), b.namedparams()):
        numpy.testing.assert_array_equal(host(p.array), host(q.array))


@pytest.mark.parametrize('nonfinite', ['skip', 'raise'])
def test_skipped_or_raising_step_keeps_batch_norm_running_statistics(
        nonfinite):
    model = place(chainer.Sequential(
        L.Linear(6, 4), L.BatchNormalization(4), L.Linear(4, 3)))
    opt = chainerkfac.optimizers.KFAC(nonfinite=nonfinite)
    opt.setup(model)
    x, t = data(dtype=numpy.float32)
    lossfun = lambda x, t: F.softmax_cross_entropy(model(x), t)  # NOQA
    opt.update(lossfun, *send(x, t))
    bn = model[1]
    before = host(bn.avg_mean).copy(), host(bn.avg_var).copy()
    x[0, 0] = numpy.nan
    if nonfinite == 'skip':
        opt.update(lossfun, *send(x, t))
    else:
        with pytest.raises(chainerkfac.NonFiniteError):
            opt.update(lossfun, *send(x, t))
    numpy.testing.assert_array_equal(host(bn.avg_mean), before[0])
    numpy.testing.assert_array_equal(host(bn.avg_var), before[1])


def test_skipping_escalates_after_max_skipped_steps_in_a_row():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC(nonfinite='skip', max_skipped_steps=3)
    opt.setup(model)
    x, t = data()
    bad = x.copy()
    bad[0, 0] = numpy.nan
    for batch in (bad, bad, x, bad, bad):  # a good step resets the count
        opt.update(loss_fn(model), *send(batch, t))
    with pytest.raises(chainerkfac.NonFiniteError,
                       match='3 steps in a row .* iteration 6 .*/l1/W'):
        opt.update(loss_fn(model), *send(bad, t))


def test_parallel_block_work_keeps_block_order():
    model = chainer.Sequential(L.Linear(6, 40), L.Linear(40, 3),
                               L.Linear(3, 5))
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    opt.update(lambda x: F.sum(model(x) ** 2), data(dtype=numpy.float32)[0])
    large = {opt.blocks[1].name}
    names = chainerkfac.cpu_parallel.map_blocks(
        lambda b: b.name, opt.blocks,
        lambda b: chainerkfac.cpu_parallel.SERIAL_FLOPS * (b.name in large))
    assert names == [b.name for b in opt.blocks]


def test_update_before_any_backward_says_so():
    # Chainer's gradients are NaN until a backward pass writes them.
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    with pytest.raises(chainerkfac.NonFiniteError,
                       match='NaN throughout.*no backward pass wrote'):
        opt.update()


def test_snapshot_before_setup_names_setup(tmp_path):
    with pytest.raises(RuntimeError, match='before setup'):
        chainer.serializers.save_npz(str(tmp_path / 'o.npz'),
                                     chainerkfac.optimizers.KFAC())


def test_describe_names_a_link_added_after_setup_as_not_updated():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    with model.init_scope():
        model.extra = L.Linear(2, 2)
    text = opt.describe()
    assert 'not updated (added after setup; call setup again): ' \
        '/extra/W, /extra/b' in text, text
    assert 'momentum SGD parameters' not in text, text


def test_empty_batch_names_the_layer():
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    x, t = data()
    with pytest.raises(ValueError, match='layer l1 got an empty batch'):
        opt.update(loss_fn(model), *send(x[:0], t[:0]))


def test_forward_pass_never_backpropagated_is_named(caplog):
    # Its inputs would be in A while G never sees it: said once per layer.
    model = place(MLP())
    opt = chainerkfac.optimizers.KFAC(factor_interval=1)
    opt.setup(model)
    x, t = data()
    with caplog.at_level('WARNING', logger='chainerkfac'):
        opt.update(loss_fn(model), *send(x, t))
        assert 'never backpropagated' not in caplog.text
        model.cleargrads()
        xs, ts = send(x, t)
        loss = F.softmax_cross_entropy(model(xs), ts)
        model(xs)  # a forward pass without backward
        loss.backward()
        opt.update()
    assert 'K-FAC layer l1: {} sample(s) of training forward passes since ' \
        'the last step were never backpropagated'.format(len(x)) \
        in caplog.text, caplog.text


def test_bound_following_the_learning_rate_is_kl_clip_times_its_square():
    # At lr η_t the bound is kl_clip (η_t / η̂_t)², η̂_t the largest of the
    # lr it was built with and those of its steps; the bound binds here,
    # so the step at η_0 / 2 equals that of kl_clip / 4 built at η_0 / 2.
    def step(lr, kl_clip, lr_then):
        numpy.random.seed(0)
        model = place(MLP())
        opt = chainerkfac.optimizers.KFAC(
            lr=lr, momentum=0.0, step_rule='natural', kl_clip=kl_clip)
        opt.setup(model)
        opt.lr = lr_then
        observation = {}
        with chainer.Reporter().scope(observation):
            opt.update(loss_fn(model), *send(*data()))
        assert observation['kfac/update_scale'] < 0.5
        return [host(p.array) for p in model.params()]

    followed = step(0.5, 1e-4, 0.25)
    fixed = step(0.25, 0.25e-4, 0.25)
    for a, b in zip(followed, fixed):
        numpy.testing.assert_allclose(a, b, rtol=1e-12)
    # Built below the schedule's peak, the bound is kl_clip at the largest
    # lr of the run, never above: here that of its first step.
    raised = step(0.1, 1e-4, 0.25)
    plain = step(0.25, 1e-4, 0.25)
    for a, b in zip(raised, plain):
        numpy.testing.assert_allclose(a, b, rtol=1e-12)


def test_bound_following_the_learning_rate_resumes_with_its_peak():
    # η̂_t, the largest lr so far (0.5 here, above the built 0.1), is in the
    # snapshot: the resumed step at lr 0.25 is the uninterrupted one's.
    def make():
        numpy.random.seed(0)
        model = place(MLP())
        opt = chainerkfac.optimizers.KFAC(
            lr=0.1, momentum=0.0, step_rule='natural', kl_clip=1e-4)
        opt.setup(model)
        return model, opt

    model, opt = make()
    batch = data()
    opt.lr = 0.5
    opt.update(loss_fn(model), *send(*batch))
    resumed, reloaded = snapshot_helpers.reloaded(model, opt, make)
    for m, o in ((model, opt), (resumed, reloaded)):
        o.lr = 0.25
        observation = {}
        with chainer.Reporter().scope(observation):
            o.update(loss_fn(m), *send(*batch))
        assert observation['kfac/update_scale'] < 0.5
    for a, b in zip(model.params(), resumed.params()):
        numpy.testing.assert_array_equal(host(a.array), host(b.array))


class Frozen(chainer.Chain):
    """``MLP`` with ``l1``'s weights as constants, not parameters."""

    def __init__(self, model):
        super().__init__()
        self.W, self.b = model.l1.W.array.copy(), model.l1.b.array.copy()
        with chainer.using_config('dtype', self.W.dtype), self.init_scope():
            self.l2 = L.Linear(5, 3)
        self.l2.copyparams(model.l2)

    def forward(self, x):
        return self.l2(F.tanh(F.linear(x, self.W, self.b)))


def test_frozen_layer_leaves_the_other_layers_steps_alone():
    # A link frozen with disable_update() after setup takes no step, and
    # its sums stay out of the bound's q and the step rule: the live
    # layer moves as it does where the frozen one's weights are constants.
    numpy.random.seed(0)
    model = MLP()
    constants = Frozen(model)
    moved = {}
    for net in (model, constants):
        opt = chainerkfac.optimizers.KFAC(lr=0.3)
        opt.setup(net)
        if net is model:
            model.l1.disable_update()
        before = net.l2.W.array.copy()
        for step in range(6):
            opt.update(loss_fn(net), *data(seed=step))
        moved[net is model] = net.l2.W.array - before
    numpy.testing.assert_allclose(moved[True], moved[False], rtol=1e-10,
                                  atol=1e-13)
    assert numpy.abs(moved[True]).max() > 1e-2


def test_loss_function_that_raises_leaves_no_statistics():
    # The pass's statistics do not enter the next refresh: the run equals
    # one that never saw that batch.
    params = []
    for fail in (True, False):
        numpy.random.seed(0)
        model = MLP()
        opt = chainerkfac.optimizers.KFAC(factor_interval=1)
        opt.setup(model)
        if fail:
            def failing(x, t):
                model(x)
                raise KeyError('after the forward pass')
            with pytest.raises(KeyError):
                opt.update(failing, *data(seed=5))
        for step in range(3):
            opt.update(loss_fn(model), *data(seed=step))
        params.append([p.array.copy() for _, p in
                       sorted(model.namedparams())])
    for got, expected in zip(*params):
        numpy.testing.assert_array_equal(got, expected)


def test_loss_of_shape_one_steps_as_a_scalar_loss():
    params = []
    for shape in ((), (1,)):
        numpy.random.seed(0)
        model = MLP()
        opt = chainerkfac.optimizers.KFAC()
        opt.setup(model)
        opt.update(lambda x, t: F.reshape(loss_fn(model)(x, t), shape),
                   *data())
        params.append(model.l1.W.array.copy())
    numpy.testing.assert_array_equal(*params)


def test_divergence_warning_of_the_quadratic_model_names_its_damping():
    from chainerkfac import divergence
    opt = chainerkfac.optimizers.KFAC(step_rule='adaptive')
    monitor = opt._monitor
    monitor.observe(1, 1.0)
    with pytest.warns(divergence.DivergenceWarning, match='min_damping'):
        monitor.observe(2, 1e6)
