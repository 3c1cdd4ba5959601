"""Tensor parallelism's process group and collectives (Megatron-LM, Shoeybi et al. 2019).

Each rank is one process with ``torch.distributed`` initialized (:func:`init_distributed`:
gloo on CPU, NCCL on CUDA). The tensor-parallel layers
(:mod:`kvserve.worker.layers.parallel_linear`,
:mod:`kvserve.worker.layers.vocab_parallel_embedding`) join their partial results with the
collectives of :mod:`kvserve.distributed.communication_op`; every one of them is a no-op when
the world size is 1, so the single-process path is unchanged.
"""

from kvserve.distributed.communication_op import (broadcast_object, tensor_model_parallel_all_gather,
                                                  tensor_model_parallel_all_reduce, tensor_model_parallel_gather)
from kvserve.distributed.parallel_state import (destroy_distributed, divide, get_tp_group, get_tp_rank,
                                                get_tp_world_size, init_distributed, is_initialized, tp_head_counts)

__all__ = [
    "broadcast_object", "destroy_distributed", "divide", "get_tp_group", "get_tp_rank", "get_tp_world_size",
    "init_distributed", "is_initialized", "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather", "tp_head_counts",
]
