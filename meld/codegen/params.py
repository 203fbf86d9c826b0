"""Kernel parameter structs defined once in Python: the C declaration and the host packing both come
from the same field list, so they cannot drift apart."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

TensorMap = ctypes.c_uint64 * 16   # a CUtensorMap: 128 opaque bytes, 64-byte aligned in the struct
_CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float,
           "tmap": TensorMap}
_C_SCALARS = {"i64": "long long", "i32": "int", "f32": "float"}
_TMAP_ALIGN = 64


@dataclass(frozen=True)
class Field:
    name: str
    kind: str          # ptr | i64 | i32 | f32 | tmap (a TMA tensor map)
    c_pointer: str = ""  # C pointer type for kind == "ptr", e.g. "const u16*"

    @property
    def c_decl(self) -> str:
        if self.kind == "tmap":
            return f"alignas({_TMAP_ALIGN}) unsigned long long {self.name}[16];"
        return f"{self.c_pointer if self.kind == 'ptr' else _C_SCALARS[self.kind]} {self.name};"


class ParamStruct:
    """A `__grid_constant__` kernel parameter struct."""

    def __init__(self, name: str, fields: list[Field]):
        self.name = name
        self.fields = fields
        self._names = frozenset(f.name for f in fields)
        # ctypes cannot align a member to 64 bytes: pad explicitly where C++'s alignas() puts the gaps.
        layout, offset = [], 0
        for f in fields:
            t = _CTYPES[f.kind]
            align = _TMAP_ALIGN if f.kind == "tmap" else ctypes.alignment(t)
            if offset % align:
                gap = align - offset % align
                layout.append((f"_pad_{f.name}", ctypes.c_uint8 * gap))
                offset += gap
            layout.append((f.name, t))
            offset += ctypes.sizeof(t)
        if any(f.kind == "tmap" for f in fields) and offset % _TMAP_ALIGN:
            layout.append(("_pad_end", ctypes.c_uint8 * (_TMAP_ALIGN - offset % _TMAP_ALIGN)))
        self.ctype = type(name, (ctypes.Structure,), {"_fields_": layout})

    def c_source(self) -> str:
        """The C declaration, with static_asserts that its layout is the one `pack` produces."""
        body = "\n".join(f"  {f.c_decl}" for f in self.fields)
        asserts = "\n".join(
            f'static_assert(__builtin_offsetof({self.name}, {f.name}) == {getattr(self.ctype, f.name).offset}, '
            f'"{self.name}.{f.name}: host and device layouts differ");' for f in self.fields)
        size = f'static_assert(sizeof({self.name}) == {ctypes.sizeof(self.ctype)}, "{self.name}: size differs");'
        # NVRTC lacks __builtin_offsetof; nvcc (the CPU tests) checks the layout for both.
        return f"struct {self.name} {{\n{body}\n}};\n#ifndef __CUDACC_RTC__\n{asserts}\n{size}\n#endif\n"

    @property
    def size(self) -> int:
        return ctypes.sizeof(self.ctype)

    def pack(self, **values: int | float) -> ctypes.Structure:
        if values.keys() != self._names:   # (one set comparison: planners pack a struct per plan())
            missing, extra = self._names - values.keys(), values.keys() - self._names
            raise TypeError(f"{self.name}: missing {sorted(missing)}, unknown {sorted(extra)}")
        return self.ctype(**values)


# What every meld kernel's parameter struct carries, declared once (meld.ops.base.Operator._header fills
# it): where a wait that gives up reports (templates/common.cuh, WaitSite), the profiler's buffers
# (Profiler) and the grid's place in a persistent launch (meld/runtime/driver.py, PersistentLaunch). Each
# struct names them where its kernel has long read them (moving a field changes the generated code:
# tools/same_code.py); those a struct lacks come last.
KERNEL_HEADER = {f.name: f for f in [
    Field("watchdog", "ptr", "WatchdogRecord*"),   # pinned host memory: meld/runtime/watchdog.py
    Field("watchdog_claim", "ptr", "int*"),        # device word: the first CTA to give up claims it
    Field("prof", "ptr", "long long*"),            # MELD_PROFILE builds: [grid][1 + prof_cap][4] records
    Field("prof_clock", "ptr", "unsigned*"),       # sampled profiles: [launch, exits] (common.cuh: Profiler)
    Field("watchdog_kernel", "i32"),               # this kernel's id in the watchdog's registry
    Field("prof_cap", "i32"),
    Field("prof_every", "i32"),                    # a profiled kernel records one launch in this many
    Field("num_ctas", "i32"),                      # persistent launches: the CTAs of every grid of the mix,
    Field("cta_offset", "i32"),                    # this grid's first among them,
    Field("wait_inputs", "i32"),                   # 1: the first grid of an overlapped launch (its entry waits)
]}


def header(*names: str) -> list[Field]:
    return [KERNEL_HEADER[n] for n in names]


def _with_header(name: str, fields: list[Field]) -> ParamStruct:
    """A kernel's struct: its fields, then the KERNEL_HEADER fields it does not place itself."""
    placed = [f for f in fields if f.name in KERNEL_HEADER]
    if any(f is not KERNEL_HEADER[f.name] for f in placed) or len(placed) != len({f.name for f in placed}):
        raise ValueError(f"{name}: a KERNEL_HEADER field declared again or twice: use header()")
    return ParamStruct(name, [*fields, *(f for n, f in KERNEL_HEADER.items() if n not in {f.name for f in placed})])


