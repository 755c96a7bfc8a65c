"""Marsit: one sign bit per coordinate through a ring all-reduce, merged at every hop.

Each worker sends the sign of its compensated gradient. In the ring's reduce-scatter, a
chunk that already merges the bits of k workers meets a new worker, which keeps its own bit
with probability 1/(k+1) and otherwise forwards the incoming one: no hop decompresses or
re-compresses, and every final bit is the sign of a uniformly chosen worker, so its
expectation is the workers' mean sign (unbiased). The all-gather then spreads the merged
bits. One scalar all-reduce carries the scale (the workers' mean absolute value), and the
global compensation keeps, on every worker, what the shared estimate missed of its own
gradient (error feedback against the global estimate), which keeps training convergent.

Bytes on the wire per worker: 2 (p - 1) / p * d / 8 for d coordinates, plus one float.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from host.codec.packing import pack_bits, unpack_bits


def merge(incoming: torch.Tensor, own: torch.Tensor, merged: int,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """The bit that leaves a hop: ``own`` with probability 1/(merged + 1), else ``incoming``
    (which already stands for ``merged`` workers). Bits are bool tensors."""
    if merged < 1:
        raise ValueError(f"an incoming chunk merges at least one worker, got {merged}")
    keep = torch.rand(own.shape, generator=generator, device=own.device) < 1.0 / (merged + 1)
    return torch.where(keep, own, incoming)


def ring_merge(signs: list[torch.Tensor], generator: torch.Generator | None = None
               ) -> torch.Tensor:
    """The merged bits a ring of ``len(signs)`` workers produces for one chunk, in one process
    (the hops in ring order); what the statistical tests check."""
    acc = signs[0]
    for k, own in enumerate(signs[1:], start=1):
        acc = merge(acc, own, k, generator)
    return acc


class MarsitAllReduce:
    """Sign-bit all-reduce of one tensor over a torch.distributed group (Gloo or NCCL).

    ``compensation`` keeps one residual per call site: call one instance per tensor (or
    bucket) of fixed size, as the DDP hook does.
    """

    def __init__(self, group=None, generator: torch.Generator | None = None,
                 compensation: bool = True):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.generator = generator
        self.compensation = compensation
        self.residual: torch.Tensor | None = None
        self.bytes_sent = 0

    def _peer(self, offset: int) -> int:
        r = (self.rank + offset) % self.world
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, self._peer(1), self.group),
               dist.P2POp(dist.irecv, recv, self._peer(-1), self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.bytes_sent += send.numel() * send.element_size()

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(grad).all():
            raise ValueError("Marsit: the gradient holds NaN or Inf")
        flat = grad.reshape(-1).float()
        if self.compensation and self.residual is not None:
            if self.residual.shape != flat.shape:
                raise ValueError(f"Marsit: residual of {self.residual.numel()} elements, "
                                 f"gradient of {flat.numel()}: use one instance per tensor")
            flat = flat + self.residual
        p, d = self.world, flat.numel()
        scale = flat.abs().mean().reshape(1)
        dist.all_reduce(scale, group=self.group)
        scale /= p
        self.bytes_sent += 2 * (p - 1) * 4 // p
        own = flat >= 0
        chunk = -(-d // (8 * p)) * 8          # bits per chunk, a whole number of bytes
        padded = torch.zeros(chunk * p, dtype=torch.bool, device=flat.device)
        padded[:d] = own
        mine = padded.reshape(p, chunk)
        acc = mine.clone()
        buf = torch.empty(chunk // 8, dtype=torch.uint8, device=flat.device)
        for step in range(p - 1):
            send_idx, recv_idx = (self.rank - step) % p, (self.rank - step - 1) % p
            self._exchange(pack_bits(acc[send_idx], 1), buf)
            incoming = unpack_bits(buf, 1, chunk).bool()
            acc[recv_idx] = merge(incoming, mine[recv_idx], step + 1, self.generator)
        done = (self.rank + 1) % p
        for step in range(p - 1):
            send_idx, recv_idx = (done - step) % p, (done - step - 1) % p
            self._exchange(pack_bits(acc[send_idx], 1), buf)
            acc[recv_idx] = unpack_bits(buf, 1, chunk).bool()
        bits = acc.reshape(-1)[:d]
        estimate = torch.where(bits, scale, -scale)
        if self.compensation:
            self.residual = flat - estimate
        return estimate.reshape(grad.shape).to(grad.dtype)
