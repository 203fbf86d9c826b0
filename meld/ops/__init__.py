"""User-facing operators."""
from .decode_attention import DecodeAttention
from .decode_graph import decode_attention_graph

__all__ = ["DecodeAttention", "decode_attention_graph"]
