"""Factors collected by the hooks equal brute-force per-sample factors."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from tests import brute_force
from tests import device  # NOQA: F401 (the skipif conditions use it)
from tests.device import host, place, send


def per_sample_loss(y, r):
    """l_i = Σ tanh(y_i) r_i; the batch loss is the mean over i."""
    return F.sum(F.tanh(y) * r, axis=tuple(range(1, y.ndim)))


def linear_loss(y, r):
    """l_i = Σ y_i r_i: the per-sample output gradient is r_i itself."""
    return F.sum(y * r, axis=tuple(range(1, y.ndim)))


def collect(link, x, r, loss=per_sample_loss, link_kwargs=None,
            **kfac_options):
    """Runs one K-FAC step on ``link`` (on the tests' device) with the
    batch mean of ``loss`` and returns its block."""
    opt = chainerkfac.optimizers.KFAC(lr=0.0, **kfac_options)
    opt.setup(place(link))
    opt.update(lambda x, r: F.mean(loss(link(x, **(link_kwargs or {})), r)),
               *send(x, r))
    block, = opt.blocks
    return block


def per_sample_output_grads(link, x, r):
    """∂l_i/∂y_i from a separate backward pass for every sample."""
    x, r = link.device.send(x), link.device.send(r)
    grads = []
    for i in range(len(x)):
        y = link(x[i:i + 1])
        loss = F.sum(per_sample_loss(y, r[i:i + 1]))
        gy, = chainer.grad([loss], [y])
        grads.append(host(gy.array[0]))
    return numpy.stack(grads)


@pytest.mark.parametrize('nobias', [False, True])
def test_linear_factors(nobias):
    rng = numpy.random.RandomState(0)
    with chainer.using_config('dtype', numpy.float64):
        link = L.Linear(5, 3, nobias=nobias)
    if not nobias:
        link.b.array = rng.randn(3)
    x = rng.randn(7, 5)
    r = rng.randn(7, 3)
    gy = per_sample_output_grads(link, x, r)
    A, G = brute_force.kronecker_factors(x[:, None], gy[:, None], not nobias)
    block = collect(link, x, r)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)
    numpy.testing.assert_allclose(host(block.factor['G']), G, rtol=1e-10)


@pytest.mark.parametrize('link_class', [
    L.Convolution2D, L.DilatedConvolution2D])
@pytest.mark.parametrize('stride,pad,dilate', [
    (1, 0, 1), ((2, 1), 1, 1), (1, (2, 1), 2), (2, 1, (1, 2))])
def test_convolution_2d_factors(link_class, stride, pad, dilate):
    rng = numpy.random.RandomState(1)
    link = link_class(2, 3, (3, 2), stride=stride, pad=pad, dilate=dilate)
    link.W.array = rng.randn(*link.W.shape)
    link.b.array = rng.randn(3)
    x = rng.randn(4, 2, 7, 6)
    y = link(x)
    r = rng.randn(*y.shape)
    gy = per_sample_output_grads(link, x, r)
    n, out, oh, ow = gy.shape
    patches = brute_force.conv_patches(
        x, (3, 2), link.stride, link.pad, link.dilate)
    rows = gy.reshape(n, out, oh * ow).transpose(0, 2, 1)
    A, G = brute_force.kronecker_factors(patches, rows, True)
    block = collect(link, x, r)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)
    numpy.testing.assert_allclose(host(block.factor['G']), G, rtol=1e-10)


def paper_product(patches, out_grads, bias):
    """Ba et al. 2017, appendix A, eq. (18): ``|T|² E[Ā Āᵀ] ⊗ E[D̄ D̄ᵀ]``
    with ``Ā``, ``D̄`` each sample's means over positions (as ``kron`` of
    the matrices, whose ``vec`` is column-major)."""
    n, T, _ = patches.shape
    if bias:
        patches = numpy.concatenate([patches, numpy.ones((n, T, 1))], axis=2)
    a, d = patches.mean(axis=1), out_grads.mean(axis=1)
    return T * T * numpy.kron(a.T @ a / n, d.T @ d / n)


@pytest.mark.parametrize('ksize,stride,pad,dilate,nobias,batch_subsample', [
    ((3, 2), 1, 0, 1, False, 1), ((3, 2), (2, 1), 1, 1, True, 1),
    ((3, 2), 1, (2, 1), 2, False, 1), (3, 2, 1, (1, 2), True, 1),
    (1, 2, 0, 1, False, 1), ((3, 2), (2, 1), 1, 1, False, 3)])
def test_reduced_convolution_2d_factors(ksize, stride, pad, dilate, nobias,
                                        batch_subsample):
    # conv_factors='reduced': each sample's patches and output gradients
    # summed over positions, T^(-1/2) on each factor's side, over the first
    # ⌈n/k⌉ samples; the product is the paper's eq. (18).
    rng = numpy.random.RandomState(10)
    with chainer.using_config('dtype', numpy.float64):
        link = L.Convolution2D(2, 3, ksize, stride=stride, pad=pad,
                               dilate=dilate, nobias=nobias,
                               initial_bias=0.5)
    link.W.array = rng.randn(*link.W.shape)
    x = rng.randn(7, 2, 7, 6)
    r = rng.randn(*link(x).shape)
    m = -(-len(x) // batch_subsample)
    gy = per_sample_output_grads(link, x, r)[:m]
    n, out, oh, ow = gy.shape
    patches = brute_force.conv_patches(x[:m], link.W.shape[2:], link.stride,
                                       link.pad, link.dilate)
    rows = gy.reshape(n, out, oh * ow).transpose(0, 2, 1)
    A, G = brute_force.reduced_factors(patches, rows, not nobias)
    numpy.testing.assert_allclose(numpy.kron(A, G), paper_product(
        patches, rows, not nobias), rtol=1e-12)
    block = collect(link, x, r, conv_factors='reduced',
                    batch_subsample=batch_subsample)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)
    numpy.testing.assert_allclose(host(block.factor['G']), G, rtol=1e-10)
    assert block.describe().endswith(", conv_factors='reduced'")


@pytest.mark.parametrize('nobias', [False, True])
def test_reduced_linear_factors(nobias):
    # n_batch_axes=2: the T positions of a sample are summed as a
    # convolution's; with one position the factors are the expanded ones.
    rng = numpy.random.RandomState(11)
    n, T = 5, 4
    with chainer.using_config('dtype', numpy.float64):
        link = L.Linear(3, 2, nobias=nobias, initial_bias=0.5)
    link.W.array = rng.randn(2, 3)
    x, r = rng.randn(n, T, 3), rng.randn(n, T, 2)
    gy = []
    for i in range(n):
        y = link(x[i:i + 1], n_batch_axes=2)
        g, = chainer.grad([F.sum(per_sample_loss(y, r[i:i + 1]))], [y])
        gy.append(g.array[0])
    A, G = brute_force.reduced_factors(x, numpy.stack(gy), not nobias)
    # One position (where the block takes the expanded path): the
    # reduced formula itself gives the expanded factors. (Brute force
    # first: collect moves the link to the test device.)
    gy1 = []
    for i in range(n):
        y = link(x[i:i + 1, :1], n_batch_axes=2)
        g, = chainer.grad([F.sum(per_sample_loss(y, r[i:i + 1, :1]))], [y])
        gy1.append(g.array[0])
    A1, G1 = brute_force.reduced_factors(x[:, :1], numpy.stack(gy1),
                                         not nobias)
    single = link.copy(mode='copy')
    block = collect(link, x, r, link_kwargs={'n_batch_axes': 2},
                    conv_factors='reduced')
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)
    numpy.testing.assert_allclose(host(block.factor['G']), G, rtol=1e-10)
    expanded = collect(single, x[:, 0], r[:, 0],
                       conv_factors='reduced')
    numpy.testing.assert_allclose(host(expanded.factor['A']), A1,
                                  rtol=1e-12)
    numpy.testing.assert_allclose(host(expanded.factor['G']), G1,
                                  rtol=1e-10)


def hadamard(k):
    """A ``k x k`` matrix of ±1 with orthogonal rows and columns."""
    H = numpy.ones((1, 1))
    while len(H) < k:
        H = numpy.block([[H, H], [H, -H]])
    return H


@pytest.mark.parametrize('kind', ['convolution', 'linear'])
def test_reduced_factors_equal_kfc_where_its_assumptions_hold(kind):
    # Activations constant over positions and derivatives uncorrelated
    # across positions (copies of a sample whose derivatives at position t
    # carry the signs of Hadamard column t: the cross terms cancel over the
    # batch): the reduced factors are KFC's. With derivatives constant over
    # positions too, a sample's gradient is exactly T ā ⊗ ĝ: the reduced
    # A ⊗ G is its Fisher, T times KFC's.
    rng = numpy.random.RandomState(12)
    T, copies = 4, 4
    with chainer.using_config('dtype', numpy.float64):
        if kind == 'convolution':
            # A 3x3 kernel without padding over a constant 4x4 input: every
            # patch is the same, at 2x2 positions.
            link = L.Convolution2D(2, 3, 3, initial_bias=0.5)
            x = numpy.repeat(rng.randn(2, 2, 1, 1), 16, axis=2).reshape(
                2, 2, 4, 4)
            kwargs = {}
        else:
            link = L.Linear(2, 3, initial_bias=0.5)
            x = numpy.repeat(rng.randn(2, 1, 2), T, axis=1)
            kwargs = {'n_batch_axes': 2}
    link.W.array = rng.randn(*link.W.shape)
    shape = link(x, **kwargs).shape  # (n, 3, 2, 2) or (n, T, 3)

    def positions_last(v):
        return v if kind == 'convolution' else v.transpose(0, 2, 1)

    x = numpy.repeat(x, copies, axis=0)
    base = numpy.repeat(rng.randn(2, 3, T), copies, axis=0)
    signs = numpy.tile(hadamard(T)[:copies], (2, 1))[:, None]

    def factors(x, r, mode):
        block = collect(link.copy(mode='copy'), x,
                        positions_last(r).reshape((len(x),) + shape[1:]),
                        loss=linear_loss, link_kwargs=kwargs,
                        conv_factors=mode)
        return host(block.factor['A']), host(block.factor['G'])

    (A, G), (A_r, G_r) = (factors(x, base * signs, mode)
                          for mode in ('expanded', 'reduced'))
    numpy.testing.assert_allclose(A_r, A, rtol=1e-12)
    numpy.testing.assert_allclose(G_r, G, rtol=1e-12)

    g = base[0, :, 0]
    (A, G), (A_r, G_r) = (factors(x[:1], numpy.repeat(
        g[None, :, None], T, axis=2), mode)
        for mode in ('expanded', 'reduced'))
    a = numpy.append(brute_force.conv_patches(
        x[:1], (3, 3), (1, 1), (0, 0), (1, 1))[0, 0]
        if kind == 'convolution' else x[0, 0], 1.0)
    gradient = brute_force.vec(T * numpy.outer(g, a))
    numpy.testing.assert_allclose(numpy.kron(A_r, G_r),
                                  numpy.outer(gradient, gradient),
                                  rtol=1e-12)
    numpy.testing.assert_allclose(numpy.kron(A_r, G_r),
                                  T * numpy.kron(A, G), rtol=1e-12)


@pytest.mark.parametrize('n,dim,positions,sizes', [
    (32, 2048, 49, [32]),          # few positions: one product
    (32, 256, 3136, [1] * 32),     # 1x1 convolution at 56x56
    (32, 512, 784, [3] * 10 + [2]),
    (7, 4, 5, [4, 3]),
    (4, 12, 25, [2, 2]),           # test_convolution_2d_factors' A
])
def test_sample_chunks(n, dim, positions, sizes):
    # Consecutive slices covering the batch, each of about the fewest
    # samples whose columns number 4 dim or more.
    chunks = chainerkfac.curvature.kronecker.sample_chunks(n, dim, positions)
    assert [c.stop - c.start for c in chunks] == sizes
    assert chunks[0].start == 0 and chunks[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))


@pytest.mark.skipif('device.on_gpu()',
                    reason='on a GPU, A comes from im2col by design')
@pytest.mark.parametrize('ksize,pad,nobias', [
    (3, 1, False), ((3, 2), (0, 1), True), ((5, 3), 2, False)])
def test_stride_1_convolution_a_factor_without_im2col(ksize, pad, nobias,
                                                      monkeypatch):
    # Outputs at least 4 kernel borders across: A comes from shifted sums
    # of the input (shifted_gram), and im2col never runs.
    rng = numpy.random.RandomState(6)
    with chainer.using_config('dtype', numpy.float64):
        link = L.Convolution2D(2, 3, ksize, pad=pad, nobias=nobias,
                               initial_bias=0.5)
    link.W.array = rng.randn(*link.W.shape)
    x = rng.randn(3, 2, 18, 12)
    r = rng.randn(*link(x).shape)
    patches = brute_force.conv_patches(x, link.W.shape[2:], link.stride,
                                       link.pad, link.dilate)
    A, _ = brute_force.kronecker_factors(patches, patches, not nobias)

    def no_im2col(*args):
        raise AssertionError('im2col ran')

    monkeypatch.setattr(chainerkfac.curvature.convolution_2d
                        .Convolution2DBlock, 'input_columns', no_im2col)
    block = collect(link, x, r)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)


def channels_last(x):
    """``x`` (NCHW) stored channels-last, as Chainer's CPU convolutions and
    the elementwise functions after them leave their outputs."""
    return numpy.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(
        0, 3, 1, 2)


@pytest.mark.parametrize('ksize,stride,pad,nobias', [
    (1, 1, 0, False),              # columns are the input itself
    (1, 2, 0, True),
    (3, 1, 1, False),              # shifted_gram
    ((3, 2), (2, 1), 1, True),     # im2col
])
def test_convolution_a_factor_of_channels_last_input(ksize, stride, pad,
                                                     nobias):
    rng = numpy.random.RandomState(8)
    with chainer.using_config('dtype', numpy.float64):
        link = L.Convolution2D(3, 2, ksize, stride=stride, pad=pad,
                               nobias=nobias, initial_bias=0.5)
    link.W.array = rng.randn(*link.W.shape)
    x = channels_last(rng.randn(3, 3, 18, 12))
    r = rng.randn(*link(x).shape)
    patches = brute_force.conv_patches(x, link.W.shape[2:], link.stride,
                                       link.pad, link.dilate)
    A, _ = brute_force.kronecker_factors(patches, patches, not nobias)
    block = collect(link, x, r)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)


def test_channels_last_columns_are_not_copied():
    x = channels_last(numpy.random.RandomState(9).randn(2, 3, 4, 5))
    xt = x.transpose(1, 0, 2, 3)
    columns = chainerkfac.curvature.convolution_2d.channel_columns(xt)
    numpy.testing.assert_array_equal(columns, xt.reshape(3, -1))
    assert numpy.shares_memory(columns, x)


@pytest.mark.parametrize('ksize,stride,pad,nobias', [
    ((3, 2), (2, 1), 1, False), (1, 1, 0, True), (1, 2, 0, False)])
@pytest.mark.parametrize('s', [2, 3])
def test_spatially_subsampled_convolution_a_factor(ksize, stride, pad,
                                                   nobias, s):
    # A from the output positions on every s-th row and column, scaled by
    # T / T_kept to the sum over all positions; G is untouched.
    rng = numpy.random.RandomState(5)
    with chainer.using_config('dtype', numpy.float64):
        link = L.Convolution2D(2, 3, ksize, stride=stride, pad=pad,
                               nobias=nobias, initial_bias=0.5)
    link.W.array = rng.randn(*link.W.shape)
    x = rng.randn(4, 2, 7, 6)
    y = link(x)
    r = rng.randn(*y.shape)
    n, out, oh, ow = y.shape
    kh, kw = ksize if isinstance(ksize, tuple) else (ksize, ksize)
    patches = brute_force.conv_patches(
        x, (kh, kw), link.stride, link.pad, link.dilate)
    kept = [p * ow + q for p in range(0, oh, s) for q in range(0, ow, s)]
    A, _ = brute_force.kronecker_factors(patches[:, kept], patches[:, kept],
                                         not nobias)
    A *= oh * ow / len(kept)
    full = collect(link, x, r)
    block = collect(link, x, r, spatial_subsample=s)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)
    numpy.testing.assert_allclose(host(block.factor['G']),
                                  host(full.factor['G']),
                                  rtol=1e-12)


@pytest.mark.parametrize('k', [2, 3, 7])
def test_batch_subsampled_factors(k):
    # A and G of the first ⌈n/k⌉ samples, each divided by that count; G's
    # per-sample gradients keep the scale of the mean loss over all n.
    rng = numpy.random.RandomState(6)
    link = L.Convolution2D(2, 3, 3, stride=2, pad=1)
    link.W.array = rng.randn(*link.W.shape)
    link.b.array = rng.randn(3)
    x = rng.randn(7, 2, 6, 5)
    y = link(x)
    r = rng.randn(*y.shape)
    m = -(-7 // k)
    gy = per_sample_output_grads(link, x, r)[:m]
    n, out, oh, ow = gy.shape
    patches = brute_force.conv_patches(x[:m], (3, 3), link.stride,
                                       link.pad, link.dilate)
    rows = gy.reshape(n, out, oh * ow).transpose(0, 2, 1)
    A, G = brute_force.kronecker_factors(patches, rows, True)
    block = collect(link, x, r, batch_subsample=k)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)
    numpy.testing.assert_allclose(host(block.factor['G']), G, rtol=1e-10)
    # Linear blocks subsample alike; spatial subsampling composes (A only).
    with chainer.using_config('dtype', numpy.float64):
        linear = L.Linear(5, 3)
    x = rng.randn(7, 5)
    r = rng.randn(7, 3)
    gy = per_sample_output_grads(linear, x, r)[:m]
    A, G = brute_force.kronecker_factors(x[:m, None], gy[:, None], True)
    block = collect(linear, x, r, batch_subsample=k, spatial_subsample=2)
    numpy.testing.assert_allclose(host(block.factor['A']), A, rtol=1e-12)
    numpy.testing.assert_allclose(host(block.factor['G']), G, rtol=1e-10)


@pytest.mark.parametrize('bn_fisher', ['diagonal', 'full'])
@pytest.mark.parametrize('shape', [(6, 3, 4, 5), (6, 3)])
# BatchRenormalization (r = 1, d = 0 by default: the same function) has a
# function node of its own, without the batch moments the block reuses.
@pytest.mark.parametrize('link_class', [L.BatchNormalization,
                                        L.BatchRenormalization])
def test_batch_normalization_fisher(bn_fisher, shape, link_class):
    # BN couples samples, so the per-sample gradient is defined with x̂ held
    # fixed (paper §5.4): u_i = Σ ĝ_i x̂_i, v_i = Σ ĝ_i with ĝ_i = ∂l_i/∂y_i.
    # With BN as the last layer, ∂l_i/∂y_i = (1 - tanh² y_i) r_i exactly.
    rng = numpy.random.RandomState(2)
    C = shape[1]
    link = link_class(C, dtype=numpy.float64)
    link.gamma.array = rng.rand(C) + 0.5
    link.beta.array = rng.randn(C)
    x = rng.randn(*shape) * 2 + 1
    r = rng.randn(*shape)
    axes = (0,) + tuple(range(2, len(shape)))
    x_hat = (x - x.mean(axis=axes, keepdims=True)) / numpy.sqrt(
        x.var(axis=axes, keepdims=True) + link.eps)
    expand = (slice(None),) + (None,) * (len(shape) - 2)
    y = link.gamma.array[expand] * x_hat + link.beta.array[expand]
    g_hat = (1 - numpy.tanh(y) ** 2) * r
    n = shape[0]
    z = []
    for i in range(n):
        u = [sum(g_hat[i, c].ravel() * x_hat[i, c].ravel()) for c in range(C)]
        v = [sum(g_hat[i, c].ravel()) for c in range(C)]
        z.append(numpy.array(u + v))
    full = sum(numpy.outer(zi, zi) for zi in z) / n
    block = collect(link, x, r, bn_fisher=bn_fisher)
    expected = numpy.diag(full) if bn_fisher == 'diagonal' else full
    numpy.testing.assert_allclose(host(block.factor['F']), expected,
                                  rtol=1e-10)


def test_statistics_ignore_evaluation_passes():
    rng = numpy.random.RandomState(3)
    link = place(L.Linear(4, 2))
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(link)
    block, = opt.blocks
    x = send(rng.randn(3, 4).astype(numpy.float32))
    with chainer.using_config('train', False):
        F.sum(link(x)).backward()
    with chainer.no_backprop_mode():
        link(x)
    assert not block.has_pending_statistics()
    F.sum(link(x)).backward()
    assert block.has_pending_statistics()


@pytest.mark.parametrize('manual', [False, True])
def test_loss_scale_is_divided_out(manual):
    # The optimizer's loss_scaling(), or a manual loop's
    # loss.backward(loss_scale=s) without it: the statistics carry s² and
    # the gradients s, as the parameters record; both come out as without
    # a scale.
    rng = numpy.random.RandomState(4)
    x = rng.randn(5, 4)
    r = rng.randn(5, 3)
    factors = []
    for scale in (None, 64.0):
        with chainer.using_config('dtype', numpy.float64):
            link = L.Linear(4, 3, initialW=numpy.ones((3, 4)))
        opt = chainerkfac.optimizers.KFAC(lr=0.1, momentum=0.0)
        opt.setup(place(link))

        def lossfun(x, r):
            return F.mean(per_sample_loss(link(x), r))
        if manual:
            link.cleargrads()
            lossfun(*send(x, r)).backward(loss_scale=scale)
            opt.update()
        else:
            if scale:
                opt.loss_scaling(scale=scale)
            opt.update(lossfun, *send(x, r))
        factors.append((host(opt.blocks[0].factor['G']),
                        host(link.W.array).copy()))
    numpy.testing.assert_allclose(factors[0][0], factors[1][0], rtol=1e-10)
    numpy.testing.assert_allclose(factors[0][1], factors[1][1], rtol=1e-10)


@pytest.mark.parametrize('decay', [0.0, 0.5])
def test_refreshes_fold_into_moving_averages(decay):
    # The block writes each refresh's statistics into the array of the
    # previous one; the factors must still be the moving averages of the
    # brute-force factors, and with decay 0 a factor read earlier must keep
    # its value.
    rng = numpy.random.RandomState(6)
    with chainer.using_config('dtype', numpy.float64):
        link = L.Linear(5, 3)
    opt = chainerkfac.optimizers.KFAC(lr=0.0, cov_ema_decay=decay)
    opt.setup(place(link))
    expected, read = None, []
    for step in range(3):
        x = rng.randn(6, 5)
        r = rng.randn(6, 3)
        gy = per_sample_output_grads(link, x, r)
        new = brute_force.kronecker_factors(x[:, None], gy[:, None], True)
        expected = new if expected is None else [
            decay * old + (1 - decay) * value
            for old, value in zip(expected, new)]
        opt.update(lambda x, r: F.mean(per_sample_loss(link(x), r)),
                   *send(x, r))
        block, = opt.blocks
        numpy.testing.assert_allclose(host(block.factor['A']), expected[0],
                                      rtol=1e-12)
        numpy.testing.assert_allclose(host(block.factor['G']), expected[1],
                                      rtol=1e-10)
        read.append((block.factor['A'], expected[0]))
    if decay == 0:
        for array, value in read:
            numpy.testing.assert_allclose(host(array), value, rtol=1e-12)


def test_link_called_per_position_against_positions_in_one_call():
    # The convention for a link called T times in one forward pass (shared
    # weights, an LSTM's lateral link): each call counts as more samples,
    # so A is the mean over the calls, 1/T of the A of the same positions
    # in one call (n_batch_axes=2, KFC: the sum over positions); G is the
    # mean over positions either way (docs/guide/links.md).
    rng = numpy.random.RandomState(3)
    n, T = 4, 3
    with chainer.using_config('dtype', numpy.float64):
        init = L.Linear(5, 2)
    x, r = rng.randn(n, T, 5), rng.randn(n, T, 2)
    factors = []
    for per_call in (False, True):
        link = init.copy(mode='copy')
        opt = chainerkfac.optimizers.KFAC(lr=0.0)
        opt.setup(place(link))

        def loss(x, r):
            if per_call:
                y = F.stack([link(x[:, t]) for t in range(T)], axis=1)
            else:
                y = link(x, n_batch_axes=2)
            return F.mean(per_sample_loss(y, r))
        opt.update(loss, *send(x, r))
        block, = opt.blocks
        factors.append({f: host(block.factor[f]) for f in ('A', 'G')})
    one_call, per_call = factors
    # The one call against the dense per-sample factors (KFC convention).
    link = place(init.copy(mode='copy'))
    gy = []
    for i in range(n):
        y = link(link.device.send(x[i:i + 1]), n_batch_axes=2)
        loss = F.sum(per_sample_loss(y, link.device.send(r[i:i + 1])))
        g, = chainer.grad([loss], [y])
        gy.append(host(g.array[0]))
    A, G = brute_force.kronecker_factors(x, numpy.stack(gy), True)
    numpy.testing.assert_allclose(one_call['A'], A, rtol=1e-12)
    numpy.testing.assert_allclose(one_call['G'], G, rtol=1e-10)
    numpy.testing.assert_allclose(per_call['A'] * T, one_call['A'],
                                  rtol=1e-12)
    numpy.testing.assert_allclose(per_call['G'], one_call['G'], rtol=1e-12)
