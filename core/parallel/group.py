"""The tensor-parallel process group, from the environment torchrun sets."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from tessellm.core.errors import ConfigError
from tessellm.core.parallel.errors import TensorParallelError, lost_peer
from tessellm.core.parallel.stages import PipelineStage


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel run: ``rank`` of ``size``, the process group
    (NCCL on CUDA, gloo on the CPU) and the device the rank computes on.

    ``all_reduce(x)`` sums ``x`` over the ranks in place (the model's one collective, after
    attention and after the MLP); a peer that died or timed out raises
    ``TensorParallelError`` naming the collective, never a hang past the group's timeout."""

    rank: int
    size: int
    group: object
    device: torch.device
    reduces: int = 0
    """All-reduces run so far, and the bytes each rank contributed to them."""
    reduced_bytes: int = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.reduces += 1
        self.reduced_bytes += x.numel() * x.element_size()
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as exc:
            raise lost_peer(self, "all_reduce", exc) from exc
        return x

    def barrier(self, what: str) -> None:
        import torch.distributed as dist

        try:
            dist.barrier(group=self.group)
        except RuntimeError as exc:
            raise lost_peer(self, what, exc) from exc

    def gather_objects(self, value: object, what: str) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        import torch.distributed as dist

        out: list = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self.group)
        except RuntimeError as exc:
            raise lost_peer(self, what, exc) from exc
        return out


def launched_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment, or None outside torchrun."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def is_follower() -> bool:
    """Whether this process is a rank other than 0 of a torchrun launch (it prints nothing)."""
    world = launched_world()
    return world is not None and world[1] > 1 and world[0] != 0


@dataclass
class Ranks:
    """This process's place in a distributed run of ``parallel.pipeline`` stages of
    ``parallel.tensor`` ranks each (stage = rank // tensor): ``world`` spans every rank (the
    lockstep of sync.py runs over it; rank 0 leads), ``tp`` the ranks of this stage, which
    split each of its layers (None at tensor 1), and ``stage`` this rank's pipeline stage
    (None at pipeline 1)."""

    world: TensorParallel
    tp: TensorParallel | None
    stage: Any = None  # a stages.PipelineStage

    @property
    def device(self) -> torch.device:
        return self.world.device


def launch_problem(tensor: int, pipeline: int) -> str | None:
    """Why this process cannot be a rank of ``pipeline`` x ``tensor`` (None: it can)."""
    size = tensor * pipeline
    what = f"parallel.tensor is {tensor}" if pipeline == 1 else \
        f"parallel.pipeline x parallel.tensor is {pipeline} x {tensor} = {size}"
    world = launched_world()
    if world is None:
        return (f"{what}, but this process was not launched by torchrun; run torchrun --nproc-per-node {size} "
                f"$(which tessellm) ... (or --nnodes with a rendezvous across machines), or set "
                f"{'parallel.tensor=1' if pipeline == 1 else 'parallel.pipeline=1 and parallel.tensor=1'}")
    if world[1] != size:
        allowed = (f"parallel.tensor={world[1]} for this launch" if pipeline == 1 else
                   f"pipeline x tensor = {world[1]} for this launch")
        return f"{what}, but torchrun launched {world[1]} process(es); allowed: {allowed}, or " \
               f"torchrun --nproc-per-node {size}"
    return None


def init_parallel(tensor: int, pipeline: int, device: torch.device, timeout_s: float) -> Ranks:
    """Join (or create) the default process group for ``pipeline`` x ``tensor`` ranks and
    make each stage's tensor-parallel group; ``device`` is the pipeline's device, narrowed
    to this rank's GPU on CUDA. A launch that does not match is a ConfigError naming what to
    change."""
    import torch.distributed as dist

    problem = launch_problem(tensor, pipeline)
    if problem:
        raise ConfigError(problem)
    rank, size, local_rank = launched_world()
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"rank {rank} has local rank {local_rank}, but this node has "
                              f"{torch.cuda.device_count()} GPU(s); launch at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
        # leave the group while the interpreter is whole: a group left to interpreter teardown
        # may have gloo's worker threads drop tensors after Python is gone, and the process
        # dies of SIGABRT ("terminate called without an active exception") after its work is
        # done. atexit runs last-registered first, so rank 0's RankSync.stop still reaches the
        # followers through the group before this.
        atexit.register(_leave_group)
    world = TensorParallel(rank, size, dist.group.WORLD, device)
    if pipeline == 1:
        return Ranks(world, world if tensor > 1 else None)
    # every rank takes part in making every group, in the same order
    groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor))) for s in range(pipeline)]
    transfers = dist.new_group(list(range(size)))  # activations and logits, apart from the lockstep's messages
    index = rank // tensor
    tp = TensorParallel(rank % tensor, tensor, groups[index], device) if tensor > 1 else None
    return Ranks(world, tp, PipelineStage(index, pipeline, tensor, rank, transfers, device, world))


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def in_launched_group() -> bool:
    """Whether this process joined a distributed run's group (a torchrun rank)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def end_rank(code: int) -> None:
    """End a torchrun rank that has done its work: run the exit handlers now (rank 0's stop
    to the followers, leaving the group, flushing logs), flush the output and leave without
    C++'s static teardown, where a thread of gloo's still joinable aborts a finished process
    ("terminate called without an active exception", SIGABRT) now and then even after the
    group was destroyed."""
    import sys

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
