"""meld: dynamic GPU workloads compiled into one persistent kernel per GPU, mapped at run time."""
__version__ = "0.1.0"

from .ops import DecodeAttention, DecodeMLA, MoE, fused_moe, pack_moe_weights  # noqa: E402

__all__ = ["DecodeAttention", "DecodeMLA", "MoE", "__version__", "fused_moe", "pack_moe_weights"]
