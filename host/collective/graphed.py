"""A THC all-reduce round of one tensor, replayed from a CUDA graph.

Why: called from Python, a round costs the host about a millisecond (argument checks and some
twenty launches), more than its kernels at DDP's bucket sizes (docs/results.md). Captured
once, a round is one replay. A graph fixes everything but the contents of memory, so:

- the reducer owns its buffers: a call copies the tensor into its input (padded with zeros
  where a tail slice is too short for the kernels) and the estimate out of its output;
- the round number lives on the device: the kernels derive the rotation and rounding keys
  from it, the MAX round's two round lanes come from it, and each round adds one to it;
- nothing inside a round waits for the device: the codec flags bad input into its status word
  (``THCCodec(deferred_checks=True)``), the round lanes are compared on the device, and the
  error-feedback residual changes only where the round was clean. One read after the round
  fetches all of it and raises what it names, as :class:`THCAllReduce` does at a round's end
  on a stream-ordered transport: every worker refuses a round with a marked slice or workers
  out of step.

The rounding draws are keyed by a fixed int (``generator``) and the round, so with the same
int :class:`THCAllReduce` gives the same estimates, bit for bit, where no tail is padded.

A graph is captured where one can run: CUDA tensors on a stream-ordered transport (NCCL). The
first round runs eagerly (it compiles the kernels and opens the communicator), the second is
captured, and every round from then on is a replay. Elsewhere (CPU tensors under Triton's
interpreter, Gloo) every round runs the same steps eagerly: how the tests check them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from thc.codec.backends import kernels_for
from thc.codec.common import WHOLE, raise_status
from thc.codec.params import THCParams
from thc.codec.thc import THCCodec
from thc.collective import agreement
from thc.collective.allreduce import DistTransport, RoundStats

HALF = (torch.float32, torch.float16, torch.bfloat16)
"""Input types the kernels read as they are."""


@dataclass
class _Buffers:
    """What a captured round reads and writes: fixed addresses for the graph's life."""
    numel: int
    x: torch.Tensor
    residual: torch.Tensor | None
    out: torch.Tensor
    round: torch.Tensor
    report: torch.Tensor
    """float64: the status word's four ints, then the two round lanes."""


