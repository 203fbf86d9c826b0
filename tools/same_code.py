"""Did a change move any kernel's code? Compare every kernel variant's PTX at a base commit and here.

    python tools/same_code.py BASE [--keep DIR] [--only SUBSTRING ...]

Renders each variant in VARIANTS (every kernel family and the build options that change their code) from
BASE's `meld` package and from this tree's, compiles both to PTX with nvcc for sm_90a, and compares them
after normalising what a pure reorganisation may change: comments, debug-line markers and the size of the
parameter struct, and each parameter access's byte offset, written instead as the field it falls in (read
from the static_asserts ParamStruct writes beside the struct): a field moved or removed is the same code,
reading a different field is not; and the name of the dynamic shared-memory array. Where the PTX differs, ptxas
compiles both sides and their kernels' machine code (the cubin's .text sections) is compared instead (the
front end may number or order things differently and ptxas still emit the same SASS). Prints one line per
variant -- `same`, `same machine code`, `DIFFERS` (naming the kernels whose machine code differs and those
whose does not, with the first differing line and both sides' registers, stack and spills) or `missing`
where a side cannot render it -- and exits 1 if any differs or is missing here (one missing at the base is a
new build: nothing to compare).

Why: structural work on the kernels (shared headers, one skeleton, a moved struct) should not change what
the GPU runs. Identical PTX means identical SASS from the same ptxas, so same-code variants need no GPU
time to show they are neither slower nor wrong; a variant that differs is what the same-run A/B on the
GPU must cover. No GPU needed: nvcc only.
"""
from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> Python expression that evaluates to a kernel config (with .render() and .name) in either tree.
VARIANTS = {
    "decode": "DecodeKernelConfig.default('bfloat16', 128)",
    "decode-d64-fp16": "DecodeKernelConfig.default('float16', 64)",
    "decode-d256": "DecodeKernelConfig.default('bfloat16', 256)",
    "decode-h16-dsm": "DecodeKernelConfig.default('bfloat16', 128, onchip_merge=True, group_size=16)",
    "decode-tma": "dataclasses.replace(DecodeKernelConfig.default('bfloat16', 128), tma=True)",
    "decode-tma-withhold": "dataclasses.replace(DecodeKernelConfig.default('bfloat16', 128), tma=True, "
                           "debug_withhold_signal=True)",
    "decode-invariant": "DecodeKernelConfig.default('bfloat16', 128, batch_invariant=True)",
    "decode-profile": "dataclasses.replace(DecodeKernelConfig.default('bfloat16', 128), profile=True)",
    "decode-xrank-peer": "dataclasses.replace(DecodeKernelConfig.default('bfloat16', 128), xrank='peer')",
    "decode-xrank-proxy": "dataclasses.replace(DecodeKernelConfig.default('bfloat16', 128, onchip_merge=True), "
                          "xrank='proxy')",
    "decode-fp8": "DecodeKernelConfig.default('bfloat16', 128, kv_dtype='float8_e4m3fn')",
    "decode-fp8-d64-fp16-tma": "dataclasses.replace(DecodeKernelConfig.default('float16', 64, "
                               "kv_dtype='float8_e4m3fn'), tma=True)",
    "decode-e5m2": "DecodeKernelConfig.default('bfloat16', 128, kv_dtype='float8_e5m2')",
    "decode-fp8-bf16math": "dataclasses.replace(DecodeKernelConfig.default('bfloat16', 128, kv_dtype='float8_e4m3fn'), "
                           "fp8_math='')",
    "decode-e5m2-d64-fp16-tma": "dataclasses.replace(DecodeKernelConfig.default('float16', 64, "
                                "kv_dtype='float8_e5m2'), tma=True)",
    "decode-softcap": "DecodeKernelConfig.default('bfloat16', 128, variant=DecodeVariant(50.0))",
    "decode-q4": "DecodeKernelConfig.default('bfloat16', 128, group_size=4, q_len=4)",
    "decode-q8-h32": "DecodeKernelConfig.default('bfloat16', 128, group_size=4, q_len=8)",
    "decode-q8-h32-ragged": "DecodeKernelConfig.default('bfloat16', 128, group_size=4, q_len=8, ragged_q=True)",
    "decode-window-fp8-tma": "dataclasses.replace(DecodeKernelConfig.default('bfloat16', 128, "
                             "kv_dtype='float8_e4m3fn', variant=DecodeVariant(30.0, 1000)), tma=True)",
    "decode-rope-d64-fp16": "DecodeKernelConfig.default('float16', 64, variant=DecodeVariant(rope_theta=1e4))",
    "decode-rope-d256-invariant": "DecodeKernelConfig.default('bfloat16', 256, batch_invariant=True, "
                                  "variant=DecodeVariant(rope_theta=5e5, rope_scale=8.0))",
    "decode-rope-fp8": "DecodeKernelConfig.default('bfloat16', 128, kv_dtype='float8_e4m3fn', "
                       "variant=DecodeVariant(rope_theta=5e5, rope_scale=8.0))",
    "decode-d512": "DecodeKernelConfig.default('bfloat16', 512)",
    "decode-d512-rope-fp8-fp16": "DecodeKernelConfig.default('float16', 512, kv_dtype='float8_e4m3fn', "
                                 "variant=DecodeVariant(rope_theta=1e4))",
    "decode-plan": "DecodePlanKernelConfig()",
    "decode-plan-tokens": "DecodePlanKernelConfig(token_requests=True)",
    "mla": "MlaKernelConfig()",
    "mla-32-profile": "MlaKernelConfig(block_tokens=32, profile=True)",
    "mla-seesaw": "MlaKernelConfig(schedule='seesaw')",
    "mla-split": "MlaKernelConfig(schedule='split')",
    "mla-fp8": "MlaKernelConfig.for_cache('float8_e4m3fn')",
    "moe": "MoeKernelConfig()",
    "moe-packed": "MoeKernelConfig(packed_weights=True, absent_pairs=True)",
    "moe-fp8": "MoeKernelConfig(weight_dtype='e4m3', block_tokens=32)",
    "tp": "TpKernelConfig()",
    "tp-proxy-profile": "TpKernelConfig(transport='proxy', profile=True)",
    "tp-owner-w2": "TpKernelConfig(merge='owner', warpgroups=2)",
    "ep": "EpKernelConfig()",
    "ep-proxy": "EpKernelConfig(transport='proxy')",
    "grouped": "GroupedKernelConfig('bfloat16', 128)",
    "grouped-d64-fp16": "GroupedKernelConfig('float16', 64)",
    "grouped-d256-profile": "GroupedKernelConfig('bfloat16', 256, profile=True)",
    "grouped-warp": "GroupedKernelConfig('bfloat16', 128, split_stream='warp')",
    "grouped-warp-d256": "GroupedKernelConfig('bfloat16', 256, split_stream='warp')",
    "grouped-cta": "GroupedKernelConfig('bfloat16', 128, split_stream='cta')",
    "grouped-cta-d64-fp16-profile": "GroupedKernelConfig('float16', 64, profile=True, split_stream='cta')",
    "grouped-wgmma": "GroupedKernelConfig('bfloat16', 128, prefix_mma='wgmma')",
    "grouped-w4": "GroupedKernelConfig('bfloat16', 128, prefix_mma='wgmma', defer_split_events=True, warps=4)",
}

