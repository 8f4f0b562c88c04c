"""Reference computations for the tests: loops over samples and positions."""
import numpy


def conv_patches(x, ksize, stride, pad, dilate):
    """Per-sample, per-position input patches of a 2-D convolution, by loops.

    Returns ``(n, T, c kh kw)`` in the layout of ``W.reshape(out, -1)``.
    """
    n, c, h, w = x.shape
    kh, kw = ksize
    xp = numpy.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh = (h + 2 * pad[0] - dilate[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * pad[1] - dilate[1] * (kw - 1) - 1) // stride[1] + 1
    out = numpy.zeros((n, oh * ow, c * kh * kw))
    for i in range(n):
        for p in range(oh):
            for q in range(ow):
                patch = numpy.zeros((c, kh, kw))
                for a in range(kh):
                    for b in range(kw):
                        patch[:, a, b] = xp[
                            i, :, p * stride[0] + a * dilate[0],
                            q * stride[1] + b * dilate[1]]
                out[i, p * ow + q] = patch.ravel()
    return out


def kronecker_factors(patches, out_grads, bias):
    """A and G of :mod:`chainerkfac.curvature.kronecker`'s conventions
    from per-sample rows.

    ``patches``: (n, T, d); ``out_grads``: per-sample ``ĝ = ∂l_i/∂s`` as
    (n, T, out).
    """
    n, T, _ = patches.shape
    A = 0
    G = 0
    for i in range(n):
        for t in range(T):
            a = patches[i, t]
            if bias:
                a = numpy.append(a, 1.0)
            A = A + numpy.outer(a, a)
            g = out_grads[i, t]
            G = G + numpy.outer(g, g)
    return A / n, G / (n * T)


def reduced_factors(patches, out_grads, bias):
    """A and G of ``conv_factors='reduced'`` (Ba et al. 2017, appendix A)
    from the same per-sample rows as :func:`kronecker_factors`: per sample,
    the rows (with the homogeneous 1 at every position) summed over the
    ``T`` positions and scaled by ``T^(-1/2)``."""
    n, T, _ = patches.shape
    A = 0
    G = 0
    for i in range(n):
        a = 0
        g = 0
        for t in range(T):
            a = a + (numpy.append(patches[i, t], 1.0) if bias
                     else patches[i, t])
            g = g + out_grads[i, t]
        A = A + numpy.outer(a, a) / T
        G = G + numpy.outer(g, g) / T
    return A / n, G / n


def factored_damping(A, G, damping):
    pi = numpy.sqrt((numpy.trace(A) / len(A)) / (numpy.trace(G) / len(G)))
    return (A + pi * numpy.sqrt(damping) * numpy.eye(len(A)),
            G + numpy.sqrt(damping) / pi * numpy.eye(len(G)))


def vec(M):
    """Column-major vectorisation: vec(G X A) = (Aᵀ ⊗ G) vec(X)."""
    return M.reshape(-1, order='F')


def unvec(v, shape):
    return v.reshape(shape, order='F')
