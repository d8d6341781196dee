"""Tensor parallelism over torch.distributed: one model's heads and MLP columns split across
ranks launched by torchrun (NCCL on CUDA, gloo on the CPU).

- group.py: the process group from torchrun's environment, and the all-reduce the model
  calls after attention and after the MLP;
- shard.py: which heads and columns a rank holds, its own ModelSpec, and reading only its
  slice of each checkpoint tensor;
- sync.py: rank 0 decides and the other ranks follow, step by step.
"""
