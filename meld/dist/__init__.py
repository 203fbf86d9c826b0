"""The multi-rank layer: the rank dimension of a schedule (`shard`), transports that move partials
between ranks (`transport`: the CPU emulation), sequence-parallel decode attention over them
(`seq_decode`: emulated ranks; `seq_parallel`: GPUs of a process group through symmetric memory), and
`spawn` for starting ranks in the tests and benchmarks."""
from .seq_decode import rank_partials, seq_parallel_decode
from .seq_parallel import SeqParallelDecode, SymmetricWindow, WindowLayout
from .shard import ShardPlan, shard_batch
from .spawn import spawn
from .transport import EmulatedTransport

__all__ = ["EmulatedTransport", "SeqParallelDecode", "ShardPlan", "SymmetricWindow", "WindowLayout", "rank_partials",
           "seq_parallel_decode", "shard_batch", "spawn"]
