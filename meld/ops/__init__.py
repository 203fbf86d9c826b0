"""User-facing operators."""
from .cascade_decode import CascadeDecode
from .cascade_graph import cascade_decode_graph
from .decode_attention import DecodeAttention
from .decode_graph import decode_attention_graph
from .decode_mla import DecodeMLA
from .mla_graph import mla_decode_graph
from .moe import MoE, fused_moe
from .moe_graph import moe_graph
from .moe_weights import pack_moe_weights
from . import torch_ops  # noqa: F401  (defines torch.ops.meld.*)

__all__ = ["CascadeDecode", "DecodeAttention", "DecodeMLA", "MoE", "cascade_decode_graph", "decode_attention_graph", "fused_moe", "mla_decode_graph", "moe_graph",
           "pack_moe_weights"]
