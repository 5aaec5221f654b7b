"""Nothing lost and nothing undercounted under faults: kills, failing writes, damaged files.

Training runs in real processes (forked from a forkserver that has imported torch and dpfx, so a
process starts in a fraction of a second) and is killed with SIGKILL at random points: inside
the optimizer step, inside a checkpoint save, anywhere. Each next process makes the same run
with the same privacy ledger, loads the checkpoint and reports its accountant's count. With
``counted`` the previous process's resumed count plus the updates it reported finished (the
releases: an update the world saw), the new count must lie in [counted, counted + 1] (Note
[Write-ahead privacy ledger] in dpfx/privacy/ledger.py). A full disk is a real one for the writing
process (RLIMIT_FSIZE: writes past the limit fail with EFBIG, short writes included), and
damaged, truncated and foreign files are cut and flipped byte by byte.
"""
import errno
import json
import multiprocessing as mp
import os
import random
import resource
import signal
import time

import pytest
import torch
from torch.utils.data import TensorDataset

import dpfx
from dpfx.privacy import checkpoint as checkpoint_file
from dpfx.privacy.ledger import PrivacyLedger, reconcile

SIGMA, Q, C = 1.0, 0.125, 1.0


def _make(workdir, backend="eager", ledger=True, physical=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    return dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.05), data,
                             batch_size=8, max_grad_norm=C, noise_multiplier=SIGMA,
                             backend=backend, max_physical_batch_size=physical,
                             ledger=os.path.join(workdir, "privacy.ledger") if ledger else None)


def _steps(private, n):
    """Yield before each optimizer step (the step runs when the caller resumes us)."""
    done = 0
    while done < n:
        for x, y in private.loader:
            private.optimizer.zero_grad()
            out = private.model(x)
            (((out - y) ** 2).mean(1).mean() if x.shape[0] else out.sum() * 0.0).backward()
            yield
            done += 1
            if done == n:
                return


def _params(private):
    return [p.detach().clone() for p in private.model._orig_mod.parameters()]


# ------------------------------------------------------------------------------------------------
# Processes killed at random points.

def _train_child(conn, workdir, steps, save_every):
    torch.set_num_threads(1)
    private = _make(workdir)
    ckpt = os.path.join(workdir, "model.ckpt")
    if os.path.exists(ckpt):
        dpfx.load_checkpoint(ckpt, private)
    conn.send(("resumed", private.accountant.steps))
    for i, _ in enumerate(_steps(private, steps)):
        conn.send(("step", i))
        private.optimizer.step()
        conn.send(("done", i))
        if (i + 1) % save_every == 0:
            conn.send(("saving", i))
            dpfx.save_checkpoint(ckpt, private, step=private.optimizer.steps)
            conn.send(("saved", i))
    finite = all(bool(p.isfinite().all()) for p in private.model._orig_mod.parameters())
    conn.send(("finished", private.accountant.steps, finite))


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "dpfx", "test_faults"])
    return ctx


