"""A checkpoint on disk: replaced atomically, versioned, checksummed, read back or refused.

    write("run/model.ckpt", {"model": ..., "optimizer": ..., "generators": ..., "extra": ...})
    read("run/model.ckpt")     # that dict, or ValueError: "... is truncated: ...", ...

What goes into a checkpoint, and why, is ``engine.py``'s concern (Note [What a checkpoint
restores]); this module owns its bytes.

# Note [Checkpoint files]
Format "dpfx-checkpoint-2" is a first line ``dpfx-checkpoint-2``, a JSON line
``{"bytes": N, "sha256": ...}`` and N bytes of ``torch.save`` output (a dict that also holds the
format name). The file is written whole to a temporary file and renamed over the old one
(Note [Atomic replacement] in privacy/durable.py): torch.save straight into the path, as format 1 did,
truncated the previous checkpoint first, so a save that failed (an unpicklable ``extra``, a full
disk, a kill) destroyed it. The length tells a truncated file from a damaged one, the sha256
catches damage, the first line tells a foreign file. Format 1 files (a bare torch.save, no
checksum) are still read. The payload is built in memory before the write: saving costs the
checkpoint's size once more in RAM.
"""
from __future__ import annotations

import hashlib
import io
import json

import torch

from dpfx.privacy import durable

FORMAT = "dpfx-checkpoint-2"
_LEGACY = "dpfx-checkpoint-1"
_MAGIC = FORMAT.encode() + b"\n"
_ZIP = b"PK\x03\x04"                             # torch.save's (format 1's) first bytes


def check_extra(extra: dict) -> None:
    """Refuse, before anything is written, an ``extra`` value that could not be loaded back."""
    for key, value in extra.items():
        try:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as e:
            raise ValueError(
                f"save_checkpoint: extra {key}={type(value).__name__} cannot go into a "
                f"checkpoint ({type(e).__name__}: {str(e)[:200]}); nothing was written. Pass "
                f"tensors, numbers, strings, None, or lists, tuples and dicts of them (the "
                f"checkpoint loads with weights_only=True)") from None


def write(path, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buffer)
    payload = buffer.getbuffer()
    header = json.dumps({"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()})
    durable.write_atomically(path, b"".join([_MAGIC, header.encode(), b"\n", payload]))


def read(path) -> dict:
    """The saved dict; a ValueError naming ``path`` and what is wrong with it otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(_MAGIC):
        return _read_current(path, data)
    if _MAGIC.startswith(data) or _ZIP.startswith(data):
        raise ValueError(f"{path} is truncated ({len(data)} bytes): not a whole checkpoint")
    if data.startswith(b"dpfx-checkpoint-"):
        name = data.split(b"\n", 1)[0][:40].decode(errors="replace")
        raise ValueError(f"{path} is a {name!r} file, written by another dpfx version; this "
                         f"one reads {FORMAT!r} and {_LEGACY!r}")
    if data.startswith(_ZIP):
        return _read_legacy(path, data)
    raise ValueError(f"{path} is not a dpfx checkpoint (it starts with {data[:16]!r})")


def _read_current(path, data: bytes) -> dict:
    rest = data[len(_MAGIC):]
    line, sep, payload = rest.partition(b"\n")
    try:
        header = json.loads(line) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or not isinstance(header.get("bytes"), int):
        raise ValueError(f"{path} is a damaged or truncated {FORMAT} file: its header line "
                         f"{line[:80]!r} is not whole")
    if len(payload) != header["bytes"]:
        what = "truncated" if len(payload) < header["bytes"] else "damaged (bytes after its end)"
        raise ValueError(f"{path} is {what}: its header announces {header['bytes']} bytes of "
                         f"payload, the file holds {len(payload)}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError(f"{path} is damaged: the sha256 of its payload is not the one it was "
                         f"saved with. Use an earlier checkpoint")
    state = _load(path, payload)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} is damaged: its payload's format is {state.get('format')!r}")
    return state


def _read_legacy(path, data: bytes) -> dict:
    state = _load(path, data)
    if state.get("format") != _LEGACY:
        raise ValueError(f"{path} is a torch.save file but not a dpfx checkpoint (no 'format': "
                         f"{_LEGACY!r} entry)")
    return state


def _load(path, payload: bytes) -> dict:
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is damaged or truncated: torch.load cannot read it "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a dpfx checkpoint (it holds a "
                         f"{type(state).__name__}, not a dict)")
    return state
