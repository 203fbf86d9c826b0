"""JSON from files a user names (profile traces, the tuning database, fitted cost models, recorded
workloads). Whatever the text, parsing it fails only with ValueError: json's own errors are ValueErrors
already, but a document nested deeper than the parser's recursion limit ('[' * 200000) raises
RecursionError, which no caller expects. A file that cannot be read stays an OSError."""
from __future__ import annotations

import json
import os
from pathlib import Path


def parse(text: str | bytes):
    """json.loads; ValueError "not JSON (...)" for anything it cannot read."""
    try:
        return json.loads(text)
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"not JSON ({e})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def read(path: str | os.PathLike):
    """`parse` of a file's bytes; OSError (missing, a directory, no permission) when it cannot be read."""
    return parse(Path(path).read_bytes())