# The proxy transport's command ring as a kernel addresses it (meld/distributed/proxy.py; templates/common.cuh,
# proxy_push): the pinned host records, the device's claim counter, the proxy's head. Its capacity is an
# i32 field "xring_cap" among each struct's scalars.
PROXY_RING = [
    Field("xring", "ptr", "meld::ProxyCommand*"),
    Field("xring_tail", "ptr", "unsigned long long*"),
    Field("xring_head", "ptr", "const unsigned long long*"),
]

# What every paged decode kernel reads first: its outputs and the split-KV work tables the decode planner
# writes (meld/ops/paged_decode.py).
PAGED_OUTPUTS_AND_TABLES = [
    Field("out", "ptr", "u16*"),
    Field("lse", "ptr", "float*"),
    Field("kv_indices", "ptr", "const int*"),
    Field("kv_len", "ptr", "const int*"),
    Field("page_base", "ptr", "const int*"),
    Field("cta_table", "ptr", "const int*"),
]

# The decode kernel (templates/decode_attention.cuh): what a single-GPU build reads.
DECODE_FIELDS = [
    Field("q", "ptr", "const u16*"),
    Field("k", "ptr", "const u16*"),   # the K and V caches (one cache's halves, or two tensors)
    Field("v", "ptr", "const u16*"),
    *PAGED_OUTPUTS_AND_TABLES,
    Field("slot_base", "ptr", "const int*"),   # batch-invariant kernels: each request's first partial slot
    Field("part_o", "ptr", "float*"),
    Field("part_lse", "ptr", "float*"),
    Field("counters", "ptr", "unsigned*"),
    *header("prof"),
    *header("prof_clock"),
    *header("watchdog"),
    *header("watchdog_claim"),
    Field("k_map", "tmap"),    # the K and V caches as TMA tensor maps (MELD_TMA builds; zero otherwise)
    Field("v_map", "tmap"),
    Field("q_stride_b", "i64"),
    Field("q_stride_h", "i64"),
    Field("kv_page_stride", "i32"),   # the K and V caches' (shared) strides in rows of head_dim elements:
    Field("kv_slot_stride", "i32"),   # a page, a token of a page, a kv head
    Field("kv_head_stride", "i32"),
    Field("kv_hnd", "i32"),           # 1: HND ([pages, Hkv, page_size, D]), for the TMA box coordinates
    Field("num_qo_heads", "i32"),
    Field("num_kv_heads", "i32"),
    Field("group_size", "i32"),
    Field("head_blocks", "i32"),
    Field("units_per_request", "i32"),
    Field("page_size", "i32"),
    *header("num_ctas"),
    *header("cta_offset"),
    *header("prof_cap"),
    *header("prof_every"),
    Field("chunk", "i32"),            # batch-invariant kernels: tokens per chunk (meld/ir/schedule.py)
    *header("watchdog_kernel"),
    *header("wait_inputs"),
    Field("sm_scale_log2", "f32"),    # sm_scale * log2(e), times k_scale for an FP8 cache (set by run())
]
# FP8 caches: V's scale, on the output (MELD_KV_FP8 builds read it). Last in each struct, where it moves no
# other field (tools/same_code.py: the 16-bit builds' code stays the same).
V_SCALE = Field("v_scale", "f32")
# Ragged multi-token builds (MELD_RAGGED_Q): each request's q and output rows, FlashInfer's qo_indptr [B + 1] as
# plan() copied it. After V_SCALE, for the same reason; not in the sequence-parallel struct (no multi-token builds).
# 1 where every CTA of each grid of the mix is resident at once (decode_attention.cuh: merge_slices waits on no CTA
# that is not); log2(page_size) for a power of two, else -1 (a tile's page is a shift, not a division). Last, where
# they move no other field.
LAST_DECODE_FIELDS = [Field("grid_resident", "i32"), Field("page_shift", "i32")]
DECODE_PARAMS = _with_header("DecodeParams", [*DECODE_FIELDS, V_SCALE, Field("qo_indptr", "ptr", "const int*"),
                                              *LAST_DECODE_FIELDS])

