"""meld: dynamic GPU workloads compiled into one persistent kernel per GPU, mapped at run time."""
__version__ = "0.1.0"

from .ops import CascadeDecode, DecodeAttention, DecodeMLA, MoE, fused_moe, pack_moe_weights  # noqa: E402

__all__ = ["CascadeDecode", "DecodeAttention", "DecodeMLA", "MoE", "__version__", "fused_moe", "pack_moe_weights"]
