"""The privacy ledger: every noisy step, on disk before its update reaches the parameters.

    private = dpfx.make_private(model, optimizer, data, batch_size=256, max_grad_norm=1.0,
                                noise_multiplier=1.1, ledger="run/privacy.ledger")
    ...                                   # killed at any point, then in a fresh process:
    private = dpfx.make_private(..., ledger="run/privacy.ledger")   # the same call
    dpfx.load_checkpoint("run/model.ckpt", private)
    private.accountant.steps              # every step ever released, never fewer

The file is JSON lines: a header ``{"format": "dpfx-privacy-ledger-1"}``, then one record per
step, ``{"step": 7, "sigma": 1.1, "q": 0.004, "C": 1.0, "crc": ...}`` (crc: CRC-32 of the record
without it). ``DPOptimizer.step()`` appends and fsyncs the record before the inner optimizer
updates the parameters, so the ledger holds every step whose update could have been seen.

# Note [Write-ahead privacy ledger]
A database makes a change durable by writing it to its log, and fsyncing the log, before the
change touches the data pages; after a crash the log, not the pages, says what happened. Here
the change is a noisy update of the parameters and the log is this ledger: the record of step k
is on disk before update k runs, and update k + 1 starts only after update k. So after a kill at
any point, with R the updates that ran (the releases: anything the process showed the world
came from them),

    R <= complete records <= R + 1

(+1: killed between the record's fsync and its update). The checkpoint's accountant lags
behind whenever the kill came after the last save; on resume the accountant takes the larger
of the two counts (``reconcile``), so epsilon counts every release, and at most one step more
per crash.
A step whose inner update raises stays recorded: its noise was drawn. The cost is one small
write and one fsync per step (tests/privacy/test_faults.py kills training processes at random points
and checks both bounds).

# Note [A torn last record]
Only a power cut, or a disk that filled mid-write (``append_durably`` cuts those back), can
leave a last record without its newline or with a wrong crc. Its fsync never returned, so its
update never started: it is not a release, and the reader drops it (and cuts the file back to
the last whole record). A damaged record followed by whole ones is not a torn tail but a damaged
file, and an error.
"""
from __future__ import annotations

import json
import os
import zlib

from dpfx.privacy import durable
from dpfx.privacy import Accountant

FORMAT = "dpfx-privacy-ledger-1"


class PrivacyLedger:
    """An append-only, fsynced record of the noisy steps of one run (module docstring)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._history: list[list] = []          # [sigma, q, steps] per phase, as Accountant's
        self._steps = 0
        end = self._read()
        self._fd = durable.open_for_append(self.path)
        if end is not None:                     # cut a torn tail (Note [A torn last record])
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
        if os.fstat(self._fd).st_size == 0:
            durable.append_durably(self._fd, _line({"format": FORMAT}), self.path)
        self._end = os.fstat(self._fd).st_size

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """The recorded phases, as (noise_multiplier, sample_rate, steps)."""
        return [tuple(phase) for phase in self._history]

    def append(self, *, noise_multiplier: float, sample_rate: float, max_grad_norm,
               n: int = 1) -> None:
        """Record ``n`` steps, on disk when this returns (Note [Durable appends] in privacy/durable.py)."""
        sigma, q = float(noise_multiplier), float(sample_rate)
        records = b"".join(_record({"step": self._steps + i + 1, "sigma": sigma, "q": q,
                                    "C": max_grad_norm}) for i in range(n))
        if os.fstat(self._fd).st_size != self._end:
            raise ValueError(f"the privacy ledger {self.path} was written by another writer "
                             f"since this one read it (another run, or another DPOptimizer in "
                             f"this process, given the same ledger): each run needs its own "
                             f"ledger path, and a restarted run's optimizer replaces the old one")
        try:
            durable.append_durably(self._fd, records, self.path)
        except OSError as e:
            raise OSError(e.errno, f"could not record the step in the privacy ledger "
                                   f"{self.path} ({e.strerror}); the step was not taken and "
                                   f"the ledger is unchanged: free space and call step() "
                                   f"again", self.path) from e
        _add(self._history, sigma, q, n)
        self._steps += n
        self._end += len(records)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"PrivacyLedger({self.path!r}, steps={self._steps})"

    def _read(self) -> int | None:
        """Load the records; the offset to cut a torn tail at, or None."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        lines = data.split(b"\n")
        tail = lines.pop()                      # b"" when the file ends with a newline
        first = lines[0] if lines else tail
        header = _parse(first) if lines else None
        if not lines and _line({"format": FORMAT}).startswith(tail):
            return 0 if tail else None          # empty, or a torn header: a new ledger
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"{self.path} is not a dpfx privacy ledger (it starts with "
                             f"{first[:80]!r}); give make_private(ledger=) a new path, or "
                             f"the ledger of this run")
        offset = len(lines[0]) + 1
        for number, line in enumerate(lines[1:], start=2):
            record = _parse(line)
            if record is None or not _valid(record, self._steps + 1):
                if number == len(lines) and not tail:
                    return offset               # a damaged last record: torn
                raise ValueError(f"{self.path} is damaged at line {number} ({line[:80]!r}) "
                                 f"with whole records after it; it cannot be a torn last "
                                 f"append. Restore it from a copy: epsilon must not be "
                                 f"counted from a damaged ledger")
            _add(self._history, record["sigma"], record["q"], 1)
            self._steps += 1
            offset += len(line) + 1
        return offset if tail else None