_RENDER = """
import dataclasses, json, sys
from meld.codegen.decode_kernel import DecodeKernelConfig, DecodePlanKernelConfig
from meld.codegen.mla_kernel import MlaKernelConfig
from meld.codegen.moe_kernel import MoeKernelConfig
from meld.codegen.tp_kernel import TpKernelConfig
from meld.codegen.ep_kernel import EpKernelConfig
from meld.codegen.grouped_kernel import GroupedKernelConfig
try:
    from meld.codegen.decode_kernel import DecodeVariant
except ImportError:   # a tree from before the decode variants: their entries are missing there
    pass
out = {}
for key, expr in json.loads(sys.argv[1]).items():
    try:
        out[key] = eval(expr).render()
    except Exception as e:
        out[key] = None
        print(f"{key}: {type(e).__name__}: {e}", file=sys.stderr)
json.dump(out, sys.stdout)
"""

_ACCESS = re.compile(r"\[(\w+)_param_0(?:\+(\d+))?\]")   # [k_param_0+48], [k_param_0]
_PARAM_SIZE = re.compile(r"(\.b8 \w+_param_0)\[\d+\]")    # .param .b8 k_param_0[1344]
_EXTERN_SHARED = re.compile(r"^\.extern \.shared .*?\.b8 (\w+)\[\];", re.M)   # the dynamic shared array's name
_DROP = re.compile(r"^\s*(//|\.loc\s|\.file\s)")            # comments, debug line and file markers
_ENTRY = re.compile(r"__global__[^;{]*?\b(meld_\w+)\s*\(\s*const __grid_constant__ (\w+)")   # a kernel written out
_FAMILY_ENTRY = re.compile(r"^MELD_PERSISTENT_KERNEL\((\w+),\s*(?:meld::)?(\w+),", re.M)   # persistent.cuh's
_FAMILY = re.compile(r"^struct (\w+)\s*(?::\s*SimpleFamily<(\w+),[^{]*)?\{\s*(?:using Params = (\w+);)?", re.M)
_OFFSET = re.compile(r"__builtin_offsetof\((\w+), (\w+)\) == (\d+)")


