"""Packing of symmetric factors for transport (buffers.pack_symmetric), and
linalg's choice and change of inverse forms."""
import numpy
import pytest

from chainerkfac import linalg
from chainerkfac.distributed import buffers


@pytest.mark.parametrize('dim', [1, 2, 7, 64])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_pack_lists_the_upper_triangle_row_by_row(dim, dtype):
    X = numpy.random.RandomState(dim).randn(dim, dim + 3).astype(dtype)
    M = X @ X.T
    packed = buffers.pack_symmetric(M)
    rows, cols = numpy.triu_indices(dim)
    assert packed.dtype == dtype
    numpy.testing.assert_array_equal(packed, M[rows, cols])
    numpy.testing.assert_array_equal(buffers.unpack_symmetric(packed, dim), M)
    out = numpy.full((dim, dim), numpy.nan, dtype=dtype)
    assert buffers.unpack_symmetric(packed, dim, out) is out
    numpy.testing.assert_array_equal(out, M)


def test_unpack_of_a_sum_is_the_sum():
    # What the reduce-scatter does: add packed triangles, then unpack.
    rng = numpy.random.RandomState(0)
    A, B = (Y @ Y.T for Y in rng.randn(2, 5, 5))
    total = buffers.pack_symmetric(A) + buffers.pack_symmetric(B)
    numpy.testing.assert_allclose(buffers.unpack_symmetric(total, 5), A + B,
                                  rtol=1e-14)


def test_one_rank_keeps_a_factor_as_the_reduce_would_carry_it():
    # One rank sums nothing: its statistics stay in place, as packing and
    # unpacking them would leave them (an asymmetric one mirrored).
    rng = numpy.random.RandomState(1)
    for M in (rng.randn(6, 6), (lambda X: X @ X.T)(rng.randn(6, 9))):
        carried = buffers.unpack_symmetric(buffers.pack_symmetric(M), 6)
        kept = M.copy()
        assert buffers._mirror_upper(kept) is kept
        numpy.testing.assert_array_equal(kept, carried)
    vector = rng.randn(6)
    numpy.testing.assert_array_equal(buffers._mirror_upper(vector.copy()),
                                     vector)


# The break-even reuse C (a³ + g³) / (3 a g (a + g)) is smallest, C/3, for a
# square layer and grows with the imbalance of the two factors.
def test_explicit_inverse_pays_after_the_break_even_reuse():
    C = linalg.EXPLICIT_INVERSE_BREAK_EVEN
    for a, g in [(1024, 1024), (4608, 512), (64, 256), (2049, 1000)]:
        break_even = C * (a ** 3 + g ** 3) / (3 * a * g * (a + g))
        assert not linalg.explicit_inverse_pays(a, g, break_even * 0.99)
        assert linalg.explicit_inverse_pays(a, g, break_even * 1.01)
        assert linalg.explicit_inverse_pays(g, a, break_even * 1.01)
    # Never for an inverse used once; a square layer pays sooner than a 3x3
    # convolution (A nine times larger than G).
    assert not any(linalg.explicit_inverse_pays(d, d, 1) for d in (1, 512))
    square = min(r for r in range(1, 200)
                 if linalg.explicit_inverse_pays(512, 512, r))
    conv = min(r for r in range(1, 200)
               if linalg.explicit_inverse_pays(9 * 512, 512, r))
    assert square == 3 and conv == 22


def test_an_inverse_form_changes_kind_to_round_off():
    # What a split block's owner does with an inverse of another kind
    # after a resume on another number of processes (Split.adopt).
    rng = numpy.random.RandomState(0)
    X = rng.randn(7, 12)
    M = X @ X.T / 12 + 0.1 * numpy.eye(7)
    L = numpy.linalg.cholesky(M)
    numpy.testing.assert_allclose(linalg.inverse_of_cholesky(L),
                                  numpy.linalg.inv(M), rtol=1e-10)
    numpy.testing.assert_allclose(
        linalg.cholesky_of_inverse(numpy.linalg.inv(M)), L, rtol=1e-9,
        atol=1e-12)
