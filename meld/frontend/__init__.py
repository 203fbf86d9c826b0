"""meld's TVM frontend: the only meld package that imports TVM.

`decode_attention_primfunc` and `mla_decode_primfunc` define operators in TVM; `capture` and `capture_mla`
walk such a PrimFunc and derive the `meld.ir.TaskGraph` the rest of meld works from, so scheduler, codegen
and runtime never need TVM.
"""
from .capture import capture
from .capture_mla import capture_mla
from .decode_attention import decode_attention_primfunc
from .mla_decode import mla_decode_primfunc

__all__ = ["capture", "capture_mla", "decode_attention_primfunc", "mla_decode_primfunc"]
