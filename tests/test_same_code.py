"""tools/same_code.py: the PTX comparison sees a changed instruction and forgives a moved parameter field."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import same_code  # noqa: E402

from meld.codegen.params import Field, ParamStruct  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

def _ptx(tmp_path: Path, fields: list[Field], body: str) -> list[str]:
    struct = ParamStruct("P", fields)
    source = f"typedef unsigned short u16;\n{struct.c_source()}\n" \
             f'extern "C" __global__ void meld_k(const __grid_constant__ P p) {{ {body} }}\n'
    return same_code.ptx(source, f"k{len(list(tmp_path.iterdir()))}", tmp_path)


OUT, A, B = Field("out", "ptr", "float*"), Field("a", "f32"), Field("b", "f32")


def test_a_reordered_or_grown_struct_is_the_same_code(tmp_path):
    base = _ptx(tmp_path, [OUT, A, B], "p.out[threadIdx.x] = p.a - p.b;")
    moved = _ptx(tmp_path, [Field("unused", "i64"), A, B, OUT], "p.out[threadIdx.x] = p.a - p.b;")
    assert base == moved


def test_a_changed_instruction_differs(tmp_path):
    assert _ptx(tmp_path, [OUT, A, B], "p.out[threadIdx.x] = p.a - p.b;") != \
        _ptx(tmp_path, [OUT, A, B], "p.out[threadIdx.x] = p.a * p.b;")


def test_reading_another_field_differs_though_the_offsets_match(tmp_path):
    # b - a with b where a was: by offsets alone the same PTX as a - b
    assert _ptx(tmp_path, [OUT, A, B], "p.out[threadIdx.x] = p.a - p.b;") != \
        _ptx(tmp_path, [OUT, B, A], "p.out[threadIdx.x] = p.b - p.a;")


def test_every_variant_renders_here():
    out = same_code.render(same_code.ROOT, same_code.VARIANTS)
    assert all(isinstance(src, str) and "__global__" in src for src in out.values()), \
        [k for k, v in out.items() if v is None]


def test_machine_code_is_each_kernels_sass(tmp_path):
    src = 'extern "C" __global__ void meld_a(float* x) { x[threadIdx.x] *= 2.f; }\n' \
          'extern "C" __global__ void meld_b(float* x) { x[threadIdx.x] += 2.f; }\n'
    same_code.ptx(src, "two", tmp_path)
    code = same_code.machine_code(tmp_path / "two.ptx")
    assert set(code) == {"meld_a", "meld_b"} and code["meld_a"] != code["meld_b"]
    assert all(len(c) % 16 == 0 and c for c in code.values())   # sm_90 instructions are 16 bytes


def test_the_shared_arrays_name_is_not_code(tmp_path):
    body = "{name}[threadIdx.x] = 1; __syncthreads(); out[threadIdx.x] = {name}[threadIdx.x ^ 1];"
    a, b = (same_code.ptx(f'extern "C" __global__ void meld_k(unsigned char* out) {{ extern __shared__ unsigned char '
                          f'{n}[]; {body.format(name=n)} }}\n', n, tmp_path) for n in ("smem", "smem_raw"))
    assert a == b


def test_each_entry_reads_its_struct_through_the_skeleton_and_written_out():
    """A MELD_PERSISTENT_KERNEL entry maps to its family's Params (declared, or SimpleFamily's), an entry
    written out (a base tree's, with __launch_bounds__) to its parameter's type."""
    from meld.codegen.moe_kernel import MoeKernelConfig

    maps = same_code.field_maps(MoeKernelConfig().render())
    assert set(maps) == {"meld_moe_route", "meld_moe_scatter", "meld_moe_main"}
    assert maps["meld_moe_route"] == maps["meld_moe_main"] and ("num_tokens" in dict(maps["meld_moe_main"]).values())
    written = 'extern "C" __global__ void __launch_bounds__(64) meld_k(const __grid_constant__ P p) {}\n'
    assert same_code.field_maps(ParamStruct("P", [OUT, A]).c_source() + written) == {"meld_k": [(0, "out"), (8, "a")]}