def _kill_at_random(workdir, kills: int, seed: int, steps=9, save_every=2):
    """Kill ``kills`` training processes at random points, then let one finish; check every
    resumed count. Returns what happened, for the caller's own checks."""
    ctx, rng = _context(), random.Random(seed)
    counted, seen_kills, where = None, 0, []
    while True:
        final = seen_kills == kills
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_train_child, args=(writer, str(workdir), steps, save_every))
        child.start()
        writer.close()
        # The kill point: a random moment after the first update, or a random delay into the
        # j-th step or the j-th save.
        mode = rng.choice(["time", "step", "saving"])
        j = rng.randrange(steps // save_every if mode == "saving" else steps)
        target = (j + 1) * save_every - 1 if mode == "saving" else j     # a step's index
        kill_at, done, killed, finished, last = None, 0, False, None, None
        while True:
            timeout = 60 if kill_at is None else max(0.0, kill_at - time.monotonic())
            if not killed and kill_at is not None and time.monotonic() >= kill_at:
                os.kill(child.pid, signal.SIGKILL)
                killed = True
                continue
            if not reader.poll(timeout):
                if kill_at is None:
                    raise AssertionError("a training process sent nothing for 60 s")
                continue
            try:
                message = reader.recv()
            except EOFError:
                break
            kind = last = message[0]
            if kind == "resumed":
                if counted is not None:
                    assert counted <= message[1] <= counted + 1, (
                        f"resumed with {message[1]} steps counted after a kill {where[-1:]}; "
                        f"{counted} released (at most one more may be counted)")
                counted = message[1]
            elif kind == "done":
                done += 1
                if not final and mode == "time" and done == 1:
                    kill_at = time.monotonic() + rng.uniform(0, 0.05)
            elif kind == "finished":
                finished = message
            if not final and not killed and kill_at is None and kind == mode \
                    and message[1] == target:
                kill_at = time.monotonic() + rng.uniform(0, 0.004)
        child.join(30)
        reader.close()
        counted += done
        if final:
            assert child.exitcode == 0 and finished is not None, child.exitcode
            assert finished[1] == counted, (finished, counted)
            assert finished[2], "the parameters are not finite after the restarts"
            return where
        assert child.exitcode in (0, -signal.SIGKILL), (
            f"a training process exited with {child.exitcode} after {where[-1:]}: its traceback "
            f"is above (a checkpoint that does not load?)")
        if child.exitcode == -signal.SIGKILL:       # else it finished before the kill came
            seen_kills += 1
            where.append((mode, j, last))     # last: what the process was doing when killed


def _check_run_dir(workdir, counted_at_least):
    ledger = PrivacyLedger(os.path.join(workdir, "privacy.ledger"))
    assert ledger.steps >= counted_at_least
    ledger.close()
    checkpoint_file.read(os.path.join(workdir, "model.ckpt"))
    # The last process's saves removed the temporary files of the saves that were killed.
    assert sorted(os.listdir(workdir)) == ["model.ckpt", "privacy.ledger"]


def test_kills_at_random_points_lose_no_step(tmp_path):
    where = _kill_at_random(tmp_path, kills=5, seed=0)
    assert len(where) == 5
    _check_run_dir(tmp_path, counted_at_least=9)


@pytest.mark.slow
def test_fifty_kills_at_random_points_lose_no_step(tmp_path):
    where = _kill_at_random(tmp_path, kills=50, seed=1)
    assert {mode for mode, _, _ in where} == {"time", "step", "saving"}
    # Killed inside a step (after "step", before "done") and inside a save, not only between.
    assert {"step", "saving"} <= {last for _, _, last in where}, where
    _check_run_dir(tmp_path, counted_at_least=9)


# ------------------------------------------------------------------------------------------------
# A full disk, for real: RLIMIT_FSIZE makes the kernel refuse writes past a size (EFBIG).

def _full_disk_child(conn, workdir):
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    private = _make(workdir)
    ckpt = os.path.join(workdir, "model.ckpt")
    steps = _steps(private, 4)
    for _ in range(2):
        next(steps)
        private.optimizer.step()
    dpfx.save_checkpoint(ckpt, private, mark="good")
    ledger = os.path.join(workdir, "privacy.ledger")
    ledger_size = os.path.getsize(ledger)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (ledger_size + 20, hard))   # mid-record
    report = {}
    try:
        dpfx.save_checkpoint(ckpt, private, mark="bad")
    except OSError as e:
        report["save"] = e.errno
    next(steps)
    before = _params(private)
    try:
        private.optimizer.step()
    except OSError as e:
        report["step"] = (e.errno, str(e))
    report["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _params(private)))
    report["ledger_size"] = os.path.getsize(ledger) == ledger_size
    report["counted"] = private.accountant.steps
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))     # space freed: try again
    private.optimizer.step()
    report["changed"] = not all(torch.equal(a, b) for a, b in zip(before, _params(private)))
    report["after"] = (private.accountant.steps, private.optimizer.privacy_ledger.steps)
    report["files"] = sorted(os.listdir(workdir))
    conn.send(report)


