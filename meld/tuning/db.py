"""The tuning database: operator configurations measured faster on one machine, kept in one JSON file.

An entry holds only where its measurement does: the same GPU (name and SM count), driver, CUDA version and
meld kernel sources (a hash of the kernel templates and meld's version), for one operator, dtype and shape
bucket. An operator constructed while MELD_TUNING_DB names a file looks up its key there and takes the
entry's configuration; an entry for the same operator, dtype and shape recorded under another GPU,
driver, CUDA or kernel source is ignored with a warning that says what differs.

    {"version": 1, "entries": [{"key": {...TuningKey...}, "config": {"cost": {"item_overhead_tokens": 68}},
                                "evidence": {"default_us": 232.1, "tuned_us": 229.0, ...}}]}
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .. import __version__, jsonfile

DB_VERSION = 1
MACHINE_FIELDS = ("gpu", "sm_count", "driver", "cuda", "source_hash")   # what makes an entry stale
_TEMPLATES = Path(__file__).resolve().parents[1] / "codegen" / "templates"


@lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 (16 hex digits) of meld's version and every kernel template: a tuned configuration is a
    measurement of these kernels."""
    h = hashlib.sha256(__version__.encode())
    for p in sorted(_TEMPLATES.iterdir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def _driver_version() -> str:
    from cuda.bindings import driver

    err, v = driver.cuDriverGetVersion()
    return f"{v // 1000}.{v % 1000 // 10}" if err == driver.CUresult.CUDA_SUCCESS else "unknown"


@dataclass(frozen=True)
class TuningKey:
    operator: str      # "decode_attention"
    dtype: str         # "bfloat16"
    shape: str         # the operator's shape bucket, e.g. "Hq32/Hkv8/D128/P16"
    gpu: str
    sm_count: int
    driver: str
    cuda: str
    source_hash: str

    @staticmethod
    def here(operator: str, dtype: str, shape: str, device: torch.device) -> "TuningKey":
        """The key of this operator on `device` (a CUDA device) with this meld."""
        props = torch.cuda.get_device_properties(device)
        return TuningKey(operator, dtype, shape, props.name, props.multi_processor_count, _driver_version(),
                         str(torch.version.cuda), source_hash())

    def differences(self, other: "TuningKey") -> list[str]:
        """The machine fields where `other` differs: "gpu 'NVIDIA H100' (here 'NVIDIA H200')"."""
        return [f"{f} {getattr(other, f)!r} (here {getattr(self, f)!r})" for f in MACHINE_FIELDS
                if getattr(self, f) != getattr(other, f)]


@dataclass
class TuningEntry:
    key: TuningKey
    config: dict[str, Any]                                   # what the operator takes (per operator)
    evidence: dict[str, Any] = field(default_factory=dict)   # the measurement that adopted it


class TuningDB:
    """The entries of one file (empty when the file does not exist yet)."""

    def __init__(self, path: str | os.PathLike, entries: list[TuningEntry] | None = None):
        self.path, self.entries = Path(path), list(entries or [])

    @staticmethod
    def load(path: str | os.PathLike) -> "TuningDB":
        """The file's entries; ValueError naming the file for one that cannot be read (a directory, no
        permission) or is not a database: operators read it at construction, where an OSError or a
        RecursionError from deep inside would say nothing of MELD_TUNING_DB."""
        path = Path(path)
        if not path.exists():
            return TuningDB(path)
        try:
            raw = jsonfile.read(path)
            if not isinstance(raw, dict):
                raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
            if type(raw.get("version")) is not int or raw["version"] != DB_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, this meld reads version {DB_VERSION}")
            if not isinstance(raw.get("entries"), list):
                raise ValueError(f"'entries' must be a list, got {raw.get('entries')!r:.80}")
            names = {f.name: f.type for f in fields(TuningKey)}
            entries = []
            for i, e in enumerate(raw["entries"]):
                if not isinstance(e, dict) or not isinstance(e.get("key"), dict):
                    raise ValueError(f"entry {i} must be an object with a 'key' object, got {e!r:.80}")
                if set(e["key"]) != set(names):
                    raise ValueError(f"an entry's key has fields {sorted(e['key'])}, expected {sorted(names)}")
                for name, kind in names.items():   # sm_count an int (not bool), every other field a str
                    v = e["key"][name]
                    if not (type(v) is int if kind in (int, "int") else isinstance(v, str)):
                        raise ValueError(f"entry {i}: key field {name} must be {'an int' if kind in (int, 'int') else 'a str'}, "
                                         f"got {v!r:.80}")
                for part in ("config", "evidence"):
                    if not isinstance(e.get(part, {}), dict):
                        raise ValueError(f"entry {i}: {part} must be an object, got {e[part]!r:.80}")
                entries.append(TuningEntry(TuningKey(**e["key"]), dict(e["config"]), dict(e.get("evidence", {}))))
        except OSError as e:
            raise ValueError(f"tuning database {path} is not readable: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"tuning database {path} is not readable: {e}") from None
        return TuningDB(path, entries)

    def save(self) -> None:
        """Write the file atomically (a temporary file renamed over it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"key": asdict(e.key), "config": e.config, "evidence": e.evidence} for e in self.entries]
        for row in rows:   # before anything is written: the file keeps what it held
            try:
                json.dumps(row)
            except (TypeError, ValueError) as e:
                raise ValueError(f"tuning database {self.path}: cannot save the entry {row!r:.200}: {e}") from None
        text = json.dumps({"version": DB_VERSION, "entries": rows}, indent=1)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, self.path)

    def put(self, entry: TuningEntry) -> None:
        """Add `entry`, replacing any entry of the same key."""
        if not isinstance(entry, TuningEntry):
            raise TypeError(f"entry must be a TuningEntry, got {type(entry).__name__}")
        self.entries = [e for e in self.entries if e.key != entry.key] + [entry]

    def lookup(self, key: TuningKey, warn: bool = True) -> TuningEntry | None:
        """The entry for `key`; with `warn`, a warning for each entry of the same operator, dtype and shape
        that another machine or kernel source recorded (ignored)."""
        if not isinstance(key, TuningKey):
            raise TypeError(f"key must be a TuningKey, got {type(key).__name__}")
        for e in self.entries:
            if e.key == key:
                return e
        if warn:
            for e in self.entries:
                if (e.key.operator, e.key.dtype, e.key.shape) == (key.operator, key.dtype, key.shape):
                    warnings.warn(f"tuning database {self.path}: the {key.operator} {key.dtype} {key.shape} entry is "
                                  f"ignored, it was recorded with {', '.join(key.differences(e.key))}",
                                  stacklevel=3)
        return None


def describe(db: TuningDB, device: torch.device | None) -> str:
    """What the database holds and whether each entry applies on `device` (None: no GPU here, so only the
    kernel sources can be compared), for `meld tune --show`."""
    lines = [f"tuning database {db.path}: {len(db.entries)} entr{'y' if len(db.entries) == 1 else 'ies'}"
             + ("" if db.path.exists() else " (no such file yet)")]
    for e in db.entries:
        k = e.key
        if device is not None:
            here = TuningKey.here(k.operator, k.dtype, k.shape, device)
            diff = here.differences(k)
            status = "applies here" if not diff else "ignored here: recorded with " + ", ".join(diff)
        elif k.source_hash != source_hash():
            status = f"ignored by this meld: source_hash {k.source_hash!r} (here {source_hash()!r})"
        else:
            status = "kernel sources match; no GPU here to compare the rest"
        lines.append(f"- {k.operator} {k.dtype} {k.shape} on {k.gpu} ({k.sm_count} SMs), driver {k.driver}, "
                     f"CUDA {k.cuda}: {json.dumps(e.config, sort_keys=True)}")
        if e.evidence:
            lines.append(f"  evidence: {json.dumps(e.evidence, sort_keys=True)}")
        lines.append(f"  {status}")
    return "\n".join(lines)