class GraphedAllReduce:
    """Callable like :class:`THCAllReduce` (one tensor size a reducer), its rounds replayed
    from a CUDA graph where one can be captured (``capture``: None decides, True insists)."""

    def __init__(self, transport, params: THCParams | None = None, error_feedback: bool = True,
                 generator: int = 0, capture: bool | None = None):
        if isinstance(generator, bool) or not isinstance(generator, int):
            raise TypeError(f"a graphed round keys its rounding draws by a fixed int and the "
                            f"round; got generator={generator!r}")
        if transport.packed:
            raise ValueError("a graphed round sums through torch.distributed: the "
                             "aggregator's client runs on the host")
        self.params = params or THCParams()
        self.transport = transport
        transport.check(self.params)
        self.key = generator
        self.error_feedback = error_feedback
        self.capture = capture
        self.codec = THCCodec(self.params, backend="triton", deferred_checks=True)
        self.round = 0
        """Rounds taken (every call takes one, as in :class:`THCAllReduce`)."""
        self.stats = RoundStats()
        self.stats.seconds["graph"] = 0.0
        self.graph = None
        self._warm = False
        self._bufs: _Buffers | None = None
        self._round_bytes = 0

    @classmethod
    def through_torch_distributed(cls, group=None, params: THCParams | None = None, **kw):
        return cls(DistTransport(group), params, **kw)

    @property
    def n_workers(self) -> int:
        return self.transport.n_workers

    def _padded(self, flat: torch.Tensor) -> int:
        """The input length every slice of which runs in the kernels."""
        kern = kernels_for(flat, "triton")
        size = self.params.slice_size
        if not kern.supports(size):
            raise ValueError(f"a graphed round needs slices the kernels take; slice_size "
                             f"{size} is not one")
        numel = flat.numel()
        if all(kern.supports(g.padded) for g in self.codec.layout(numel).groups(WHOLE)):
            return numel
        low = next(1 << k for k in range(size.bit_length()) if kern.supports(1 << k))
        return numel - numel % size + low

    def _buffers(self, flat: torch.Tensor) -> _Buffers:
        b = self._bufs
        if b is None:
            n, dev = self._padded(flat), flat.device
            b = self._bufs = _Buffers(
                flat.numel(), torch.zeros(n, dtype=flat.dtype, device=dev),
                torch.zeros(n, device=dev) if self.error_feedback else None,
                torch.empty(n, device=dev), torch.zeros(1, dtype=torch.int64, device=dev),
                torch.zeros(6, dtype=torch.float64, device=dev))
        elif (b.numel, b.x.dtype, b.x.device) != (flat.numel(), flat.dtype, flat.device):
            raise ValueError(f"a graphed all-reduce serves one tensor: {b.numel} {b.x.dtype} "
                             f"on {b.x.device}, got {flat.numel()} {flat.dtype} on "
                             f"{flat.device}")
        return b

    def _step(self, b: _Buffers) -> None:
        """One round on the buffers, nothing read on the host: what the graph captures."""
        c, n = self.codec, b.x.numel()
        y = b.x + b.residual if b.residual is not None else b.x
        prep = c.prepare(y, b.round)
        max_norms, tags = agreement.untag(
            self.transport.max(agreement.tagged(prep.norms, b.round)))
        wire = c.encode_prepared(prep, max_norms, self.key, pack=False)
        sums, _ = self.transport.sum(wire, wire.numel(), self.params)
        c.decode(sums, self.n_workers, max_norms, n, b.round, out=b.out)
        word = c.status(y)
        if b.residual is not None:
            own = c.decode_own(wire, max_norms, n, b.round)
            clean = (word[0] == 0) & agreement.in_step(tags)
            torch.where(clean, y - own, b.residual, out=b.residual)
        b.report[:4].copy_(word)
        b.report[4:].copy_(tags)
        b.round.add_(1)

    def _capturable(self, flat: torch.Tensor) -> bool:
        can = flat.device.type == "cuda" and getattr(self.transport, "stream_ordered", False)
        if self.capture and not can:
            raise ValueError("a CUDA graph captures a round of CUDA tensors on a "
                             "stream-ordered transport (NCCL) only")
        return can if self.capture is None else bool(self.capture)

    def _run(self, b: _Buffers, flat: torch.Tensor) -> None:
        if self.graph is not None:
            self.graph.replay()
            self.transport.bytes_sent += self._round_bytes
            return
        before = self.transport.bytes_sent
        capture = self._capturable(flat)
        if not self._warm or not capture:
            self._step(b)
            self._round_bytes = self.transport.bytes_sent - before
            self._warm = True
            return
        graph = torch.cuda.CUDAGraph()
        # other threads (backward, while a DDP hook captures) go on launching meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._step(b)
        self.transport.bytes_sent = before   # capture sent nothing
        self.graph = graph
        self._run(b, flat)

    def __call__(self, tensor: torch.Tensor, position=None) -> torch.Tensor:
        """The THC estimate of the workers' mean of ``tensor``; raises, on every worker, what
        :class:`THCAllReduce` raises at a round's end (bad input anywhere, workers out of
        step). ``position`` (DLCP classes) needs the aggregator's transport: refused."""
        if position is not None:
            raise ValueError("DLCP priority classes travel through the aggregator's transport, "
                             "which a graphed round does not use")
        if tensor.numel() == 0:
            return tensor.clone()
        t0 = time.perf_counter()
        flat = tensor.detach().reshape(-1)
        if flat.dtype not in HALF:
            flat = flat.float()
        b = self._buffers(flat)
        b.x[:b.numel].copy_(flat)
        self.round += 1
        try:
            self._run(b, flat)
        except BaseException:
            # the round is taken all the same: the device's number stays the host's
            b.round.fill_(self.round)
            self.codec.discard_checks()
            raise
        values = b.report.tolist()
        if values[0] or values[4] + values[5] != agreement.ROUND_SPAN:
            self.codec.discard_checks()
            raise_status([int(v) for v in values[:4]], self.params)
            agreement.check_rounds(values[4:])
        self.stats.calls += 1
        self.stats.elements += b.numel
        self.stats.seconds["graph"] += time.perf_counter() - t0
        # a copy: the next round overwrites the buffer
        return b.out[:b.numel].to(tensor.dtype, copy=True).reshape(tensor.shape)
