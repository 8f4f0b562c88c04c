"""Packing of symmetric factors for transport (linalg.pack_symmetric)."""
import numpy
import pytest

from chainerkfac import linalg


@pytest.mark.parametrize('dim', [1, 2, 7, 64])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_pack_lists_the_upper_triangle_row_by_row(dim, dtype):
    X = numpy.random.RandomState(dim).randn(dim, dim + 3).astype(dtype)
    M = X @ X.T
    packed = linalg.pack_symmetric(M)
    rows, cols = numpy.triu_indices(dim)
    assert packed.dtype == dtype
    numpy.testing.assert_array_equal(packed, M[rows, cols])
    numpy.testing.assert_array_equal(linalg.unpack_symmetric(packed, dim), M)


def test_unpack_of_a_sum_is_the_sum():
    # What the reduce-scatter does: add packed triangles, then unpack.
    rng = numpy.random.RandomState(0)
    A, B = (Y @ Y.T for Y in rng.randn(2, 5, 5))
    total = linalg.pack_symmetric(A) + linalg.pack_symmetric(B)
    numpy.testing.assert_allclose(linalg.unpack_symmetric(total, 5), A + B,
                                  rtol=1e-14)
