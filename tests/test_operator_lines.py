"""tools/operator_lines.py: every file it attributes to an operator exists, and it counts code, not comments."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import operator_lines  # noqa: E402


def test_every_attributed_file_exists():
    root = Path(operator_lines.ROOT)
    missing = [f for fs in operator_lines.OPERATORS.values() for f in fs if not (root / f).exists()]
    assert not missing, f"moved or renamed: update tools/operator_lines.py ({missing})"


def test_comments_and_blank_lines_are_not_code():
    assert operator_lines.code_lines("x = 1\n\n# a comment\n  // c\nint y;  // trailing\n") == 2