# Sequence-parallel builds (MELD_XRANK) read the same struct with the cross-rank edge's fields after it
# (templates/decode_xrank.cuh).
SEQ_PARALLEL_DECODE_PARAMS = _with_header("DecodeParams", [*DECODE_FIELDS,
    # meld/distributed/seq_parallel.py: each local request's (batch request, part, parts, owner rank); every
    # rank's symmetric window as this rank addresses it; the launch's exit counter, the landings it waits
    # for and the batch's split requests; the places in a window, in bytes.
    # Proxy builds also: the split requests (batch request, parts), per source rank the units expected
    # from it and those taken so far, and the command ring (pinned host records, the device's claim
    # counter, the proxy's head).
    Field("xreq", "ptr", "const int4*"),
    Field("xpeers", "ptr", "char* const*"),
    Field("xexit", "ptr", "unsigned*"),
    Field("xsplit", "ptr", "const int2*"),
    Field("xsrc", "ptr", "unsigned long long*"),
    *PROXY_RING,
    Field("x_out_off", "i64"),
    Field("x_lse_off", "i64"),
    Field("x_po_off", "i64"),
    Field("x_plse_off", "i64"),
    Field("x_count_off", "i64"),
    Field("x_landed_off", "i64"),
    Field("x_started_off", "i64"),
    Field("x_rank", "i32"),
    Field("x_world", "i32"),
    Field("xring_cap", "i32"),
    V_SCALE,
    *LAST_DECODE_FIELDS,
])

# MLA decode attention (templates/mla_decode.cuh): the latent cache as two TMA maps, one partial slot per
# split piece of [64 heads][head_dim_ckv] floats; the split-KV tables are the decode planner's.
MLA_PARAMS = _with_header("MlaParams", [
    Field("q_nope", "ptr", "const u16*"),
    Field("q_pe", "ptr", "const u16*"),
    *PAGED_OUTPUTS_AND_TABLES,
    Field("part_o", "ptr", "float*"),
    Field("part_lse", "ptr", "float*"),
    Field("counters", "ptr", "unsigned*"),
    *header("prof"),
    *header("prof_clock"),
    *header("watchdog"),
    *header("watchdog_claim"),
    Field("ckv_map", "tmap"),   # [rows = pages x page_size][head_dim_ckv], boxes of box_rows x 64 channels
    Field("kpe_map", "tmap"),   # [rows][head_dim_kpe], the same boxes
    Field("qn_map", "tmap"),    # q_nope [rows][num_heads][head_dim_ckv] in boxes of 64 heads x 64 channels, encoded
    Field("qp_map", "tmap"),    # per strides, its address set on the device (q_pe: the same); see q_maps
    Field("q_maps", "ptr", "char*"),   # 256 bytes a CTA: its copies of the two with the call's addresses
    Field("qn_stride_b", "i64"),   # q_nope / q_pe strides in elements (the last dim contiguous)
    Field("qn_stride_h", "i64"),
    Field("qp_stride_b", "i64"),
    Field("qp_stride_h", "i64"),
    Field("num_heads", "i32"),
    Field("units_per_request", "i32"),   # 64-head blocks per request
    Field("page_size", "i32"),
    Field("box_rows", "i32"),      # token rows one TMA box holds: min(64, page_size)
    *header("num_ctas"),
    *header("cta_offset"),
    *header("wait_inputs"),
    *header("prof_cap"),
    *header("prof_every"),
    *header("watchdog_kernel"),
    Field("sm_scale_log2", "f32"),   # sm_scale x log2(e) (FP8 caches: x kv_scale)
    Field("v_scale", "f32"),         # FP8 caches: kv_scale, the output's (mla_decode.cuh, MLA_KV_FP8)
])