def test_a_full_disk_loses_no_checkpoint_and_takes_no_unrecorded_step(tmp_path):
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_full_disk_child, args=(writer, str(tmp_path)))
    child.start()
    writer.close()
    assert reader.poll(120), "the full-disk process sent nothing"
    report = reader.recv()
    child.join(30)
    assert report["save"] == errno.EFBIG
    assert report["step"][0] in (errno.ENOSPC, errno.EFBIG)
    assert "step was not taken" in report["step"][1]
    assert report["unchanged"] and report["ledger_size"] and report["counted"] == 2
    assert report["changed"] and report["after"] == (3, 3)
    assert report["files"] == ["model.ckpt", "privacy.ledger"]       # no temporary file left
    assert checkpoint_file.read(tmp_path / "model.ckpt")["extra"] == {"mark": "good"}
    ledger = PrivacyLedger(tmp_path / "privacy.ledger")
    assert ledger.steps == 3


# ------------------------------------------------------------------------------------------------
# Failing saves in this process.

@pytest.fixture
def saved(tmp_path):
    private = _make(tmp_path, ledger=False)
    for _ in _steps(private, 2):
        private.optimizer.step()
    path = tmp_path / "model.ckpt"
    dpfx.save_checkpoint(path, private, epoch=1)
    return private, path


def test_a_failing_save_keeps_the_previous_checkpoint(saved, monkeypatch):
    private, path = saved
    good = path.read_bytes()
    with pytest.raises(ValueError, match="extra hook=function cannot go into a checkpoint"):
        dpfx.save_checkpoint(path, private, hook=lambda: 0)

    class Custom:
        pass
    with pytest.raises(ValueError, match="weights_only"):
        dpfx.save_checkpoint(path, private, obj=Custom())

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        dpfx.save_checkpoint(path, private, epoch=2)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert sorted(os.listdir(path.parent)) == ["model.ckpt"]
    assert dpfx.load_checkpoint(path, _make(path.parent, ledger=False)) == {"epoch": 1}


def test_a_killed_saves_temporary_file_is_removed_by_the_next_save(saved):
    import socket
    import subprocess

    private, path = saved
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    orphan = path.parent / f".model.ckpt.{host}.{dead.pid}.abc.tmp"
    live = path.parent / f".model.ckpt.{host}.{os.getpid()}.def.tmp"       # a save in progress
    elsewhere = path.parent / f".model.ckpt.otherhost.{dead.pid}.ghi.tmp"  # maybe, on that host
    for f in (orphan, live, elsewhere):
        f.write_bytes(b"half a checkpoint")
    dpfx.save_checkpoint(path, private, epoch=2)
    assert not orphan.exists() and live.exists() and elsewhere.exists()
    assert dpfx.load_checkpoint(path, private) == {"epoch": 2}


