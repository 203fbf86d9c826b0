"""meld's TVM frontend: the only meld package that imports TVM.

`decode_attention_primfunc` defines an operator in TVM; `capture` walks such a PrimFunc and derives the
`meld.ir.TaskGraph` the rest of meld works from, so scheduler, codegen and runtime never need TVM.
"""
from .capture import capture
from .decode_attention import decode_attention_primfunc

__all__ = ["capture", "decode_attention_primfunc"]
