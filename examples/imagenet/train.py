#!/usr/bin/env python
"""Distributed K-FAC training of ResNet-50 on ImageNet (Osawa et al. 2019).

    mpiexec -n N python train.py TRAIN_LIST VAL_LIST \
        --config configs/paper/X.json [--root DIR] [--mean FILE]
        [--acc-iters K] [--model NAME]
        [--batchsize B] [--epochs E | --iterations I] [--out DIR]
        [--resume SNAPSHOT] [--loaderjob J] [--device auto|cpu|gpu]

One process per GPU (or CPU process). Rank 0 reads the list files
(``prepare.py`` writes them) and ``chainermn.scatter_dataset`` shards them.
Each process loads ``batchsize x acc_iters`` images per iteration and K-FAC
accumulates over ``acc_iters`` micro-batches, so the global mini-batch is
``batchsize x N x acc_iters``; ``--acc-iters`` lets fewer GPUs emulate a
configuration's global batch.

The output folder receives ``config.json`` (the resolved configuration),
``log``, ``accuracy.png``, ``loss.png`` and, every epoch and on SIGTERM or
SIGINT, one
snapshot per process: ``snapshot_iter_<I>.rank<R>.npz``, of which each
process keeps the latest two (``--keep-snapshots``; the run's last line
says how much they hold). ``--resume
OUT/snapshot_iter_<I>`` (or any of its rank files) makes every process load
its own file. On another number of processes (a job resized between
allocations) each process loads the files ``chainerkfac.snapshot_files``
gives it, K-FAC moves each layer's curvature to its new owner, and the
training iterators start their epoch over the new shards. A snapshot holds
the
model, the optimizer (with the K-FAC state of the blocks the process owns),
the iterator, the schedules, the logs and the running-mixup state; the random
streams of the augmentation and of the mixup λ start afresh after a resume.
"""
import argparse
import multiprocessing
import os
import signal
import sys

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)

import chainer
import chainermn
import numpy
from chainer import training
from chainer.training import extensions

import image_list
import models
import run_config
import schemes
import signal_stop


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('train_list', help='training list file')
    parser.add_argument('val_list', help='validation list file')
    parser.add_argument('--config', required=True,
                        help='JSON configuration (see configs/)')
    parser.add_argument('--root', help='folder the list paths are relative '
                        'to (default: the folder of TRAIN_LIST)')
    parser.add_argument('--mean', help='mean image .npy (default: '
                        'ROOT/mean.npy)')
    parser.add_argument('--acc-iters', type=int,
                        help='micro-batches per update (overrides config)')
    parser.add_argument('--model', choices=sorted(models.MODELS),
                        help='overrides the config')
    parser.add_argument('--batchsize', type=int,
                        help='images per process and micro-batch '
                        '(overrides the config)')
    length = parser.add_mutually_exclusive_group()
    length.add_argument('--epochs', type=int, help='overrides the config')
    length.add_argument('--iterations', type=int,
                        help='stop after this many updates instead')
    parser.add_argument('--out', default='result', help='output folder')
    parser.add_argument('--resume', help='snapshot to continue from')
    parser.add_argument('--keep-snapshots', type=int, default=2,
                        help='per-epoch snapshots kept per process, the '
                        'latest (default 2; 0 keeps every one)')
    parser.add_argument('--loaderjob', type=int, default=4,
                        help='data-loading processes per process; 0 loads '
                        'in the main process (SerialIterator)')
    parser.add_argument('--device', choices=('auto', 'cpu', 'gpu'),
                        default='auto',
                        help='auto uses a GPU when CuPy finds one')
    args = parser.parse_args(argv)
    args.root = args.root or os.path.dirname(args.train_list) or '.'
    args.mean = args.mean or os.path.join(args.root, 'mean.npy')
    return args


def config_overrides(args, n_processes):
    overrides = {'gpus': n_processes}
    for key in ('acc_iters', 'model', 'batchsize'):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.epochs is not None:
        overrides.update(epochs=args.epochs, iterations=None)
    if args.iterations is not None:
        overrides['iterations'] = args.iterations
    return overrides


