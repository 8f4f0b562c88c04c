"""ResNet-50 (He et al. 2016; Osawa et al. §5) and ResNet-50-D (He et al.
2019).

Both are built from Convolution2D, BatchNormalization and Linear links only,
so the K-FAC optimizer has a Fisher block for every parameterised link. The
classifier uses Chainer's default initialiser. Global average pooling
replaces the fixed 7x7 pooling, so any input whose side is a multiple of 32
works (224 for ImageNet, 32 for quick runs).

The variants differ in three places ("bag of tricks", He et al. 2019):

==========  =====================  =====================================
            ResNet-50              ResNet-50-D
==========  =====================  =====================================
stem        7x7/2 conv (64)        3x3/2, 3x3, 3x3 convs (32, 32, 64)
stride      on the first 1x1 conv  on the 3x3 conv
shortcut    1x1/2 conv             2x2/2 average pooling, then 1x1 conv
==========  =====================  =====================================
"""
import chainer
import chainer.functions as F
import chainer.links as L

from .conv_bn import ConvBN

#: (in, mid, out channels, blocks, stride) of the four bottleneck stages.
STAGES = ((64, 64, 256, 3, 1), (256, 128, 512, 4, 2),
          (512, 256, 1024, 6, 2), (1024, 512, 2048, 3, 2))


class Bottleneck(chainer.Chain):
    """1x1 -> 3x3 -> 1x1 residual block, projection shortcut when needed.

    Args:
        in_channels, mid_channels, out_channels (int): Widths.
        stride (int): Spatial stride of the block.
        resnet_d (bool): Stride on the 3x3 convolution and average-pool the
            shortcut before its 1x1 convolution (ResNet-B and ResNet-D).
    """

    def __init__(self, in_channels, mid_channels, out_channels, stride,
                 resnet_d):
        super().__init__()
        self.pool_shortcut = resnet_d and stride != 1
        stride1, stride3 = (1, stride) if resnet_d else (stride, 1)
        with self.init_scope():
            self.cb1 = ConvBN(in_channels, mid_channels, 1, stride1)
            self.cb2 = ConvBN(mid_channels, mid_channels, 3, stride3)
            self.cb3 = ConvBN(mid_channels, out_channels, 1)
            if stride != 1 or in_channels != out_channels:
                self.shortcut = ConvBN(in_channels, out_channels, 1,
                                       1 if resnet_d else stride)

    def forward(self, x):
        h = F.relu(self.cb1(x))
        h = F.relu(self.cb2(h))
        h = self.cb3(h)
        if self.pool_shortcut:
            x = F.average_pooling_2d(x, 2, 2)
        if hasattr(self, 'shortcut'):
            x = self.shortcut(x)
        return F.relu(h + x)


class ResNet50(chainer.Chain):
    """ResNet-50 returning class scores (logits).

    Args:
        n_classes (int): Number of output classes.
    """

    resnet_d = False
    #: (in, out channels, kernel size, stride) of the stem convolutions.
    stem_convs = ((3, 64, 7, 2),)

    def __init__(self, n_classes=1000):
        super().__init__()
        with self.init_scope():
            self.stem = chainer.ChainList(
                *[ConvBN(*conv) for conv in self.stem_convs])
            self.stages = chainer.ChainList(*[
                chainer.ChainList(*[
                    Bottleneck(in_ch if i == 0 else out, mid, out,
                               stride if i == 0 else 1, self.resnet_d)
                    for i in range(n_blocks)])
                for in_ch, mid, out, n_blocks, stride in STAGES])
            self.fc = L.Linear(STAGES[-1][2], n_classes)

    def forward(self, x):
        for conv_bn in self.stem:
            x = F.relu(conv_bn(x))
        h = F.max_pooling_2d(x, 3, stride=2, pad=1, cover_all=False)
        for stage in self.stages:
            for block in stage:
                h = block(h)
        return self.fc(F.average(h, axis=(2, 3)))


class ResNet50D(ResNet50):
    """ResNet-50-D: deep stem, strided 3x3 and average-pooled shortcut."""

    resnet_d = True
    stem_convs = ((3, 32, 3, 2), (32, 32, 3, 1), (32, 64, 3, 1))
