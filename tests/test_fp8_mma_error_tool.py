"""tools/fp8_mma_error.py on the CPU: the model behind RESULTS' FP8 tensor-core rows keeps saying what they say (q in
e4m3 above issue 41's 2% bar, bf16 q far below it; q, and P, as two e4m3 terms within 1.5x of bf16 q's error), for
GQA and MLA."""
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


def test_two_e4m3_terms_are_as_good_as_bf16():
    torch.manual_seed(0)
    g = tool.gqa(256, draws=3)
    m = tool.mla(256, heads=32, draws=2)
    assert g["e4m3 q hi+lo"] < 1.5 * g["bf16 q"] and g["e4m3 q hi+lo"] < g["e4m3 q"] / 5, g
    assert m["e4m3 q hi+lo"] < 1.5 * m["bf16 q"] and m["e4m3 q and P hi+lo"] < 1.5 * m["bf16 q"], m
    assert m["e4m3 q and P hi+lo"] < m["e4m3 P only"] / 3, m
    assert m["e4m3 q and P hi+lo"] <= m["e4m3 q and P hi+lo, 14-bit sums"] < 2e-2, m