PLAN_PARAMS = ParamStruct("PlanParams", [
    Field("kv_indptr", "ptr", "const int*"),
    Field("last_page_len", "ptr", "const int*"),
    Field("kv_len", "ptr", "int*"),
    Field("page_base", "ptr", "int*"),
    Field("cta_table", "ptr", "int*"),
    Field("line", "ptr", "long long*"),
    Field("src_indices", "ptr", "const int*"),
    Field("dst_indices", "ptr", "int*"),
    Field("done_flag", "ptr", "int*"),
    Field("arrive", "ptr", "int*"),
    Field("cluster_rows", "ptr", "const int*"),   # [2][num_ctas]: each row's cluster (first, end); null: none
    Field("slot_base", "ptr", "int*"),            # batch-invariant plans: each request's first partial slot
    Field("batch", "i32"),
    Field("page_size", "i32"),
    Field("units_per_request", "i32"),
    Field("num_ctas", "i32"),
    Field("item_overhead", "i32"),
    Field("min_split", "i32"),
    Field("tile", "i32"),
    Field("round", "i32"),
    Field("min_cta_tokens", "i32"),
    Field("cluster_snap", "i32"),
    Field("chunk", "i32"),                        # > 0: a batch-invariant plan on chunks of this many tokens
    Field("done_seq", "i32"),
    Field("token_requests", "i32"),               # planners built with PLAN_TOKEN_REQUESTS: requests per request
    Field("head_major", "i32"),                   # 1: the line holds units head block by head block (decode_plan.h)
])

# The grouped-attention planner (templates/split_reduce_plan.h): the work items' groups, producer after
# producer, and the tables it writes (meld/ir/work_table.py SPLIT_TASK and EVENT, the parts' slot list).
SPLIT_PLAN_PARAMS = ParamStruct("SplitPlanParams", [
    Field("group_producer", "ptr", "const int*"),   # [num_groups] its producer (the graph's order)
    Field("group_index", "ptr", "const int*"),      # [num_groups] its index among the producer's groups
    Field("group_q0", "ptr", "const int*"),         # [num_groups] its first request
    Field("group_requests", "ptr", "const int*"),   # [num_groups] its requests
    Field("group_tokens", "ptr", "const int*"),     # [num_groups] its KV tokens
    Field("group_pages", "ptr", "const int*"),      # [num_groups] its page list's first entry in kv_indices
    Field("tasks", "ptr", "int*"),                  # SPLIT_TASK, field-major, task_capacity entries
    Field("events", "ptr", "int*"),                 # EVENT, field-major, batch * num_kv_heads entries
    Field("part_slot", "ptr", "int*"),              # slot_capacity entries
    Field("cursor", "ptr", "int*"),                 # [batch * num_kv_heads + num_ctas] scratch
    Field("out", "ptr", "int*"),                    # [2]: the tasks and slots written (-1: a capacity too small)
    Field("num_groups", "i32"),
    Field("batch", "i32"),
    Field("num_kv_heads", "i32"),
    Field("group_size", "i32"),
    Field("num_ctas", "i32"),
    Field("min_piece", "i32"),
    Field("cut", "i32"),
    Field("rows_per_tile", "i32"),
    Field("slice_rows", "i32"),                     # query rows a task holds at most (whole requests; at least one)
    Field("item_overhead", "i32"),                  # a work item's fixed cost, in KV tokens
    Field("merge_overhead", "i32"),                 # and per request of the item (the merges it may do)
    Field("stagger", "i32"),                        # 1: the second half's CTAs list their tasks last to first
    Field("task_capacity", "i32"),
    Field("slot_capacity", "i32"),
])

