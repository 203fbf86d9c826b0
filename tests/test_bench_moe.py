"""bench/moe.py's routings without a GPU: each concentrates the first choices as BENCH.md says, from a seed."""
from __future__ import annotations

import math

import pytest
import torch

from bench import moe

SHAPE = moe.SHAPES["gpt-oss-120b"]   # E = 128, top-4


def _first_choice_share(routing: str, tokens: int = 4096) -> torch.Tensor:
    """Each expert's share of the tokens' first choices, largest first."""
    first = moe.router_logits(SHAPE, tokens, routing, seed=3).argmax(dim=1)
    return (torch.bincount(first, minlength=SHAPE.experts).float() / tokens).sort(descending=True).values


def test_hot_puts_one_expert_first_for_seventy_percent():
    assert _first_choice_share("hot")[0] >= 0.7 > _first_choice_share("skewed")[0] >= 0.5


def test_few_has_at_most_three_first_choices():
    share = _first_choice_share("few")
    assert (share > 0).sum() == moe.FEW and share[:moe.FEW].sum() == 1


def test_power_law_gives_most_first_choices_to_a_tenth_of_the_experts():
    share = _first_choice_share("power-law")
    top = math.ceil(SHAPE.experts / 10)
    assert share[:top].sum() > 0.5 and share[0] < 0.5   # concentrated, but not one hot expert
    assert _first_choice_share("uniform")[:top].sum() < 0.2


@pytest.mark.parametrize("routing", moe.ROUTINGS)
def test_every_routing_is_seeded_and_finite(routing):
    a, b = (moe.router_logits(SHAPE, 300, routing, seed=1) for _ in range(2))
    assert torch.equal(a, b) and a.isfinite().all() and a.shape == (300, SHAPE.experts)
    assert not torch.equal(a, moe.router_logits(SHAPE, 300, routing, seed=2))


def test_dry_run_lists_every_routing_with_its_roofline(capsys):
    assert moe.main(["--dry-run", "--shapes", "qwen3-30b-a3b", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert all(r in out for r in moe.ROUTINGS) and "roofline" in out


def test_fp8_dry_run_and_peer_quantisation():
    """`--fp8 --dry-run` lists the FP8 sizes; the peer's row-wise quantiser and its operands (weights re-quantised
    per output row from the blocks) round-trip within e4m3's error, on the CPU."""
    from bench import moe_fp8
    from meld.runtime.moe_reference import quantize_blocks

    assert moe.main(["--fp8", "--dry-run", "--shapes", "deepseek-v3-ep32"]) == 0
    assert moe_fp8.fp8_bytes(moe.SHAPES["deepseek-v3-ep32"]) == 3 * 7168 * 2048 + 4 * (32 * 56 + 56 * 16)
    w = torch.randn(2, 200, 136)
    q, s = moe_fp8.peer_weights(*quantize_blocks(w))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 200)
    assert ((q.float() * s[..., None] - w).norm() / w.norm()).item() < 0.05
