"""tools/fp8_mma_error.py on the CPU: the model behind RESULTS' "FP8 tensor cores ... ruled out" keeps saying so
(q in e4m3 above issue 41's 2% bar, bf16 q far below it), for GQA and MLA."""
import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("meld_tools_fp8_mma_error",
                                               Path(__file__).resolve().parent.parent / "tools" / "fp8_mma_error.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def test_e4m3_q_misses_the_bar_that_bf16_q_meets():
    torch.manual_seed(0)
    g = tool.gqa(256, draws=3)
    m = tool.mla(256, heads=32, draws=2)
    assert g["bf16 q"] < 5e-3 and g["e4m3 q"] > 2e-2, g
    assert m["bf16 q"] < 5e-3 and m["e4m3 q"] > 2e-2 and m["bf16 q"] < m["e4m3 P only"] < m["e4m3 q"], m