class Checkpoint:
    """What a snapshot holds: the trainer and the batch converter's state."""

    def __init__(self, trainer, converter):
        self.trainer = trainer
        self.converter = converter

    def serialize(self, serializer):
        self.trainer.serialize(serializer['trainer'])
        if hasattr(self.converter, 'serialize'):
            self.converter.serialize(serializer['converter'])


def load_pairs(args, comm):
    """Rank 0 reads the lists (the others get ``None``); every rank gets the
    number of classes."""
    train = val = n_classes = None
    if comm.rank == 0:
        train = image_list.read_list(args.train_list)
        val = image_list.read_list(args.val_list)
        n_classes = 1 + max(label for _, label in train)
        bad = [pair for pair in val if not 0 <= pair[1] < n_classes]
        if bad:
            raise ValueError('{}: label {} of {} is not in the training labels'
                             ' 0..{}'.format(args.val_list, bad[0][1],
                                             bad[0][0], n_classes - 1))
    n_classes = comm.bcast_obj(n_classes)
    return train, val, n_classes


def build_datasets(args, config, comm, seed):
    train, val, n_classes = load_pairs(args, comm)
    train = chainermn.scatter_dataset(train, comm, shuffle=True,
                                      seed=config['seed'])
    # Unpadded shards: padding would count some validation images twice.
    val = chainermn.scatter_dataset(val, comm, force_equal_length=False)

    mean = None
    if config['subtract_mean']:
        mean = numpy.load(args.mean)
        size = config['image_size']
        if mean.shape != (3, size, size):
            raise ValueError('{} has shape {}; image_size {} needs (3, {}, {})'
                             .format(args.mean, mean.shape, size, size, size))
    common = dict(crop_size=config['crop_size'],
                  image_size=config['image_size'], mean=mean,
                  scale=config['scale'])
    erasing = config['random_erasing']
    train_transform = schemes.TrainTransform(
        random_crop=config['random_crop'], flip=config['flip'],
        erasing=None if erasing is None else schemes.RandomErasing(**erasing),
        seed=seed, **common)
    train = image_list.LabeledImages(train, args.root, train_transform,
                                     args.train_list)
    val = image_list.LabeledImages(val, args.root,
                                   schemes.ValTransform(**common),
                                   args.val_list)
    return train, val, n_classes


def build_iterators(args, config, train, val, seed):
    batchsize = config['batchsize'] * config['acc_iters']
    # The training order follows the seed; so does the augmentation with
    # --loaderjob 0 (loader processes take images in the order they finish).
    order = chainer.iterators.ShuffleOrderSampler(
        numpy.random.RandomState(seed))
    if args.loaderjob == 0:
        return (chainer.iterators.SerialIterator(train, batchsize,
                                                 order_sampler=order),
                chainer.iterators.SerialIterator(
                    val, config['val_batchsize'], repeat=False, shuffle=False))
    return (chainer.iterators.MultiprocessIterator(
                train, batchsize, n_processes=args.loaderjob,
                order_sampler=order),
            chainer.iterators.MultiprocessIterator(
                val, config['val_batchsize'], repeat=False, shuffle=False,
                n_processes=args.loaderjob))


def build_optimizer(config, comm, model):
    kfac = chainerkfac.optimizers.KFAC(
        lr=config['lr'], momentum=config['momentum'],
        damping=config['damping'], cov_ema_decay=config['cov_ema_decay'],
        inverse=config['inverse'], bn_fisher=config['bn_fisher'],
        factor_interval=run_config.make_interval(config['factor_interval']),
        inverse_interval=run_config.make_interval(
            config['inverse_interval']),
        acc_iters=config['acc_iters'], weight_decay=config['weight_decay'],
        bn_damping_multiplier=config['bn_damping_multiplier'],
        kl_clip=config['kl_clip'], step_rule=config['step_rule'])
    optimizer = chainerkfac.create_multi_node_optimizer(kfac, comm)
    optimizer.setup(model)
    if config['weight_rescaling']:
        optimizer.add_hook(schemes.WeightRescaling())
    return optimizer


