"""The codec on a GPU: with deferred checks no call waits for the device, so encode and decode
run back to back and replay from a CUDA graph, and bad input is still caught at check().
Needs CUDA; skipped without it (the interpreter tests in test_codec_kernels.py check what the
kernels compute)."""
import pytest
import torch

from thc.codec.thc import THCCodec, THCParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the codec's GPU path needs one")


def _round(c, x, m, sums, out, own):
    """One worker's round as the all-reduce runs it: encode, decode the sums, own decode."""
    wire = c.encode_prepared(c.prepare(x, 3), m, 7, pack=False)
    c.decode(sums, 4, m, x.numel(), 3, out=out)
    own.copy_(c.decode_own(wire, m, x.numel(), 3))
    return wire


def _setup(n=(1 << 21) + 5000, dtype=torch.float32):
    p = THCParams()
    c = THCCodec(p, deferred_checks=True)
    x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    x = x.to(dtype)
    m = c.norms(x.float())
    sums = c.aggregate([c.encode(x, m, 3, 7)] * 4).to(torch.uint8)
    out = torch.empty(n, device="cuda")
    own = torch.empty(n, device="cuda")
    return c, x, m, sums, out, own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_call_waits_for_the_device(dtype):
    """torch's sync debug mode turns any wait for the device into an error."""
    c, x, m, sums, out, own = _setup(dtype=dtype)
    _round(c, x, m, sums, out, own)        # warm: compiled kernels, cached tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _round(c, x, m, sums, out, own)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    c.check()


def test_a_round_replays_from_a_cuda_graph_and_bad_input_is_still_caught():
    c, x, m, sums, out, own = _setup()
    wire = _round(c, x, m, sums, out, own)
    want = (wire.clone(), out.clone(), own.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _round(c, x, m, sums, out, own)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wire = _round(c, x, m, sums, out, own)
    out.zero_()
    own.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(wire, want[0]) and torch.equal(out, want[1])
    assert torch.equal(own, want[2])
    c.check()
    x[(1 << 20) + 7] = float("nan")         # slice 1
    graph.replay()
    with pytest.raises(ValueError, match="NaN or Inf .* in slice 1"):
        c.check()
