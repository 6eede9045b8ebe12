"""Data parallel's gradient averaging in the engine: every rank's gradients replaced by the mean
over the ranks, summed a bucket at a time as DDP sums them (ZenFlowEngine decides when: not for a
model that DistributedDataParallel or FSDP2 has averaged already)."""
from __future__ import annotations

import torch

from zenflow.distributed import Partition

# Gradients are averaged across ranks this many bytes at a time: one flat temporary per bucket,
# never one of the whole model (12.5 GiB for a 7B model in bf16), as DDP buckets them.
GRADIENT_BUCKET_BYTES = 256 << 20


def gradient_buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`grads` in order, grouped by dtype into runs of at most `bucket_bytes` (a larger gradient
    makes a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for g in grads:
        nbytes = g.numel() * g.element_size()
        bucket, size = open_bucket.get(g.dtype, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(g)
        open_bucket[g.dtype] = (bucket, size + nbytes)
    buckets += [bucket for bucket, _ in open_bucket.values() if bucket]
    return buckets


def average_gradients(partition: Partition, grads: list[torch.Tensor]) -> None:
    """Each of `grads` := its mean over the ranks of `partition`, in place, through one flat
    temporary per bucket of GRADIENT_BUCKET_BYTES."""
    for bucket in gradient_buckets(grads, GRADIENT_BUCKET_BYTES):
        flat = partition.sum_(torch.cat([g.reshape(-1) for g in bucket]),
                              "averaging gradients")
        flat /= partition.world_size
        for g, averaged in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(averaged.view_as(g))