def extend_schedules(trainer, config):
    """The schemes that edit hyperparameters; every process runs them."""
    decay = config['lr_decay']
    if decay is not None:
        trainer.extend(schemes.PolynomialDecay(
            config['lr'], decay['start'], decay['end'], decay['power']))
    if config['momentum_adjustment']:
        trainer.extend(schemes.MomentumAdjustment(config['momentum']))
    warmup = config['damping_warmup']
    if warmup is not None:
        trainer.extend(schemes.DampingWarmup(
            warmup['initial'], config['damping'], warmup['steps']))


def extend_reports(trainer, config):
    """Logs, printed table, progress bar and plots (rank 0 only). A run
    counted in iterations (a smoke run shorter than an epoch, say) logs
    and prints every iteration."""
    unit = 'epoch' if config['iterations'] is None else 'iteration'
    trainer.extend(extensions.LogReport(trigger=(1, unit)))
    for key in ('lr', 'momentum', 'damping'):
        trainer.extend(extensions.observe_value(
            key, lambda t, key=key: getattr(
                t.updater.get_optimizer('main'), key)))
    trainer.extend(extensions.PrintReport([
        'epoch', 'iteration', 'main/loss', 'validation/main/loss',
        'main/accuracy', 'validation/main/accuracy', 'lr', 'momentum',
        'damping', 'elapsed_time']))
    trainer.extend(extensions.ProgressBar(update_interval=10))
    augmented = augmentations(config)
    trainer.extend(extensions.PlotReport(
        ['main/accuracy', 'validation/main/accuracy'], 'epoch',
        file_name='accuracy.png', postprocess=labelled(
            'top-1 accuracy', augmented and 'training accuracy below '
            'validation: training batches are {}'.format(augmented))))
    trainer.extend(extensions.PlotReport(
        ['main/loss', 'validation/main/loss'], 'epoch', file_name='loss.png',
        postprocess=labelled(
            'softmax cross-entropy loss', augmented and 'training loss above '
            'validation: training batches are {}'.format(augmented))))


def augmentations(config):
    """The augmentations that make training batches harder than the
    validation set, in words (empty if none)."""
    kinds = (('mixup_alpha', 'mixed up'),
             ('random_erasing', 'randomly erased'))
    names = [name for key, name in kinds if config[key] is not None]
    return ' and '.join(names)


def labelled(ylabel, note):
    """A ``PlotReport`` postprocess that labels the y axis and, if
    ``note``, says above the plot why the curves sit where they do."""
    def postprocess(figure, axes, summary):
        axes.set_ylabel(ylabel)
        if note:
            axes.set_title(note, fontsize='small')
    return postprocess


def describe_snapshots(out, keep):
    """What the snapshots in ``out`` hold on disk, and how many are kept."""
    names = [name for name in os.listdir(out)
             if name.startswith('snapshot_iter_') and name.endswith('.npz')]
    size = sum(os.path.getsize(os.path.join(out, name)) for name in names)
    return ('snapshots: {} file(s), {:.1f} MB in {} (one per process per '
            'epoch; {}, --keep-snapshots)'.format(
                len(names), size / 1e6, out,
                'the latest {} per process kept'.format(keep) if keep
                else 'every one kept'))


def start_loader_server():
    """Starts the server process that forks the data loaders.

    Forking a process that holds MPI, CUDA or InfiniBand state is unsafe, so
    the loaders are forked by a clean server, started before the
    communicator initialises MPI. It imports :mod:`loader_session` first.
    """
    multiprocessing.set_start_method('forkserver')
    # The server runs `python -c`, which finds this folder's modules through
    # PYTHONPATH only (and silently skips a preload it cannot import).
    os.environ['PYTHONPATH'] = os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__))]
        + [p for p in [os.environ.get('PYTHONPATH')] if p])
    multiprocessing.set_forkserver_preload(['loader_session'])
    process = multiprocessing.Process()  # starting one starts the server
    process.start()
    process.join()