def recorded(path) -> list[tuple[float, float, int]]:
    """The phases (noise_multiplier, sample_rate, steps) the ledger at ``path`` records, read
    without writing ([] when there is no file); a torn last record is left out, as the writer
    that opens the file next drops it (Note [A torn last record])."""
    if not os.path.exists(path):
        return []
    reader = object.__new__(PrivacyLedger)
    reader.path, reader._history, reader._steps, reader._fd = os.fspath(path), [], 0, None
    reader._read()
    return reader.history


def _record(fields: dict) -> bytes:
    body = json.dumps(fields, sort_keys=True)
    return _line({**fields, "crc": zlib.crc32(body.encode())})


def _line(fields: dict) -> bytes:
    return (json.dumps(fields, sort_keys=True) + "\n").encode()


def _parse(line: bytes):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _valid(record, step: int) -> bool:
    if not isinstance(record, dict) or record.get("step") != step:
        return False
    fields = {k: v for k, v in record.items() if k != "crc"}
    return record.get("crc") == zlib.crc32(json.dumps(fields, sort_keys=True).encode()) \
        and isinstance(record.get("sigma"), (int, float)) \
        and isinstance(record.get("q"), (int, float))


def _add(history: list[list], sigma: float, q: float, n: int) -> None:
    if history and history[-1][:2] == [sigma, q]:
        history[-1][2] += n
    else:
        history.append([sigma, q, n])


def reconcile(ledger: PrivacyLedger, accountant: Accountant, max_grad_norm) -> None:
    """Make the accountant and the ledger both count every step either has seen.

    The one that counts fewer steps must record a prefix of the other's steps (else they
    belong to different runs: an error); it is then brought level (Note [Write-ahead privacy
    ledger]). The ledger lags only when it is newer than the run (given after a checkpoint
    was made without one): it is then caught up with the checkpoint's steps.
    """
    check_same_run(ledger, accountant)
    mine, theirs = accountant.history, ledger.history
    if ledger.steps > accountant.steps:
        # the accountant's own state with the ledger's steps: a MatrixAccountant keeps its
        # strategy and sampling
        accountant.load_state_dict({**accountant.state_dict(),
                                    "history": [list(p) for p in theirs]})
    elif accountant.steps > ledger.steps:
        for sigma, q, n in _difference(theirs, mine):
            ledger.append(noise_multiplier=sigma, sample_rate=q, max_grad_norm=max_grad_norm,
                          n=n)


def check_same_run(ledger: PrivacyLedger, accountant: Accountant) -> None:
    """The one of the two that counts fewer steps records the first steps of the other."""
    mine, theirs = accountant.history, ledger.history
    if not _is_prefix(mine, theirs) and not _is_prefix(theirs, mine):
        raise ValueError(
            f"the privacy ledger {ledger.path} and the accountant record different runs (ledger "
            f"phases (sigma, q, steps): {theirs[:3]}..., accountant: {mine[:3]}...): give "
            f"make_private(ledger=) this run's ledger, or a new path for a new run")


def _is_prefix(short: list, long: list) -> bool:
    """Whether the steps of phases ``short`` are the first steps of phases ``long``."""
    if len(short) > len(long):
        return False
    for i, (sigma, q, n) in enumerate(short):
        other = long[i]
        if (sigma, q) != other[:2] or n > other[2] or (n < other[2] and i != len(short) - 1):
            return False
    return True


def _difference(short: list, long: list) -> list:
    """The phases of ``long`` after the steps of its prefix ``short``."""
    rest = [list(p) for p in long]
    if short:
        rest = rest[len(short) - 1:]
        rest[0][2] -= short[-1][2]
    return [tuple(p) for p in rest if p[2]]
