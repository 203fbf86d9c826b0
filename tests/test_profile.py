"""meld.runtime.profile on a hand-built profile buffer (CPU only)."""
import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from meld.runtime.profile import COLOURS, IDLE, KINDS, MARGIN_PX, STRIP_PX, CtaSpan, TaskRecord, Trace, render_png

PIECE, HBM, DSMEM, WAIT = range(4)
T = 10_000  # kernel start (a non-zero globaltimer origin)


def _raw() -> np.ndarray:
    """6 CTAs, cap 3, units_per_request 4, head_blocks 2. Busy ns per SM (span 2000):
    SM0: CTA0 [0,600) + [700,900) merged, CTA4 [400,800) co-resident: union [0,900) = 900;
    SM1: CTA1 wrote 5 records, only 3 kept: 400 + 500 + 500 = 1400;  SM2: 500 (the cluster-wait is idle);
    SM3: a CTA with no records;  CTA5 never ran (all-zero header). The kernel writes unit -1 for a wait."""
    ctas = [
        [[T, T + 1000, 0, 2], [T, T + 600, PIECE, 5], [T + 700, T + 900, HBM, 5]],
        [[T + 50, T + 2000, 1, 5], [T + 100, T + 500, PIECE, 1], [T + 500, T + 1000, PIECE, 2],
         [T + 1000, T + 1500, DSMEM, 2]],
        [[T, T + 1500, 2, 2], [T, T + 500, PIECE, 9], [T + 500, T + 1500, WAIT, -1]],
        [[T + 200, T + 400, 3, 0]],
        [[T + 100, T + 800, 0, 1], [T + 400, T + 800, PIECE, 6]],
        [],
    ]
    raw = np.zeros((len(ctas), 4, 4), np.int64)
    for c, rows in enumerate(ctas):
        raw[c, :len(rows)] = np.reshape(rows, (-1, 4))
    return raw


@pytest.fixture
def trace() -> Trace:
    return Trace.from_buffer(_raw(), units_per_request=4, head_blocks=2, cluster=[0, 0, 1, 1, 2, 3])


def test_from_buffer(trace):
    assert trace.overflowed == 2
    assert [s.cta for s in trace.cta_spans] == [0, 1, 2, 3, 4]
    assert trace.cta_spans[1] == CtaSpan(cta=1, sm=1, begin_ns=T + 50, end_ns=T + 2000, cluster=0, grid=0)
    assert len(trace.tasks) == 8
    assert trace.tasks[1] == TaskRecord(cta=0, sm=0, kind="merge-hbm", unit=5, start_ns=T + 700, end_ns=T + 900)
    assert [t.kind for t in trace.tasks if t.cta == 1] == ["piece", "piece", "merge-dsmem"]
    assert trace.start_ns == T and trace.span_ns == 2000
    assert trace.sm_busy() == {0: 900 / 2000, 1: 1400 / 2000, 2: 500 / 2000, 3: 0.0}
    s = trace.summary()
    assert "span 2.000 µs, 4 SMs, 5 CTAs" in s and "min 0.000 mean 0.350" in s
    assert "piece 5, merge-hbm 1, merge-dsmem 1, cluster-wait 1" in s and "OVERFLOW: 2 records" in s


def test_from_buffer_rejects_and_clips():
    raw = np.array([[[100, 200, 7, 1], [50, 300, PIECE, 0]]], np.int64)
    assert Trace.from_buffer(raw, 1, 1).sm_busy() == {7: 1.0}  # a task overhanging the span is clipped to it
    raw[0, 1, 2] = len(KINDS)
    with pytest.raises(ValueError, match=f"unknown record kind {len(KINDS)}"):
        Trace.from_buffer(raw, 1, 1)
    with pytest.raises(ValueError, match="one entry per CTA"):
        Trace.from_buffer(_raw(), 4, 2, cluster=[0])
    with pytest.raises(ValueError, match="multiple of head_blocks"):
        Trace.from_buffer(_raw(), 4, 3)


def test_chrome_events(trace):
    obj = json.loads(json.dumps(trace.to_chrome()))
    assert obj["displayTimeUnit"] == "ns"
    ev = obj["traceEvents"]
    meta = {(e["name"], e.get("tid")): e["args"] for e in ev if e["ph"] == "M"}
    assert meta[("process_name", None)] == {"name": "meld SMs"}
    assert meta[("thread_name", 3)] == {"name": "SM 3"}
    xs = [e for e in ev if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0}
    assert [e["name"] for e in xs] == ["piece r1 kv0 hb1", "merge-hbm r1 kv0 hb1", "piece r0 kv0 hb1",
                                       "piece r0 kv1 hb0", "merge-dsmem r0 kv1 hb0", "piece r2 kv0 hb1",
                                       "cluster-wait", "piece r1 kv1 hb0"]
    e = xs[4]
    assert (e["tid"], e["cat"], e["ts"], e["dur"]) == (1, "merge-dsmem", 1.0, 0.5)
    assert e["args"] == {"cta": 1, "unit": 2, "cluster": 0, "grid": 0, "t0_ns": 1000, "t1_ns": 1500}
    single = Trace.from_buffer(_raw(), units_per_request=4, head_blocks=1).to_chrome()
    assert [e["name"] for e in single["traceEvents"] if e["ph"] == "X"][0] == "piece r1 kv1"