def render(meld_parent: Path, variants: dict[str, str]) -> dict[str, str | None]:
    """Each variant's source as the `meld` package under meld_parent renders it (None: it cannot)."""
    env = dict(os.environ, PYTHONPATH=str(meld_parent))
    res = subprocess.run([sys.executable, "-c", _RENDER, json.dumps(variants)], capture_output=True, text=True,
                         env=env, cwd=meld_parent, check=False)
    if res.returncode:
        raise SystemExit(f"rendering at {meld_parent} failed:\n{res.stderr[-2000:]}")
    if res.stderr:
        print(res.stderr.strip(), file=sys.stderr)
    return json.loads(res.stdout)


def field_maps(source: str) -> dict[str, list[tuple[int, str]]]:
    """Per kernel entry, its parameter struct's (offset, field) list, read from the static_asserts that
    ParamStruct.c_source writes beside each struct."""
    fields: dict[str, list[tuple[int, str]]] = {}
    for owner, name, off in _OFFSET.findall(source):
        fields.setdefault(owner, []).append((int(off), name))
    params = {family: base or own for family, base, own in _FAMILY.findall(source)}   # a family's F::Params
    entries = [*_ENTRY.findall(source), *((e, params.get(f, "")) for e, f in _FAMILY_ENTRY.findall(source))]
    return {entry: sorted(fields.get(owner, [])) for entry, owner in entries}


def _named(maps: dict[str, list[tuple[int, str]]], m: re.Match) -> str:
    """[k_param_0+off] as [k.field+delta]: a field moved is the same access, a different field is not."""
    entry, off = m.group(1), int(m.group(2) or 0)
    at = [(o, f) for o, f in maps.get(entry, []) if o <= off]
    if not at:
        return m.group(0)
    o, f = at[-1]
    return f"[{entry}.{f}+{off - o}]"


def ptx(source: str, name: str, workdir: Path) -> list[str]:
    from meld.codegen.compiler import COMMON_OPTIONS, _nvcc_path
    cu, out = workdir / f"{name}.cu", workdir / f"{name}.ptx"
    cu.write_text(source)
    nvcc = _nvcc_path()
    if nvcc is None:
        raise SystemExit("nvcc not found")
    opts = [o for o in COMMON_OPTIONS if o != "-lineinfo"]
    res = subprocess.run([nvcc, "-arch=sm_90a", "-ptx", *opts, "-o", str(out), str(cu)], capture_output=True,
                         text=True, check=False)
    if res.returncode:
        raise SystemExit(f"nvcc -ptx failed for {name}:\n{res.stderr[-2000:]}")
    maps, text = field_maps(source), out.read_text()
    for name in set(_EXTERN_SHARED.findall(text)):   # (a name, not code: a namespace mangles it)
        text = re.sub(rf"\b{name}\b", "SMEM", text)
    return [_PARAM_SIZE.sub(r"\1[SIZE]", _ACCESS.sub(lambda m: _named(maps, m), line))
            for line in text.splitlines() if not _DROP.match(line)]


