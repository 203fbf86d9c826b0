"""The GPU proxy's schedule (runtime/host/gpu_proxy.cpp, run without CUDA) delivers by the CPU emulation's
rules (transport.ProxySchedule): the same chunks and signal totals per channel, issue order kept when
ordered, and when unordered a shuffle in which no signal overtakes a put issued before it."""
import numpy as np
import pytest

from meld.distributed.transport import ADD, COMMAND, PUT, SIGNAL, ProxySchedule
from meld.runtime import host_helper

WINDOW = 1 << 16


def _records(seed: int, world: int = 3, n: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    recs = np.zeros(n, dtype=COMMAND)
    for i in range(n):
        dst = int(rng.integers(1, world))
        if rng.random() < 0.7:
            start = int(rng.integers(0, WINDOW - 5000))
            recs[i] = (PUT, 0, dst, 0, start, int(rng.integers(1, 5000)), 0, i + 1)
        else:
            recs[i] = (SIGNAL, 0, dst, 0, 8 * int(rng.integers(0, 4)), 0, int(rng.integers(1, 9)), i + 1)
    return recs


def _channels(ops):
    """Per destination, its operations as (kind, start, count, total) in the order given."""
    out: dict[int, list] = {}
    for op in ops:
        out.setdefault(int(op["dst"]), []).append((int(op["kind"]), int(op["start"]), int(op["count"]), int(op["value"])))
    return out


def _python_channels(recs, chunk):
    """The emulation's operations for the same records, with the running totals the GPU proxy writes."""
    sched = ProxySchedule(True, chunk)
    sched.add(0, recs)
    totals: dict = {}
    out: dict[int, list] = {}
    ops = []
    while landable := sched.landable():   # (ordered: each channel's oldest, until none is left)
        for op in landable:
            ops.append(op)
            sched.done(op)
    for op in ops:
        value = 0
        if op.kind == SIGNAL:
            value = totals[(op.dst, op.start)] = totals.get((op.dst, op.start), 0) + op.addend
        out.setdefault(op.dst, []).append((op.kind, op.start, op.count if op.kind == PUT else 0, value))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_ordered_proxy_issues_the_emulations_operations_in_issue_order(seed):
    recs = _records(seed)
    ops = host_helper.proxy_plan(recs, 3, WINDOW, ordered=True, chunk=1000)
    assert _channels(ops) == _python_channels(recs, 1000)
    assert (ops["stream"] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_unordered_proxy_shuffles_puts_but_no_signal_overtakes_its_puts(seed):
    recs = _records(seed)
    ops = host_helper.proxy_plan(recs, 3, WINDOW, ordered=False, chunk=1000, seed=seed)
    want = _python_channels(recs, 1000)
    got = _channels(ops)
    assert {d: sorted(v) for d, v in got.items()} == {d: sorted(v) for d, v in want.items()}, "lost or extra ops"
    for dst, issue in want.items():
        position = {}
        for i, op in enumerate(ops):
            if int(op["dst"]) == dst:
                position.setdefault((int(op["kind"]), int(op["start"]), int(op["count"]), int(op["value"])), i)
        for j, op in enumerate(issue):
            if op[0] == SIGNAL:   # after every put issued before it on its channel, on stream 0
                assert all(position[p] < position[op] for p in issue[:j] if p[0] == PUT), f"signal {op} overtook a put"
        signals = [op for op in got[dst] if op[0] == SIGNAL]
        assert signals == [op for op in issue if op[0] == SIGNAL], "signals out of their issue order"
    assert got != want, "unordered delivery kept issue order"
    assert set(ops["stream"][ops["kind"] == PUT]) == {0, 1}
    assert (ops["stream"][ops["kind"] == SIGNAL] == 0).all()


@pytest.mark.parametrize("bad", [dict(op=PUT, dst=1, start=WINDOW - 8, count=9), dict(op=SIGNAL, dst=3, start=0),
                                 dict(op=ADD, dst=1, start=0), dict(op=SIGNAL, dst=1, start=4)])
def test_proxy_rejects_records_it_cannot_land(bad):
    recs = np.zeros(1, dtype=COMMAND)
    for k, v in bad.items():
        recs[0][k] = v
    with pytest.raises(ValueError, match="rejects"):
        host_helper.proxy_plan(recs, 3, WINDOW, ordered=True, chunk=1000)


@pytest.mark.parametrize("chunk, capacity", [(0, 16), (1000, 1)])
def test_gpu_proxy_refuses_a_chunk_or_ring_it_cannot_use(chunk, capacity):
    """Checked before anything touches the GPU (a zero chunk would never finish a put)."""
    import types

    from meld.distributed.proxy import GpuProxy

    window = types.SimpleNamespace(local=None, rank=0, world=2, handle=None)
    with pytest.raises(ValueError, match="chunk_bytes and capacity"):
        GpuProxy(window, chunk_bytes=chunk, capacity=capacity)