# Grouped (shared-prefix, cascade) decode attention (templates/grouped_attention.cuh): the split-reduce task
# and event tables (meld.ir.work_table SPLIT_TASK, EVENT) and the page lists the task rows point into.
GROUPED_PARAMS = _with_header("GroupedParams", [
    Field("q", "ptr", "const u16*"),
    Field("kv", "ptr", "const u16*"),               # NHD [pages, 2, page_size, num_kv_heads, head_dim]
    Field("out", "ptr", "u16*"),
    Field("lse", "ptr", "float*"),                  # null: not asked for
    Field("plan_info", "ptr", "const int*"),        # [batch]: written by plan(), so a captured launch sees it
    Field("tasks", "ptr", "const int*"),            # SPLIT_TASK, field-major over task_capacity entries, CTA after CTA
    Field("events", "ptr", "const int*"),           # EVENT, field-major over event_capacity (num_kv_heads x batch used)
    Field("part_slot", "ptr", "const int*"),        # each event's parts' first row slots, in merge order
    Field("cta_first", "ptr", "const int*"),        # [grid + 1]: each CTA's first task
    Field("kv_indices", "ptr", "const int*"),       # every producer's page lists, one after another (SPLIT_TASK pages)
    Field("counters", "ptr", "unsigned*"),          # per event: parts arrived (zero between launches)
    Field("part_o", "ptr", "float*"),               # [slots][head_dim]: each row's normalised partial
    Field("part_lse", "ptr", "float*"),             # [slots]: its log2-sum-exp
    Field("task_capacity", "i32"),
    Field("event_capacity", "i32"),
    Field("num_qo_heads", "i32"),
    Field("num_kv_heads", "i32"),
    Field("group_size", "i32"),
    Field("page_size", "i32"),
    Field("sm_scale_log2", "f32"),
])

# What a kernel writes before it traps when a wait gives up (meld/runtime/watchdog.py reads it).
WATCHDOG_RECORD = ParamStruct("WatchdogRecord", [
    Field("tripped", "i32"),   # written last: 1 once the rest is valid
    Field("kernel", "i32"),    # the kernel's id in the registry (DecodeParams.watchdog_kernel)
    Field("site", "i32"),      # what it waited for (watchdog.SITES)
    Field("cta", "i32"),
    Field("sm", "i32"),
    Field("warp", "i32"),
    Field("unit", "i32"),      # the task it was working on (-1: none)
    Field("detail", "i32"),    # site-specific: the ring stage
    Field("parity", "i32"),
    Field("waited_ns", "i64"),
])