def report_global_batch(args, config, comm):
    """Prints the global mini-batch; warns if the config assumed another."""
    global_batch = config['batchsize'] * comm.size * config['acc_iters']
    print('global mini-batch {} = {} per process x {} processes x {} '
          'accumulation steps'.format(global_batch, config['batchsize'],
                                      comm.size, config['acc_iters']))
    intended = run_config.load(args.config)
    assumed = intended['batchsize'] * intended['gpus'] * intended['acc_iters']
    if global_batch != assumed:
        print('warning: {} assumes a global mini-batch of {}; use '
              '--acc-iters to match it'.format(args.config, assumed),
              file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    use_gpu = (args.device == 'gpu' or args.device == 'auto'
               and chainer.backends.cuda.available)
    if args.loaderjob > 0:
        start_loader_server()
    comm = chainerkfac.create_communicator(
        'pure_nccl' if use_gpu else 'naive')
    device = chainer.get_device(
        '@cupy:{}'.format(comm.intra_rank) if use_gpu else '@numpy')
    device.use()
    config = run_config.load(args.config, config_overrides(args, comm.size))
    if comm.rank == 0:
        report_global_batch(args, config, comm)

    # One seed per process governs the initial weights (rank 0's are
    # broadcast), the data order, the augmentation and the mixup.
    seed = config['seed'] + comm.rank
    numpy.random.seed(seed)
    train, val, n_classes = build_datasets(args, config, comm, seed)
    train_iter, val_iter = build_iterators(args, config, train, val, seed)
    model = schemes.SoftTargetClassifier(
        models.MODELS[config['model']](n_classes))
    model.to_device(device)
    optimizer = build_optimizer(config, comm, model)

    converter = chainer.dataset.concat_examples
    if config['mixup_alpha'] is not None:
        converter = schemes.RunningMixup(config['mixup_alpha'], n_classes,
                                         seed=seed)
    updater = training.StandardUpdater(
        train_iter, optimizer, converter=image_list.ReadableBatches(converter),
        device=device)
    length = ((config['iterations'], 'iteration')
              if config['iterations'] is not None
              else (config['epochs'], 'epoch'))
    signals = signal_stop.SignalStop(comm, (signal.SIGTERM, signal.SIGINT))
    trainer = training.Trainer(updater, signals.stop_trigger(length),
                               out=args.out)

    extend_schedules(trainer, config)
    # The distributed optimizer keeps the BatchNormalization statistics
    # averaged over the processes, so every process evaluates the same model.
    readable = image_list.ReadableBatches(chainer.dataset.concat_examples)
    trainer.extend(chainermn.create_multi_node_evaluator(
        extensions.Evaluator(val_iter, model, device=device,
                             converter=readable), comm))
    checkpoint = Checkpoint(trainer, converter)
    snapshot = extensions.snapshot(
        target=checkpoint,
        filename='snapshot_iter_{{.updater.iteration}}.rank{}.npz'.format(
            comm.rank), n_retains=args.keep_snapshots or -1)
    trainer.extend(snapshot, trigger=signals.snapshot_trigger((1, 'epoch')))
    if comm.rank == 0:
        extend_reports(trainer, config)

    if args.resume and chainerkfac.load_snapshot(
            args.resume, checkpoint, optimizer, comm, path='trainer/') \
            and comm.rank == 0:
        print('resumed {} on {} processes: each process starts its epoch '
              'over its new shard of the data'.format(
                  args.resume, comm.size))
    if comm.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        run_config.save(config, os.path.join(args.out, 'config.json'))

    trainer.run()
    # Every process has written and pruned its snapshots before rank 0
    # counts them.
    comm.mpi_comm.barrier()
    if comm.rank == 0:
        print('{} after {} iterations ({:.2f} epochs) in {:.0f} s; log in {}'
              .format('stopped by a signal' if signals.stopped else 'done',
                      trainer.updater.iteration, trainer.updater.epoch_detail,
                      trainer.elapsed_time, os.path.join(args.out, 'log')))
        print(describe_snapshots(args.out, args.keep_snapshots))
    if signals.stopped and comm.rank == 0:
        print('resume with --resume {}'.format(
            os.path.join(args.out, 'snapshot_iter_{}'.format(
                trainer.updater.iteration))))


if __name__ == '__main__':
    main()
