"""Per-SM timeline of a profiled launch: summary, busy table and PNG from a trace written by
`meld.runtime.profile.Trace.write_chrome`. The same JSON opens in Perfetto (ui.perfetto.dev) or chrome://tracing.

    python bench/timeline.py TRACE.json [OUT.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench` and `meld` import as-is
from meld.runtime.profile import Trace, render_png  # noqa: E402


def busy_table(busy: dict[int, float], least: int = 5) -> str:
    """Where the idle time is: the low end of the per-SM busy distribution and the SMs that make it."""
    if not busy:
        return "SM busy: no SMs"
    v = np.fromiter(busy.values(), dtype=np.float64)
    worst = sorted(busy, key=lambda sm: (busy[sm], sm))[:least]
    return (f"SM busy: min {v.min():.3f}  p10 {np.percentile(v, 10):.3f}  median {np.median(v):.3f}  "
            f"max {v.max():.3f}\nleast busy: " + ", ".join(f"SM {sm} {busy[sm]:.3f}" for sm in worst))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="Chrome trace JSON from Trace.write_chrome")
    ap.add_argument("out", type=Path, nargs="?", help="PNG to write (default: TRACE with a .png suffix)")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--row-height", type=int, default=6)
    args = ap.parse_args(argv)
    trace = Trace.from_chrome(args.trace)
    print(trace.summary())
    print(busy_table(trace.sm_busy()))
    out = render_png(trace, args.out or args.trace.with_suffix(".png"), args.width, args.row_height)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
