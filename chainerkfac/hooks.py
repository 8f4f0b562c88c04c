"""Link hooks that feed activations and output gradients to Fisher blocks.

On a training forward pass of a supported link, :class:`StatisticsHook` asks
the link's block which factors the coming optimizer step needs. If none, it
returns at once: stale steps do no curvature work. Otherwise the block takes
its forward statistics from the input, and a :class:`OutputGradientHook` is
attached to the output's creator node to catch ``∂L/∂y`` during backward.

Blocks get the arrays in float32 where the model computes in float16
(:func:`chainerkfac.linalg.widened`). Evaluation passes
(``chainer.config.train`` false) and passes without backprop never touch
the statistics. Every training pass, stale ones
included, counts its samples, whose total since the last step the
bound on the step's KL change grows with.
"""
import logging

import chainer

from chainerkfac import linalg
from chainerkfac import timing as timing_module

logger = logging.getLogger(__name__)


def _untimed(stage):
    return timing_module.timed(None, stage)


class OutputGradientHook(chainer.FunctionHook):
    """Hands the gradient of one function node's output to a block."""

    name = 'chainerkfac_output_gradient'

    def __init__(self, block, context, output_index, timing=None,
                 arrived=None, token=None):
        self.block = block
        self.context = context
        self.output_index = output_index
        self.timing = timing or _untimed
        self.arrived = arrived
        #: The pass's token for the block's kept rows, or ``None``.
        self.token = token

    def backward_preprocess(self, function, in_data, out_grad):
        gy = out_grad[self.output_index]
        if gy is None:
            return
        gy = linalg.widened(gy)
        if self.token is not None:
            self.block.keep_output_gradient(self.token, gy)
        if self.context is None:
            return
        if self.arrived is not None:
            self.arrived(self.block, len(gy))
        with self.timing('statistics_backward'):
            self.block.backward_statistics(self.context, gy, function)


class StatisticsHook(chainer.LinkHook):
    """Collects K-FAC statistics of the links it is registered on.

    Args:
        blocks (dict): ``link -> FisherBlock`` (links hash by identity,
            so a deep copy or an unpickled model keys on its own links).
        next_step (callable): Returns the optimizer step the statistics of a
            forward pass now will be used for (``optimizer.t + 1``).
        rows_wanted (callable): Returns whether the step may precondition
            from the passes' rows (:mod:`chainerkfac.curvature.low_rank`);
            ``None``: never.
        timing (callable): ``timing(stage)``, a context that times a stage
            (:meth:`KFAC.timing <chainerkfac.optimizers.KFAC.timing>`);
            ``None``: untimed.

    The samples of the training forward passes since the last step are
    counted per link (its input's first axis); :meth:`take_batch_size`
    gives the step's batch.
    """

    name = 'chainerkfac_statistics'

    def __init__(self, blocks, next_step, timing=None, rows_wanted=None):
        self.blocks = blocks
        self.next_step = next_step
        self.rows_wanted = rows_wanted
        self.timing = timing or _untimed
        self._samples = {}
        # Samples whose forward statistics wait for their backward ones,
        # per block, and the blocks already warned of a pass without it.
        self._awaited = {}
        self._warned = set()

    def forward_postprocess(self, args):
        config = chainer.config
        if not (config.train and config.enable_backprop):
            return
        link = args.link
        block = self.blocks.get(link)
        if block is None:
            return
        x = args.args[0] if args.args else args.kwargs['x']
        if len(x) == 0:
            raise ValueError('K-FAC layer {} got an empty batch (0 samples) '
                             'in a training forward pass'.format(block.name))
        self._samples[link] = self._samples.get(link, 0) + len(x)
        wanted = block.wanted(self.next_step())
        x = x.array if isinstance(x, chainer.Variable) else x
        block.note_pass(x)
        keep = self.rows_wanted is not None and block.keeps_rows(x) \
            and self.rows_wanted()
        if not (wanted or keep):
            return
        x = linalg.widened(x)
        context = None
        if wanted:
            with self.timing('statistics_forward'):
                context = block.forward_statistics(x, wanted)
        out = args.out
        node = out.creator_node
        if node is None or (context is None and not keep):
            return
        token = block.keep_input(x) if keep else None
        index = [ref() for ref in node.outputs].index(out.node)
        node.add_hook(OutputGradientHook(
            block, context, index, self.timing,
            self._arrived if context is not None else None, token))
        if context is not None:
            self._awaited[block] = self._awaited.get(block, 0) + len(x)

    def _arrived(self, block, n_samples):
        self._awaited[block] = self._awaited.get(block, 0) - n_samples

    def discard(self):
        """Forgets the samples counted since the last step, whose
        statistics the blocks dropped (a step that raised)."""
        self._samples, self._awaited = {}, {}

    def take_batch_size(self):
        """Samples fed since the last call, or ``None`` if none: all the
        forward passes of a step (micro-batches, or a manual loop's several
        backward passes), counted at the link that saw the fewest, since a
        link called once per time step (an LSTM's ``lateral``) sees each
        sample several times."""
        samples, self._samples = self._samples, {}
        awaited, self._awaited = self._awaited, {}
        for block, missing in awaited.items():
            if missing > 0 and block not in self._warned:
                # Its forward statistics are in the factors already.
                self._warned.add(block)
                logger.warning(
                    'K-FAC layer %s: %d sample(s) of training forward '
                    'passes since the last step were never backpropagated, '
                    'and their inputs are in its statistics; run forward '
                    "passes that have no backward under chainer.using_config"
                    "('train', False) or chainer.no_backprop_mode()",
                    block.name, missing)
        return min(samples.values()) if samples else None
