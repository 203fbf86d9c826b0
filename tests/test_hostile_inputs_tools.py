"""Hostile inputs, round 4: the planning and tuning tools (Topology, the tuning database, the cost fit).
Every bad input is a ValueError that names the argument and the value; valid inputs behave as before."""
from __future__ import annotations

import json

import numpy as np
import pytest

from meld.scheduler import Topology


@pytest.mark.parametrize("make, match", [
    (lambda: Topology(10 ** 12), r"sm_count must be at most \d+, got 1000000000000"),
    (lambda: Topology(132, {1: 10 ** 9}), r"max_active_clusters\[1\] = 1000000000 clusters of 1 CTAs: more than the \d+ CTA slots"),
    (lambda: Topology(132, {1: 132, 2: 10 ** 12}), r"max_active_clusters\[2\] = 1000000000000"),
    (lambda: Topology(132, {1: 132, 2 ** 40: 1}), r"max_active_clusters\[1099511627776\]"),
])
def test_topology_refuses_grids_no_gpu_has(make, match):
    """Topology(sm_count=10**12) was accepted, and plan_decode then tried to allocate arrays per CTA slot
    (29.8 GiB for {1: 10**9})."""
    with pytest.raises(ValueError, match=match):
        make()


def test_topology_still_takes_the_tables_in_use():
    assert Topology.h200().cluster_mix(4) == [(4, 30), (2, 6)]
    assert Topology(70000).num_ctas == 70000
    assert Topology(24, {1: 48}).ctas_per_sm == 2
    assert Topology(1, {1: 1, 16: 80}).cluster_mix(16) == [(1, 1)]


@pytest.mark.parametrize("preferred", [3.5, "4", None, True, 0, 3])
def test_cluster_mix_names_a_preferred_size_that_is_no_power_of_two(preferred):
    """cluster_mix(3.5), ('4'), (None) raised TypeError from inside its bit test; True was taken as 1."""
    with pytest.raises(ValueError, match=r"preferred cluster size must be a power of two, got " + repr(preferred)):
        Topology.h200().cluster_mix(preferred)
