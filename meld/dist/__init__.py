"""The multi-rank layer: the rank dimension of a schedule (`shard`), transports that move partials
between ranks (`transport`: the CPU emulation so far), and sequence-parallel decode attention over them
(`seq_decode`)."""
from .seq_decode import rank_partials, seq_parallel_decode
from .shard import ShardPlan, shard_batch
from .transport import EmulatedTransport

__all__ = ["EmulatedTransport", "ShardPlan", "rank_partials", "seq_parallel_decode", "shard_batch"]
