"""Tensor and pipeline parallelism over torch.distributed: one model's heads and MLP columns
split across the ranks of a stage, its layers split into stages, ranks launched by torchrun
(NCCL on CUDA, gloo on the CPU).

- group.py: the process groups from torchrun's environment (every rank; each stage's), and
  the all-reduce the model calls after attention and after the MLP;
- shard.py: which heads and columns a rank holds, its own ModelSpec, and reading only its
  slice of each checkpoint tensor;
- stages.py: which layers a stage holds, the micro-batches of a step, and the hand-over of
  activations and logits between stages;
- sync.py: rank 0 decides and the other ranks follow, step by step.
"""