# The fused MoE kernels (templates/moe.cuh) share one parameter struct: routing, planning, dispatch and
# the persistent GEMM kernel read the same buffers.
MOE_PARAMS = _with_header("MoeParams", [
    Field("x", "ptr", "const u16*"),
    Field("logits", "ptr", "const void*"),       # router logits, float32 or bf16 (logits_bf16)
    Field("topk_ids_in", "ptr", "const int*"),   # precomputed routing (null: route from logits)
    Field("topk_w_in", "ptr", "const float*"),
    Field("topk_ids", "ptr", "int*"),
    Field("topk_w", "ptr", "float*"),
    Field("rank", "ptr", "int*"),                # each pair's rank among its block's tokens of its expert
    Field("blk_cnt", "ptr", "int*"),             # [blocks][E]: counts, then offsets once planned
    Field("expert_off", "ptr", "int*"),          # [E + 1]: first row of each expert
    Field("rb", "ptr", "int*"),                  # [row blocks][4]: expert, first row, rows, 0
    Field("tasks", "ptr", "int*"),               # the tiles' MOE_TILE rows in ticket order, field-major
    Field("counters", "ptr", "int*"),            # [0]: next ticket, [1]: tickets, [2]: routing CTAs done
    Field("rb_done", "ptr", "int*"),             # gemm1 tiles finished per row block
    Field("tok_cnt", "ptr", "int*"),             # [T][n2]: rows of a token per column block not yet in y
    Field("tok_need", "ptr", "int*"),            # valid pairs per token (| POISON: one was invalid)
    Field("pair_pos", "ptr", "int*"),            # [T][k]: the row of each (token, choice); -1: invalid
    Field("row_token", "ptr", "int*"),           # the token of each row
    Field("xs", "ptr", "u16*"),                  # x rows in expert order
    Field("act", "ptr", "u16*"),                 # SiLU(gate) * up, per row
    Field("y", "ptr", "u16*"),                   # down projection, per row
    Field("out", "ptr", "u16*"),
    Field("error", "ptr", "int*"),               # set when a precomputed id was out of range or repeated
    *header("prof"),
    *header("prof_clock"),
    *header("watchdog"),
    *header("watchdog_claim"),
    Field("w13_packed", "ptr", "const u16*"),    # MELD_PACKED: meld/ops/moe_weights.py's layouts
    Field("w2_packed", "ptr", "const u16*"),
    Field("w13_map", "tmap"),                    # [E * 2I, H]
    Field("w2_map", "tmap"),                     # [E * H, I]
    Field("xs_map", "tmap"),                     # [rows, H], boxes of a row block's rows
    Field("act_map", "tmap"),                    # [rows, I], same
    Field("xs_part_map", "tmap"),                # the same with boxes of T_ROWS rows (tiles narrower than a block)
    Field("act_part_map", "tmap"),
    Field("x_stride", "i64"),
    Field("out_stride", "i64"),
    Field("logits_stride", "i64"),
    Field("num_tokens", "i32"),
    Field("hidden", "i32"),
    Field("inter", "i32"),
    Field("num_experts", "i32"),
    Field("expert_base", "i32"),                 # precomputed ids are global: this layer's expert e is id e + base
    Field("top_k", "i32"),
    Field("renormalize", "i32"),
    Field("logits_bf16", "i32"),
    Field("n1", "i32"),                          # gemm1 column blocks: ceil(I / 128)
    Field("n2", "i32"),                          # gemm2 column blocks: ceil(H / 256)
    Field("lag", "i32"),                         # tickets between an expert's last gemm1 and first gemm2 tile
    Field("route_dispatches", "i32"),            # 1: the (lone) routing CTA copies the rows, no dispatch launch
    Field("x_direct", "i32"),                    # 1: one token, H whole stages: gemm1 tiles read x's row, no copy
    *header("prof_cap"),
    *header("prof_every"),
    *header("watchdog_kernel"),
    # MELD_FP8 (weight_dtype "e4m3"): xs and act hold e4m3 bytes, with their float32 scales per token per 128
    # channels, [channel groups][scale_ld] (a K block's scales of consecutive rows are contiguous)
    Field("xs_scale", "ptr", "float*"),
    Field("act_scale", "ptr", "float*"),
    Field("w13_scale", "ptr", "const float*"),   # [E][ceil(2I / 128)][ceil(H / 128)]
    Field("w2_scale", "ptr", "const float*"),    # [E][ceil(H / 128)][ceil(I / 128)]
    Field("scale_ld", "i32"),                    # a scale row: the rows of xs and act, to a multiple of 4
    Field("task_capacity", "i32"),               # rows of the tasks table (a field's stride)
    *header("num_ctas"),
    *header("cta_offset"),
    *header("wait_inputs"),
    Field("xs_scale_map", "tmap"),               # xs_scale and act_scale [groups][scale_ld], boxes of a row block's run
    Field("act_scale_map", "tmap"),              # of one group's scales (unswizzled)
])