def test_chrome_round_trip(trace, tmp_path):
    for back in (Trace.from_chrome(json.loads(json.dumps(trace.to_chrome()))),
                 Trace.from_chrome(trace.write_chrome(tmp_path / "t.json"))):
        assert back.tasks == trace.tasks and back.cta_spans == trace.cta_spans
        assert back.sm_busy() == trace.sm_busy()
        assert (back.overflowed, back.units_per_request, back.head_blocks) == (2, 4, 2)
    with pytest.raises(ValueError, match="not a meld trace"):
        Trace.from_chrome({"traceEvents": []})


def _read_png(path: Path) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(tag + body), tag
        chunks.append((tag, body))
        pos += 12 + n
    assert [t for t, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    w, h, depth, colour, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == h * (1 + 3 * w)
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)
    assert not rows[:, 0].any()  # filter type 0 on every row
    return rows[:, 1:].reshape(h, w, 3)


def test_render_png(trace, tmp_path):
    img = _read_png(render_png(trace, tmp_path / "t.png", width=MARGIN_PX + 200, row_height=6))
    assert img.shape == (4 * 6 + 2 + 4, MARGIN_PX + 200, 3)  # 10 ns per timeline pixel

    def px(sm: int, t_ns: int) -> tuple:
        return tuple(img[sm * 6 + 2, MARGIN_PX + t_ns // 10])

    assert px(1, 300) == COLOURS["piece"] and px(1, 1200) == COLOURS["merge-dsmem"]
    assert px(0, 650) == COLOURS["piece"] and px(0, 750) == COLOURS["merge-hbm"]  # merges paint over pieces
    assert px(2, 1000) == COLOURS["cluster-wait"]
    assert px(1, 1800) == IDLE and px(3, 300) == IDLE
    assert not img[5].any()  # the gap row under SM 0
    strip = img[[2, 8, 14, 20], 0, 0].astype(int)  # busy 0.45, 0.7, 0.25, 0
    assert strip[1] > strip[0] > strip[2] > strip[3]
    assert tuple(img[:24:6, STRIP_PX].reshape(-1)) == (0,) * 12  # black between strip and timeline
    bar = img[-1, MARGIN_PX:, 0].astype(int)
    assert bar[5] > bar[190] == strip[3]  # 2 of 4 SMs working early on, none at the end


def test_busy_table(trace):
    table = trace.busy_table(least=3).splitlines()
    assert table[0] == "SM busy: min 0.000  p10 0.075  median 0.350  max 0.700"
    assert re.findall(r"SM (\d+) (\d\.\d+)", table[1]) == [("3", "0.000"), ("2", "0.250"), ("0", "0.450")]
    assert Trace([], [], 0, 1, 1).busy_table() == "SM busy: no SMs"


def _xs(obj: dict) -> list[dict]:
    return [e for e in obj["traceEvents"] if e["ph"] == "X"]


@pytest.mark.parametrize("corrupt, message", [
    (lambda o: o.pop("meld"), "not a meld trace"),
    (lambda o: o.update(meld=[]), "not a meld trace"),
    (lambda o: o.pop("traceEvents"), "traceEvents is missing"),
    (lambda o: o["meld"].pop("ctas"), "meld.ctas is missing"),
    (lambda o: o["meld"].update(base_ns="0"), "meld.base_ns must be an integer, got '0'"),
    (lambda o: o["meld"].update(head_blocks=2.0), "meld.head_blocks must be an integer, got 2.0"),
    (lambda o: o["meld"].update(overflowed=True), "meld.overflowed must be an integer, got True"),
    (lambda o: o["meld"].update(units_per_request=3), "units_per_request=3 is not a positive multiple"),
    (lambda o: o["meld"]["ctas"].__setitem__(1, [1, 1, 0]), r"meld.ctas\[1\] must be \[cta, sm, "),
    (lambda o: o["meld"]["ctas"][1].__setitem__(3, None), r"meld.ctas\[1\]\[3\] must be an integer, got None"),
    (lambda o: o["traceEvents"].append(7), r"traceEvents\[\d+\] must be an object, got 7"),
    (lambda o: _xs(o)[2].pop("args"), r"traceEvents\[\d+\].args is missing"),
    (lambda o: _xs(o)[2]["args"].pop("t1_ns"), r"traceEvents\[\d+\].args.t1_ns is missing"),
    (lambda o: _xs(o)[2].update(tid="1"), r"traceEvents\[\d+\].tid must be an integer, got '1'"),
    (lambda o: _xs(o)[2].update(cat="merge"), r"unknown task kind 'merge' \(expected piece, merge-hbm, "),
    (lambda o: _xs(o)[2]["args"].update(cta=5), r"traceEvents\[\d+\].args.cta: CTA 5 is not in meld.ctas"),
])
def test_from_chrome_rejects(trace, corrupt, message):
    obj = json.loads(json.dumps(trace.to_chrome()))
    corrupt(obj)
    with pytest.raises(ValueError, match=message):
        Trace.from_chrome(obj)


def test_from_chrome_file_not_json(tmp_path):
    (tmp_path / "t.json").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="not JSON"):
        Trace.from_chrome(tmp_path / "t.json")
    (tmp_path / "t.json").write_text('{"meld": ')
    with pytest.raises(ValueError, match="not JSON"):
        Trace.from_chrome(tmp_path / "t.json")
    (tmp_path / "t.json").write_text("[]")
    with pytest.raises(ValueError, match="not a meld trace"):
        Trace.from_chrome(tmp_path / "t.json")


def test_profile_every_setting():
    from meld import config

    assert config.profile_every() == 1
    with config.scope(MELD_PROFILE_EVERY="100"):
        assert config.profile_every() == 100
    for bad in ("0", "-3", "often"):
        with config.scope(MELD_PROFILE_EVERY=bad):
            with pytest.raises(ValueError, match=f"MELD_PROFILE_EVERY={bad!r}"):
                config.profile_every()


def test_head_major_units_are_named_by_their_request_and_head_block(tmp_path):
    """A head-major schedule's (DecodeMLA's) unit u is head block u // requests of request u % requests."""
    t = Trace.from_buffer(_raw(), units_per_request=2, head_blocks=2, requests=4)
    assert t.label(next(x for x in t.tasks if x.unit == 5)) == "piece r1 kv0 hb1"   # (request order: r2)
    assert t.label(next(x for x in t.tasks if x.unit == 2)) == "piece r2 kv0 hb0"
    back = Trace.from_chrome(t.write_chrome(tmp_path / "t.json"))
    assert back.requests == 4 and back.label(back.tasks[1]) == t.label(t.tasks[1])
    assert Trace.from_chrome(Trace.from_buffer(_raw(), 2, 2).to_chrome()).requests == 0


def test_phase_sums_ride_beside_the_tasks(tmp_path):
    """A phases build's records ([-1, cycles, phase, warpgroup]) are sums, not tasks: Trace.phases holds them, the
    Chrome file keeps them, phase_table gives cycles a block (median over CTAs), phase_totals each CTA's sums and the
    slowest CTA's, and an unknown phase is named."""
    from meld.runtime.profile import PHASES, PhaseCycles

    ph = {name: i for i, name in enumerate(PHASES)}
    raw = np.zeros((3, 6, 4), np.int64)
    raw[0, :5] = [[T, T + 900, 0, 4], [T, T + 800, PIECE, 1], [-1, 2000, ph["softmax"], 0], [-1, 4, ph["blocks"], 0],
                  [-1, 600, ph["wait-p"], 1]]
    raw[1, :4] = [[T, T + 500, 1, 3], [-1, 3000, ph["softmax"], 0], [-1, 6, ph["blocks"], 0], [-1, 120, ph["wait-kv"], 0]]
    raw[2, :1] = [[T, T + 300, 2, 0]]   # a CTA with no work records no sums
    tr = Trace.from_buffer(raw, 1, 1)
    assert [t.kind for t in tr.tasks] == ["piece"]
    assert tr.phases == [PhaseCycles(0, 0, "softmax", 2000), PhaseCycles(0, 0, "blocks", 4), PhaseCycles(0, 1, "wait-p", 600),
                         PhaseCycles(1, 0, "softmax", 3000), PhaseCycles(1, 0, "blocks", 6), PhaseCycles(1, 0, "wait-kv", 120)]
    # warpgroup 0: softmax 2000/4 = 500 and 3000/6 = 500 a block; wait-kv 0 and 20 (median 10); warpgroup 1 ran no blocks
    assert tr.phase_table() == ("warpgroup 0: 2 CTAs, median blocks 5; cycles a block: wait-kv 10, softmax 500; all 510")
    # per CTA: softmax 2000 and 3000, wait-kv 0 and 120; CTA 1 (3120) is the slowest
    assert tr.phase_totals() == ("warpgroup 0: cycles a CTA (min/median/max over 2): wait-kv 0/60/120, softmax "
                                 "2000/2500/3000; all 2000/2560/3120\n  slowest CTA 1 (6 blocks): wait-kv 120, "
                                 "softmax 3000; all 3120")
    back = Trace.from_chrome(tr.write_chrome(tmp_path / "p.json"))
    assert back.phases == tr.phases and back.tasks == tr.tasks
    assert Trace.from_buffer(_raw(), 4, 2).phase_table() == Trace.from_buffer(_raw(), 4, 2).phase_totals() == "no phase stamps"
    raw[1, 1, 2] = len(PHASES)
    with pytest.raises(ValueError, match=f"unknown phase {len(PHASES)}"):
        Trace.from_buffer(raw, 1, 1)