def machine_code(ptx_file: Path) -> dict[str, bytes]:
    """Each kernel's SASS (the cubin's .text.<kernel> section bytes) that ptxas makes of a PTX file."""
    from meld.codegen.compiler import _nvcc_path
    ptxas = Path(_nvcc_path() or "nvcc").with_name("ptxas")
    cubin = ptx_file.with_suffix(".cubin")
    subprocess.run([str(ptxas), "-arch=sm_90a", str(ptx_file), "-o", str(cubin)], capture_output=True, check=True)
    elf = cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, off, size, *_ in headers:
        name = elf[names_at + name_off:elf.index(b"\0", names_at + name_off)].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = elf[off:off + size]
    return out


def resources(ptx_file: Path) -> str:
    """ptxas's registers, stack frame and spills per kernel of a PTX file (what a difference costs)."""
    from meld.codegen.compiler import _nvcc_path
    ptxas = Path(_nvcc_path() or "nvcc").with_name("ptxas")
    res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx_file), "-o", os.devnull], capture_output=True,
                         text=True, check=False)
    found = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores.*?"
                       r"Used (\d+) registers", res.stderr, re.S)
    return "; ".join(f"{k}: {r} registers, {st} B stack, {sp} B spilled" for k, st, sp, r in found) or res.stderr[-200:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="git commit to compare against")
    ap.add_argument("--keep", type=Path, help="write both sides' sources and PTX here")
    ap.add_argument("--only", nargs="+", default=[], help="variants whose name contains one of these")
    args = ap.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if not args.only or any(s in k for s in args.only)}
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="meld-same-code-") as tmp:
        work = args.keep or Path(tmp)
        base_dir = work / "base"
        base_dir.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", args.base, "meld"], cwd=ROOT, capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(base_dir, filter="data")
        sides = {"base": render(base_dir, variants), "here": render(ROOT, variants)}
        differs = new = 0
        for key in variants:
            a, b = sides["base"][key], sides["here"][key]
            if a is None or b is None:   # a build new here has nothing to compare: only a lost one counts
                print(f"{key:22s} missing at {'base (a new build)' if a is None else 'here'}")
                differs += b is None
                new += a is None
                continue
            dirs = {s: work / s for s in sides}
            for d in dirs.values():
                d.mkdir(exist_ok=True)
            pa, pb = ptx(a, key, dirs["base"]), ptx(b, key, dirs["here"])
            if pa == pb:
                print(f"{key:22s} same ({len(pa)} PTX lines)")
                continue
            ma, mb = machine_code(dirs["base"] / f"{key}.ptx"), machine_code(dirs["here"] / f"{key}.ptx")
            if ma == mb:
                print(f"{key:22s} same machine code (the PTX differs, ptxas's SASS does not)")
                continue
            differs += 1
            diff = [d for d in difflib.unified_diff(pa, pb, lineterm="", n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
            same = sorted(k for k in ma if ma[k] == mb.get(k))
            print(f"{key:22s} DIFFERS in {', '.join(sorted(k for k in ma.keys() | mb.keys() if k not in same))}"
                  + (f" (same machine code: {', '.join(same)})" if same else "")
                  + f": {len(diff)} PTX lines changed; first: {diff[0][:140] if diff else '?'}")
            for side in sides:
                print(f"{'':22s}   {side}: {resources(dirs[side] / f'{key}.ptx')}")
    print(f"{len(variants) - new - differs} of {len(variants) - new} variants compile to the same PTX as {args.base}"
          + (f" ({new} new here)" if new else ""))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