# The row-parallel linear with its all-reduce fused per tile (templates/tp_linear.cuh, meld/distributed/tp_linear.py).
TP_PARAMS = _with_header("TpParams", [
    Field("w_map", "tmap"),                      # this rank's weight [N, K] (64-row boxes)
    Field("x_map", "tmap"),                      # this rank's input [M, K] (BLOCK_TOKENS-row boxes)
    Field("x_tail_map", "tmap"),                 # the same, M % BLOCK_TOKENS-row boxes (the last token block's)
    Field("xpeers", "ptr", "char* const*"),      # every rank's symmetric window, as this rank addresses it
    Field("xexit", "ptr", "unsigned*"),          # the launch's exit counter
    Field("xlaunch", "ptr", "unsigned long long*"),   # launches this rank has finished
    Field("tasks", "ptr", "const int*"),         # the call's TP_PIECE rows (TpSchedule.tasks), `tiles` of them
    *header("watchdog"),
    *header("watchdog_claim"),
    Field("x_out_off", "i64"),                   # places in a window, in bytes: the output [M, N] bf16,
    Field("x_part_off", "i64"),                  # the float partials [tiles][world][tile], one counter per
    Field("x_count_off", "i64"),                 # tile, the landing counter and the launches started
    Field("x_landed_off", "i64"),
    Field("x_started_off", "i64"),
    Field("x_signal_off", "i64"),                # every-rank merges: u64 stamps [world][x_grid_cap] (launch numbers)
    Field("x_ll_off", "i64"),                    # direct merges: tagged words [2][world][x_ll_cap][a tile's]
    *header("prof"),
    *PROXY_RING,
    Field("m", "i32"),
    Field("n", "i32"),
    Field("k", "i32"),
    Field("m_tiles", "i32"),                     # token blocks
    Field("k_splits", "i32"),                    # pieces of K per output tile
    Field("tiles", "i32"),                       # pieces: output tiles x k_splits
    Field("direct", "i32"),                      # every-rank merges, one piece a CTA, small token blocks: the direct path
    Field("x_rank", "i32"),
    Field("x_world", "i32"),
    Field("x_grid_cap", "i32"),
    Field("x_ll_cap", "i32"),                    # CTA slots of the direct region: the SMs (its kernels run one a SM)
    Field("xring_cap", "i32"),
    *header("watchdog_kernel"),
    *header("prof_cap"),
])

# Expert-parallel MoE: dispatch, return and combine around each rank's MoE launches (templates/ep_moe.cuh,
# meld/distributed/expert_parallel.py).
EP_PARAMS = _with_header("EpParams", [
    Field("xpeers", "ptr", "char* const*"),      # every rank's symmetric window, as this rank addresses it
    Field("xexit", "ptr", "unsigned*"),          # the kernel's exit counter (each kernel leaves it at 0)
    Field("xlaunch", "ptr", "unsigned long long*"),   # calls this rank has finished
    *header("watchdog"),
    *header("watchdog_claim"),
    Field("x", "ptr", "const u16*"),             # this rank's tokens [T, H]
    Field("topk_ids", "ptr", "const int*"),      # [T, k], global expert ids
    Field("topk_w", "ptr", "const float*"),      # [T, k]
    Field("out", "ptr", "u16*"),                 # [T, H]
    Field("served", "ptr", "const u16*"),        # the owner's MoE output per received slot [world T k, H]
    Field("error", "ptr", "int*"),               # set when an id was out of range or repeated
    Field("x_stride", "i64"),
    Field("x_started_off", "i64"),               # places in a window, in bytes: u64 per rank: calls started,
    Field("x_sent_off", "i64"),                  # dispatches landed here, returns landed here;
    Field("x_back_off", "i64"),
    Field("x_hdr_off", "i64"),                   # per (source, pair) slot [world][T k]: the global expert
    Field("x_wts_off", "i64"),                   # (-1: invalid), its weight, its row [H] bf16;
    Field("x_rows_off", "i64"),
    Field("x_ret_off", "i64"),                   # per (owner, source) [world][world][T k]: served rows [H] bf16
    *PROXY_RING,
    Field("xring_cap", "i32"),
    Field("num_tokens", "i32"),
    Field("hidden", "i32"),
    Field("top_k", "i32"),
    Field("num_experts", "i32"),
    Field("experts_per_rank", "i32"),
    Field("x_rank", "i32"),
    Field("x_world", "i32"),
    *header("watchdog_kernel"),
])
