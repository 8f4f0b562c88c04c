"""train.py end to end: files -> augmentation -> distributed K-FAC ->
evaluation -> snapshot, a resumed run, and a stop on SIGTERM."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import image_list
import run_config
import train

MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
TRAIN = train.__file__
SMALL = os.path.join(os.path.dirname(TRAIN), 'configs', 'small.json')


def test_plots_label_their_axes_and_say_why_training_loss_is_higher():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    config = run_config.load(SMALL)
    assert train.augmentations(config) == 'mixed up and randomly erased'
    figure, axes = plt.subplots()
    train.labelled('softmax cross-entropy loss', 'training loss above '
                   'validation: training batches are mixed up')(
        figure, axes, {})
    assert axes.get_ylabel() == 'softmax cross-entropy loss'
    assert axes.get_title() == ('training loss above validation: training '
                                'batches are mixed up')
    plt.close(figure)
    config.update(mixup_alpha=None, random_erasing=None)
    assert train.augmentations(config) == ''


def test_config_overrides():
    args = train.parse_args(['t.txt', 'v.txt', '--config', 'c.json',
                             '--acc-iters', '4', '--epochs', '2'])
    assert train.config_overrides(args, 8) == {
        'gpus': 8, 'acc_iters': 4, 'epochs': 2, 'iterations': None}
    assert args.root == '.' and args.mean == os.path.join('.', 'mean.npy')


@pytest.fixture(scope='module')
def subset(digits, tmp_path_factory):
    """256 training and 64 validation digits: 4 updates per epoch."""
    folder = tmp_path_factory.mktemp('subset')
    for name, n in (('train', 256), ('val', 64)):
        pairs = image_list.read_list(str(digits / (name + '.txt')))
        # Every 5th image keeps all classes in a small subset.
        image_list.write_list(str(folder / (name + '.txt')), pairs[::5][:n])
    return folder


def command(digits, subset, out, *extra):
    return [MPIEXEC, '-n', '2', sys.executable, TRAIN,
            str(subset / 'train.txt'), str(subset / 'val.txt'),
            '--root', str(digits), '--config', SMALL, '--out', str(out)
            ] + list(extra)


def read_log(out):
    with open(os.path.join(str(out), 'log')) as f:
        return json.load(f)


def test_train_and_resume(digits, subset, tmp_path, run_script):
    out = tmp_path / 'run'
    result = run_script(command(digits, subset, out, '--epochs', '2',
                                '--loaderjob', '0'), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    log = read_log(out)
    assert [(e['epoch'], e['iteration']) for e in log] == [(1, 4), (2, 8)]
    for entry in log:
        assert 0 <= entry['validation/main/accuracy'] <= 1
        assert entry['damping'] > 1e-3  # still in the 20-step warmup
    assert log[1]['lr'] < log[0]['lr'] == 0.02  # decay from epoch 1
    for name in ('accuracy.png', 'loss.png', 'snapshot_iter_4.rank0.npz',
                 'snapshot_iter_8.rank1.npz'):
        assert (out / name).exists(), name
    config = run_config.load(str(out / 'config.json'))
    assert config['gpus'] == 2 and config['epochs'] == 2

    # The seed governs the weights, the data order, the augmentation and
    # the mixup on every rank: a second run repeats the first.
    again = tmp_path / 'again'
    result = run_script(command(digits, subset, again, '--epochs', '2',
                                '--loaderjob', '0', '--keep-snapshots', '1'),
                        timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # Only the latest snapshot of each process stays, and the run says
    # what they hold.
    assert sorted(name for name in os.listdir(str(again))
                  if name.startswith('snapshot')) == [
        'snapshot_iter_8.rank0.npz', 'snapshot_iter_8.rank1.npz']
    size = sum(os.path.getsize(str(again / name)) for name in (
        'snapshot_iter_8.rank0.npz', 'snapshot_iter_8.rank1.npz')) / 1e6
    assert 'snapshots: 2 file(s), {:.1f} MB in {} (one per process per ' \
        'epoch; the latest 1 per process kept, --keep-snapshots)'.format(
            size, again) in result.stdout, result.stdout
    timing = ('elapsed_time',)
    assert [{k: v for k, v in e.items() if k not in timing}
            for e in read_log(again)] == \
        [{k: v for k, v in e.items() if k not in timing} for e in log]

    # Resume from the end of epoch 1 in a copy and train to epoch 3.
    resumed = tmp_path / 'resumed'
    shutil.copytree(str(out), str(resumed))
    result = run_script(command(
        digits, subset, resumed, '--epochs', '3', '--loaderjob', '0',
        '--resume', str(resumed / 'snapshot_iter_4')), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    log2 = read_log(resumed)
    assert [(e['epoch'], e['iteration']) for e in log2] == [
        (1, 4), (2, 8), (3, 12)]
    assert log2[0] == log[0]  # restored from the snapshot, not re-run
    assert log2[1]['lr'] == log[1]['lr']
    assert (resumed / 'snapshot_iter_12.rank1.npz').exists()

    # The same snapshot on one process (a job resized): K-FAC moves the
    # curvature of rank 1's layers over, the epoch count carries on.
    alone = tmp_path / 'alone'
    shutil.copytree(str(out), str(alone))
    result = run_script([MPIEXEC, '-n', '1'] + command(
        digits, subset, alone, '--epochs', '3', '--loaderjob', '0',
        '--resume', str(alone / 'snapshot_iter_8'))[3:], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'resumed {} on 1 processes'.format(
        alone / 'snapshot_iter_8') in result.stdout
    log3 = read_log(alone)
    assert [e['epoch'] for e in log3] == [1, 2, 3]
    assert log3[:2] == log[:2]
    assert 0 <= log3[2]['validation/main/accuracy'] <= 1


def test_run_shorter_than_an_epoch_prints_and_logs_every_iteration(
        digits, subset, tmp_path, run_script):
    out = tmp_path / 'smoke'
    result = run_script(command(digits, subset, out, '--iterations', '2',
                                '--loaderjob', '0'), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [e['iteration'] for e in read_log(out)] == [1, 2]
    assert 'done after 2 iterations (0.50 epochs)' in result.stdout
    assert 'log in {}'.format(out / 'log') in result.stdout


def test_corrupt_image_ends_the_job_naming_the_file(digits, subset,
                                                    tmp_path, run_script):
    pairs = image_list.read_list(str(subset / 'train.txt'))
    good = digits / pairs[0][0]
    bad = digits / 'train' / 'truncated.JPEG'
    bad.write_bytes(good.read_bytes()[:100])
    listed = tmp_path / 'train.txt'
    image_list.write_list(str(listed), [('train/truncated.JPEG', 0)] + pairs)
    for loaderjob in ('0', '2'):
        result = run_script([
            MPIEXEC, '-n', '2', sys.executable, TRAIN, str(listed),
            str(subset / 'val.txt'), '--root', str(digits), '--config',
            SMALL, '--out', str(tmp_path / loaderjob), '--epochs', '1',
            '--loaderjob', loaderjob], timeout=60)
        assert result.returncode != 0
        assert 'cannot read image {} (listed in {})'.format(bad, listed) \
            in result.stdout + result.stderr, result.stderr


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_signal_snapshots_and_stops(digits, subset, tmp_path, script_env,
                                    signum):
    out = tmp_path / 'run'
    first_epoch = out / 'snapshot_iter_4.rank1.npz'
    # Loader processes (forkserver) too: mpiexec signals the whole process
    # group of each rank, and the loaders must survive until the rank stops.
    with open(str(tmp_path / 'output.txt'), 'w+') as output:
        process = subprocess.Popen(
            command(digits, subset, out, '--epochs', '100',
                    '--loaderjob', '1'),
            stdout=output, stderr=subprocess.STDOUT, env=script_env)
        try:
            deadline = time.time() + 120
            while not first_epoch.exists() and time.time() < deadline:
                time.sleep(0.2)
            process.send_signal(signum)
            signalled = time.time()
            process.wait(timeout=120)
            stopped_after = time.time() - signalled
        finally:
            if process.poll() is None:
                process.kill()
        output.seek(0)
        text = output.read()
    assert process.returncode == 0, text
    assert 'stopped by a signal' in text
    assert stopped_after < 10, (stopped_after, text)
    snapshots = [name for name in os.listdir(str(out))
                 if name.startswith('snapshot_iter_')]
    iterations = {int(name.split('.')[0].split('_')[2]) for name in snapshots}
    # One file per rank: the epoch-1 snapshot and, at a later iteration
    # (the signal came after both ranks agreed on iteration 4), the one
    # taken on the signal.
    assert len(snapshots) == 4
    assert min(iterations) == 4 and len(iterations) == 2
