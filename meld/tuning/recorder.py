"""What production batches look like, recorded by plan() while MELD_RECORD names a file: the workload
`meld tune --workload recorded:FILE` tunes on instead of BENCH's batches.

One JSON line per recorded batch: {"operator", "shape", "batch", "kv_lens"}. Only one plan() in
MELD_RECORD_EVERY (default 100) is recorded, and only page tables planned from host memory (reading a
table that lives on the GPU would synchronise with it); the cost of an unrecorded plan() is one counter.
A file that cannot be written gives one warning and ends the recording, never a failed plan().
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from .. import config, jsonfile


class WorkloadRecorder:
    """Appends sampled batches to `path`."""

    def __init__(self, path: Path, every: int):
        if every < 1:
            raise ValueError(f"MELD_RECORD_EVERY must be >= 1, got {every}")
        self.path, self.every, self._seen = Path(path), every, 0

    def due(self) -> bool:
        """Whether this call is the one in `every` to record (counts the call)."""
        self._seen += 1
        return (self._seen - 1) % self.every == 0

    def record(self, operator: str, shape: str, kv_lens: np.ndarray) -> None:
        line = json.dumps({"operator": operator, "shape": shape, "batch": int(len(kv_lens)),
                           "kv_lens": [int(n) for n in kv_lens]})
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as e:   # recording must never fail a plan(): say so once and stop recording
            warnings.warn(f"MELD_RECORD={self.path}: cannot append batches ({e}); recording stops", stacklevel=4)
            self.every = 1 << 62


_recorders: dict[tuple[str, int], WorkloadRecorder] = {}


def recorder() -> WorkloadRecorder | None:
    """The recorder MELD_RECORD and MELD_RECORD_EVERY ask for (one per file and rate), or None."""
    path = config.get("MELD_RECORD")
    if not path:
        return None
    try:
        every = int(config.get("MELD_RECORD_EVERY"))
    except ValueError:
        raise ValueError(f"MELD_RECORD_EVERY must be an integer, got {config.get('MELD_RECORD_EVERY')!r}") from None
    key = (path, every)
    if key not in _recorders:
        _recorders[key] = WorkloadRecorder(Path(path).expanduser(), every)
    return _recorders[key]


def kv_lens(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """Each request's KV tokens from FlashInfer's paged layout."""
    pages = np.diff(indptr.astype(np.int64))
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len, 0)


def load(path: str | Path, operator: str, shape: str) -> list[list[int]]:
    """The recorded batches of one operator and shape bucket, in order; ValueError naming the file and
    line for a line that is not a record."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a workload file (JSON lines): byte {e.start} is not UTF-8 text") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            r = jsonfile.parse(line)
            if (r["operator"], r["shape"]) == (operator, shape):
                out.append([int(n) for n in r["kv_lens"]])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i} is not a workload record: {e}") from None
    return out
