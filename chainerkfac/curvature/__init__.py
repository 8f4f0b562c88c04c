"""Fisher blocks: one per supported link type, one life-cycle."""
from chainerkfac.curvature.base import FisherBlock  # NOQA
from chainerkfac.curvature.base import NonFiniteError  # NOQA
from chainerkfac.curvature.batch_normalization import BatchNormalizationBlock  # NOQA
from chainerkfac.curvature.convolution_2d import Convolution2DBlock  # NOQA
from chainerkfac.curvature.kronecker import KroneckerBlock  # NOQA
from chainerkfac.curvature.doubly_factored import DoublyFactoredBlock  # NOQA
from chainerkfac.curvature.linear import LinearBlock  # NOQA
from chainerkfac.curvature.registry import lookup  # NOQA
from chainerkfac.curvature.registry import register  # NOQA
