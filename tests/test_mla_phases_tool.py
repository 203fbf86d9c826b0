"""tools/mla_phases.py without a GPU: every build it names is one bench/mla.py's build_meld takes, with the stamps;
its configurations are valid MLA builds; and without a GPU it says so and stops."""
import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import mla_phases  # noqa: E402

from bench.mla import build_meld  # noqa: E402


@pytest.mark.parametrize("build", list(mla_phases.BUILDS))
def test_builds_are_build_melds(build):
    from meld.codegen.mla_kernel import MlaKernelConfig

    opts = mla_phases.BUILDS[build]
    inspect.signature(build_meld).bind(None, **opts, phases=True)   # (raises TypeError on a name it lacks)
    cfg = (MlaKernelConfig.for_cache("float8_e4m3fn", num_stages=opts.get("num_stages", 0), profile=True, phases=True)
           if opts.get("fp8") else MlaKernelConfig(schedule=opts.get("schedule", "split"), profile=True, phases=True))
    assert cfg.phases and cfg.phase_records > 0


def test_without_a_gpu_it_stops(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mla_phases.main(["--batches", "64"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
