"""One kernel main: every meld kernel entry is declared through persistent.cuh's MELD_PERSISTENT_KERNEL, in
every template and in every family's rendered source (no GPU, no nvcc: text only)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
from importlib import resources
from pathlib import Path

import pytest

import meld.codegen

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import same_code  # noqa: E402

_MACRO = re.compile(r"^#define MELD_PERSISTENT_KERNEL\(.*?[^\\]$", re.M | re.S)   # the definition, continuations too
_COMMENT = re.compile(r"//[^\n]*")
_USE = re.compile(r"^MELD_PERSISTENT_KERNEL\((\w+),", re.M)


def _entries_outside_the_macro(source: str) -> list[str]:
    """The lines that declare a __global__ function other than through MELD_PERSISTENT_KERNEL."""
    code = _COMMENT.sub("", _MACRO.sub("", source))
    return [line for line in code.splitlines() if "__global__" in line]


def test_the_check_sees_a_kernel_written_out():
    skeleton = resources.files("meld.codegen").joinpath("templates", "persistent.cuh").read_text()
    assert _entries_outside_the_macro(skeleton) == []
    assert _entries_outside_the_macro(skeleton + 'extern "C" __global__ void meld_k(int* x) { *x = 1; }\n')
    assert _entries_outside_the_macro("// a __global__ in a comment\nMELD_PERSISTENT_KERNEL(meld_k, F, 32, 0)\n") == []


@pytest.mark.parametrize("name", sorted(p.name for p in resources.files("meld.codegen").joinpath("templates").iterdir()
                                        if p.name.endswith((".cuh", ".h"))))
def test_no_template_declares_a_kernel_of_its_own(name):
    assert _entries_outside_the_macro(resources.files("meld.codegen").joinpath("templates", name).read_text()) == []


def _kernel_configs() -> set[str]:
    """The classes of meld.codegen that render a kernel source."""
    found = set()
    for info in pkgutil.iter_modules(meld.codegen.__path__):
        module = importlib.import_module(f"meld.codegen.{info.name}")
        found |= {name for name, cls in inspect.getmembers(module, inspect.isclass)
                  if cls.__module__ == module.__name__ and callable(getattr(cls, "render", None))}
    return found


def test_every_family_renders_each_kernel_through_the_skeleton():
    """The variants tools/same_code.py compares (every family, the build options that change its code) cover
    every kernel config class, and each rendered source declares its kernels only through the macro."""
    missing = {c for c in _kernel_configs() if not any(re.search(rf"\b{c}\b", e) for e in same_code.VARIANTS.values())}
    assert not missing, f"no variant in tools/same_code.py renders {sorted(missing)}"
    sources = same_code.render(same_code.ROOT, same_code.VARIANTS)
    for key, src in sources.items():
        assert src is not None, key
        assert _entries_outside_the_macro(src) == [], key
        assert _USE.findall(src), f"{key}: no kernel entry"
    entries = {e for src in sources.values() for e in _USE.findall(src)}
    assert {"meld_moe_route", "meld_moe_scatter", "meld_moe_main", "meld_decode_plan", "meld_ep_dispatch",
            "meld_ep_return", "meld_ep_combine"} <= entries
