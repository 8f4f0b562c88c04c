"""Cholesky factors shared by the ranks of a split block."""
import numpy
import pytest

from chainerkfac import linalg
from chainerkfac.distributed import cholesky
from tests.device import host
from tests.device import send
from tests.mpi_helpers import describe
from tests.mpi_helpers import run_mpi
from tests.mpi_helpers import script_path


@pytest.mark.parametrize('dim, ranks, count', [
    (4608, 13, 104),  # res5 3x3 convolution of ResNet-50: 8 panels a rank
    (4608, 2, 16),
    (200, 3, 6),  # at least 32 columns a panel
    (70, 3, 2),  # fewer panels than ranks
    (20, 4, 1),
])
def test_panel_bounds_cover_the_columns(dim, ranks, count):
    bounds = cholesky.panel_bounds(dim, ranks)
    assert len(bounds) == count
    assert bounds[0][0] == 0 and bounds[-1][1] == dim
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    widths = [stop - start for start, stop in bounds]
    assert max(widths) - min(widths) <= 1
    order = [4, 0, 7][:min(ranks, 3)] + list(range(8, 8 + ranks - 3))
    mine = [cholesky.panels_of(dim, order, r) for r in order]
    assert sorted(sum(mine, [])) == list(range(count))
    assert all(p % ranks == order.index(r)
               for r, panels in zip(order, mine) for p in panels)


def test_panels_are_copies_of_lower_columns():
    M = numpy.random.default_rng(0).standard_normal((200, 200))
    M = M @ M.T
    panels = cholesky.lower_panels(M, [3, 1], 1)
    bounds = cholesky.panel_bounds(200, 2)
    assert sorted(panels) == [1, 3, 5] == cholesky.panels_of(200, [3, 1], 1)
    for p, panel in panels.items():
        start, stop = bounds[p]
        numpy.testing.assert_array_equal(panel, M[start:, start:stop])
        assert panel.flags.c_contiguous and not numpy.shares_memory(panel, M)
    assert cholesky.panel_shapes(200, [3, 1], 1) == {
        p: panel.shape for p, panel in panels.items()}


def test_cholesky_panel_is_a_step_of_the_factorization():
    # On the device of --device; the reference is NumPy's on the host.
    M = numpy.random.default_rng(1).standard_normal((60, 70))
    M = M @ M.T
    L = numpy.linalg.cholesky(M)
    panel = send(M[:, :25].copy())
    linalg.cholesky_panel(panel)
    numpy.testing.assert_allclose(host(panel), L[:, :25], atol=1e-12)
    # The next panel, after subtracting the first one's contribution.
    right = send(M[25:, 25:50]) - panel[25:] @ panel[25:50].T
    linalg.cholesky_panel(right)
    numpy.testing.assert_allclose(host(right), L[25:, 25:50], atol=1e-12)
    with pytest.raises(numpy.linalg.LinAlgError):
        linalg.cholesky_panel(send(-M[:, :10].copy()))


def test_shared_cholesky_under_mpiexec():
    result = run_mpi(3, script_path('shared_cholesky.py'), timeout=120)
    assert result.returncode == 0, describe(result)
    for rank in range(3):
        assert 'rank {}: ok'.format(rank) in result.stdout, describe(result)