def test_damaged_truncated_and_foreign_checkpoints_are_named(saved, tmp_path):
    private, path = saved
    data = path.read_bytes()
    bad = tmp_path / "bad.ckpt"
    for cut in sorted({0, 1, 5, 17, 18, 30, 60, len(data) // 2, len(data) - 1}):
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"{bad}.* (truncated|damaged)"):
            dpfx.load_checkpoint(bad, private)
    for at in (len(data) // 3, len(data) - 10):
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match=f"{bad} is damaged: the sha256"):
            dpfx.load_checkpoint(bad, private)
    bad.write_bytes(data + b"x")
    with pytest.raises(ValueError, match="damaged \\(bytes after its end\\)"):
        dpfx.load_checkpoint(bad, private)
    bad.write_bytes(b"hello, world\n")
    with pytest.raises(ValueError, match="is not a dpfx checkpoint"):
        dpfx.load_checkpoint(bad, private)
    bad.write_bytes(b"dpfx-checkpoint-9\n{}\n")
    with pytest.raises(ValueError, match="another dpfx version"):
        dpfx.load_checkpoint(bad, private)
    torch.save({"weights": torch.ones(2)}, bad)
    with pytest.raises(ValueError, match="torch.save file but not a dpfx checkpoint"):
        dpfx.load_checkpoint(bad, private)


def test_format_1_checkpoints_still_load(saved, tmp_path):
    private, path = saved
    state = checkpoint_file.read(path)
    legacy = tmp_path / "legacy.ckpt"
    torch.save({**state, "format": "dpfx-checkpoint-1"}, legacy)      # what format 1 wrote
    fresh = _make(tmp_path, ledger=False)
    assert dpfx.load_checkpoint(legacy, fresh) == {"epoch": 1}
    assert fresh.accountant.steps == private.accountant.steps == 2
    for a, b in zip(_params(fresh), _params(private)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# The ledger's own file.

def _ledger_with(path, steps):
    ledger = PrivacyLedger(path)
    for _ in range(steps):
        ledger.append(noise_multiplier=SIGMA, sample_rate=Q, max_grad_norm=C)
    ledger.close()
    return path.read_bytes()


def test_a_torn_last_record_is_dropped_and_appends_go_on(tmp_path):
    path = tmp_path / "privacy.ledger"
    data = _ledger_with(path, 3)
    last = data.rindex(b"\n", 0, len(data) - 1) + 1
    for cut in range(last + 1, len(data)):          # every torn form of the third record
        path.write_bytes(data[:cut])
        ledger = PrivacyLedger(path)
        assert ledger.steps == 2 and path.read_bytes() == data[:last]
        ledger.append(noise_multiplier=SIGMA, sample_rate=Q, max_grad_norm=C)
        ledger.close()
        assert path.read_bytes() == data
    path.write_bytes(data[:last] + data[last:].replace(b'"step": 3', b'"step": 4'))
    assert PrivacyLedger(path).steps == 2           # a wrong crc on the last record: torn
    assert path.read_bytes() == data[:last]


def test_a_damaged_or_foreign_ledger_is_an_error_and_is_not_touched(tmp_path):
    path = tmp_path / "privacy.ledger"
    data = _ledger_with(path, 3)
    damaged = data.replace(b'"step": 2', b'"step": 7')
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match="damaged at line 3 .* with whole records after it"):
        PrivacyLedger(path)
    assert path.read_bytes() == damaged
    for foreign in (b"some notes\nmore\n", b"no newline at all"):
        path.write_bytes(foreign)
        with pytest.raises(ValueError, match="is not a dpfx privacy ledger"):
            PrivacyLedger(path)
        assert path.read_bytes() == foreign


def test_resume_counts_the_larger_of_checkpoint_and_ledger(tmp_path):
    private = _make(tmp_path)
    steps = _steps(private, 5)
    for _ in range(2):
        next(steps)
        private.optimizer.step()
    dpfx.save_checkpoint(tmp_path / "model.ckpt", private)
    for _ in steps:
        private.optimizer.step()                    # three releases after the checkpoint
    resumed = _make(tmp_path)
    assert resumed.accountant.steps == 5            # from the ledger alone
    dpfx.load_checkpoint(tmp_path / "model.ckpt", resumed)
    assert resumed.accountant.steps == 5 and resumed.optimizer.steps == 2
    assert resumed.accountant.get_epsilon(1e-5) == private.accountant.get_epsilon(1e-5)
    next(_steps(resumed, 1))
    resumed.optimizer.step()
    with pytest.raises(ValueError, match="written by another writer"):
        private.optimizer.privacy_ledger.append(noise_multiplier=SIGMA, sample_rate=Q,
                                                max_grad_norm=C)
    assert PrivacyLedger(tmp_path / "privacy.ledger").steps == resumed.accountant.steps == 6
    # A ledger given only now (the checkpoint has none) is caught up with the checkpoint.
    os.remove(tmp_path / "privacy.ledger")
    late = _make(tmp_path)
    dpfx.load_checkpoint(tmp_path / "model.ckpt", late)
    assert late.accountant.steps == 2 == late.optimizer.privacy_ledger.steps
    assert PrivacyLedger(tmp_path / "privacy.ledger").steps == 2
    # Another run's ledger is refused.
    other = PrivacyLedger(tmp_path / "other.ledger")
    other.append(noise_multiplier=3.0, sample_rate=Q, max_grad_norm=C)
    with pytest.raises(ValueError, match="record different runs"):
        reconcile(other, resumed.accountant, C)


@pytest.mark.parametrize("virtual", [False, True])
def test_the_record_is_on_disk_before_the_update(tmp_path, virtual):
    """The inner optimizer's step pre-hook runs just before the parameters change: the ledger
    file must already hold that step's record (noise in the graph, and at the optimizer)."""
    private = _make(tmp_path, physical=4 if virtual else None)
    assert private.model.dp_config.noise == ("optimizer" if virtual else "graph")
    on_disk = []
    private.optimizer.original_optimizer.register_step_pre_hook(
        lambda *_: on_disk.append(len((tmp_path / "privacy.ledger").read_bytes().splitlines())))
    for _ in _steps(private, 12):                  # physical batches, with virtual ones
        private.optimizer.step()
    steps = private.accountant.steps
    assert steps >= 2 and on_disk == [1 + k for k in range(1, steps + 1)]    # the header, k


def test_a_discarded_graph_release_is_recorded(tmp_path):
    private = _make(tmp_path)
    next(_steps(private, 1))                        # a noisy p.grad, never stepped
    private.optimizer.zero_grad()
    assert private.accountant.steps == private.optimizer.privacy_ledger.steps == 1


def test_the_inductor_path_writes_the_ledger(tmp_path):
    private = _make(tmp_path, backend="inductor")
    assert private.model.dp_config.noise == "graph"
    for _ in _steps(private, 3):
        private.optimizer.step()
    lines = (tmp_path / "privacy.ledger").read_text().splitlines()
    assert json.loads(lines[0]) == {"format": "dpfx-privacy-ledger-1"}
    records = [json.loads(line) for line in lines[1:]]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all((r["sigma"], r["q"], r["C"]) == (SIGMA, Q, C) for r in records)
    assert private.accountant.steps == 3


# ------------------------------------------------------------------------------------------------
# A dead or silent peer under torch.distributed (2 gloo ranks on CPU).

def _peer_child(rank, port, workdir, scenario, conn):
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
    private = _make(workdir)
    assert private.model.dp_config.noise == "optimizer"
    steps = _steps(private, 2)
    next(steps)
    private.optimizer.step()
    if rank == 1:
        if scenario == "dead":
            os._exit(3)
        time.sleep(60)                              # alive, silent: a hung peer
        os._exit(0)
    next(steps)
    start = time.monotonic()
    try:
        private.optimizer.step()
        conn.send(("stepped",))
    except dpfx.PeerError as e:
        conn.send(("error", str(e), time.monotonic() - start, private.accountant.steps,
                   private.optimizer.privacy_ledger.steps))
    os._exit(0)


def _peer_fault(tmp_path, scenario):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    ranks = [ctx.Process(target=_peer_child, args=(r, port, str(tmp_path), scenario, writer))
             for r in range(2)]
    for p in ranks:
        p.start()
    writer.close()
    try:
        assert reader.poll(90), f"rank 0 reported nothing about its {scenario} peer in 90 s"
        message = reader.recv()
    finally:
        for p in ranks:
            p.kill()
            p.join(10)
    assert message[0] == "error", message
    _, text, waited, counted, recorded = message
    assert "rank 0: the all-reduce of step 2 failed" in text and "took no step" in text, text
    assert "--max-restarts" in text and "ledger=" in text
    # One release (step 1); step 2 is recorded but was not taken: at most one more is counted.
    assert (counted, recorded) == (1, 2)
    assert PrivacyLedger(tmp_path / "privacy.ledger").steps == 2
    return waited


def test_a_dead_peer_is_a_clear_error_at_once(tmp_path):
    assert _peer_fault(tmp_path, "dead") < 2         # not the 3 s timeout: at once


@pytest.mark.slow
def test_a_silent_peer_is_a_clear_error_within_the_timeout(tmp_path):
    assert 2 < _peer_fault(tmp_path, "silent") < 30


def test_another_runs_checkpoint_is_refused_before_anything_is_loaded(tmp_path):
    (tmp_path / "other").mkdir()
    other = _make(tmp_path / "other", ledger=False)
    with torch.no_grad():
        for p in other.model._orig_mod.parameters():
            p.add_(1.0)
    other.accountant.step(noise_multiplier=5.0, sample_rate=Q)      # another sigma: another run
    dpfx.save_checkpoint(tmp_path / "other.ckpt", other)
    private = _make(tmp_path)
    for _ in _steps(private, 2):
        private.optimizer.step()
    before = (_params(private), private.accountant.history, private.optimizer.steps)
    with pytest.raises(ValueError, match="record different runs"):
        dpfx.load_checkpoint(tmp_path / "other.ckpt", private)
    assert private.accountant.history == before[1] and private.optimizer.steps == before[2]
    assert all(torch.equal(a, b) for a, b in zip(_params(private), before[0]))
