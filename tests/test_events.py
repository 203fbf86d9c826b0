"""Every count a task makes for another goes through the event API (templates/events.cuh): no template
adds to, spins on or stores a counter's zero by hand. The allow-list names the atomics that are not
events (tickets, list slots, claims) and why."""
import re
from importlib import resources

TEMPLATES = resources.files("meld.codegen") / "templates"

# The primitives of arrivals and waits: only events.cuh may use them.
COUNTING = re.compile(r"\b(atomicAdd|atomicSub|atomicInc|atomicDec|ld_acquire|load_acquire_sys|fetch_add_sys|"
                      r"dsmem_atomic_add|signal_add|signal_wait)\s*\(|\b(ld\.acquire|red\.|atom\.|st\.release)")
# A counter's zero stored by hand instead of event_reset.
RESET = re.compile(r"\b(counters?|xexit|rb_done|tok_cnt|arrive|count)\b(\s*\[[^]]*\]|\s*\+[^=;]*)?\s*=\s*0(u|ull)?\s*;")

# (template, text of the line) -> why it is not an event.
ALLOWED = {
    ("common.cuh", "const int i = shared != nullptr ? atomicAdd(shared, 1) : n++;"):
        "the profiler's record slots: a list index",
    ("common.cuh", "if (atomicAdd(clock + 1, 1u) == (unsigned)ctas - 1u) {"):
        "the profiler's sampling clock (common.cuh comes before events.cuh): counts launches, fires no task",
    ("common.cuh", "atomicAdd(clock, 1u);"): "the profiler's sampling clock: the launch number",
    ("common.cuh", "const unsigned long long slot = atomicAdd(tail, 1ull);"): "the proxy ring's slot ticket",
    ("moe.cuh", "const int ticket = atomicAdd(p.counters, 1);"): "the MoE task ticket (work handed out, not counted)",
    ("moe.cuh", "p.counters[0] = 0;"): "the MoE task ticket, rewound",
    ("moe.cuh", "combine_list[1 + atomicAdd(combine_list, 1)] = t;"): "a slot in the CTA's list of fired combines",
    ("grouped_attention.cuh", "fired[atomicAdd(&n_fired, 1)] = e;"): "a slot in the CTA's list of fired events",
}


def _code_lines(name: str):
    for n, line in enumerate((TEMPLATES / name).read_text().splitlines(), 1):
        code = line.split("//", 1)[0].strip()
        if code:
            yield n, code


def test_templates_count_only_through_events_cuh():
    names = sorted(p.name for p in TEMPLATES.iterdir() if p.name.endswith((".cuh", ".h")) and p.name != "events.cuh")
    assert "decode_attention.cuh" in names and "moe.cuh" in names
    bad, used = [], set()
    for name in names:
        for n, code in _code_lines(name):
            if COUNTING.search(code) or RESET.search(code):
                if (name, code) in ALLOWED:
                    used.add((name, code))
                else:
                    bad.append(f"{name}:{n}: {code}")
    assert not bad, "counting outside the event API (templates/events.cuh):\n" + "\n".join(bad)
    assert used == set(ALLOWED), f"stale allow-list entries: {sorted(set(ALLOWED) - used)}"


def test_every_counting_family_uses_the_api():
    """Each family's counting is the API's: a template that fires a combine by a count calls it."""
    uses = {"decode_attention.cuh": ("event_arrive(", "event_arrive_cluster(", "event_reset("),
            "mla_decode.cuh": ("event_arrive(", "event_wait(", "event_reset("),
            "grouped_attention.cuh": ("event_arrive(", "event_reset("),
            "moe.cuh": ("event_arrive(", "event_wait(", "event_reset("),
            "tp_linear.cuh": ("event_arrive_sys(", "event_reset(", "event_wait_sys(", "event_reached_sys("),
            "decode_xrank.cuh": ("event_arrive_sys(", "event_arrive(", "event_wait_sys("),
            "xrank.cuh": ("event_publish_sys(", "event_wait_sys(", "event_signal_sys(", "event_take_sys(")}
    for name, calls in uses.items():
        text = (TEMPLATES / name).read_text()
        for call in calls:
            assert call in text, f"{name} does not call {call}"
