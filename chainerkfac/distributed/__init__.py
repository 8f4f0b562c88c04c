"""Distributed K-FAC: placement of the curvature blocks on ranks and the
communicator that moves factors and gradients between them (Osawa et al.,
CVPR 2019, §3.3).

Nothing here imports MPI or CuPy until a communicator is created.
"""
from chainerkfac.distributed.assignment import assign_blocks  # NOQA
from chainerkfac.distributed.assignment import assign_blocks_by_count  # NOQA
from chainerkfac.distributed.assignment import Assignment  # NOQA
from chainerkfac.distributed.assignment import BlockCost  # NOQA
from chainerkfac.distributed.consistency import check_same_options  # NOQA
from chainerkfac.distributed.consistency import check_same_structure  # NOQA
from chainerkfac.distributed.communicator import create_communicator  # NOQA
from chainerkfac.distributed.communicator import KfacCommunicatorMixin  # NOQA
from chainerkfac.distributed.global_except_hook import (  # NOQA
    install_global_except_hook)
from chainerkfac.distributed.multi_node_optimizer import (  # NOQA
    create_multi_node_optimizer)
from chainerkfac.distributed.multi_node_optimizer import (  # NOQA
    HybridParallelStages)
