"""The multi-rank layer: the rank dimension of a schedule (`shard`); transports that move partials between
ranks (`transport`: the CPU emulation and the protocol its proxy shares with the GPU's, `proxy`: the GPU
proxy); the one cross-rank reduction (`reduce`: the last arriving part merges); sequence-parallel decode
attention (`seq_decode`: emulated ranks; `seq_parallel`: the GPUs of a process group, peer memory or the
proxy); the row-parallel GEMM with its all-reduce fused per tile (`tp_linear`: the GPUs of a process group;
`tp_matmul`: emulated ranks); rail-aware hierarchical movement over a modelled multi-node topology
(`topology`, `rails`: emulated ranks); the adaptive split of a kernel's CTA slots between compute and
communication (`sm_split`: modelled slots, and a GEMM + reduce-scatter replayed on emulated ranks); expert-parallel MoE (`ep_moe`: emulated ranks, also as one launch per rank with
tiles and combines that wait only for their own rows; `expert_parallel`: the GPUs of a process group); the NVSHMEM
engine under windows and the proxy (`nvshmem`); and `spawn` for starting ranks in the tests and benchmarks."""
from .ep_moe import expert_parallel_moe
from .expert_parallel import ExpertParallelMoE
from .rails import RailTransport
from .reduce import LastArriverReduce, run_ranks
from .seq_decode import rank_partials, ranked_decode_schedule, seq_parallel_decode
from .seq_parallel import SeqParallelDecode, WindowLayout
from .shard import ShardPlan, shard_batch
from .spawn import spawn
from .topology import Link, Topology
from .tp_linear import RowParallelLinear
from .tp_matmul import row_parallel_matmul
from .transport import EmulatedTransport
from .window import SymmetricWindow

__all__ = ["EmulatedTransport", "ExpertParallelMoE", "LastArriverReduce", "Link", "RailTransport", "Topology", "expert_parallel_moe", "SeqParallelDecode", "ShardPlan", "SymmetricWindow", "WindowLayout",
           "RowParallelLinear", "rank_partials", "ranked_decode_schedule", "row_parallel_matmul", "run_ranks", "seq_parallel_decode", "shard_batch", "spawn"]
