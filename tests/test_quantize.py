"""Stochastic rounding onto the table and b-bit packing, numpy and torch."""
import numpy as np
import pytest
import torch

from thc.codec.packing import pack_bits, packed_size, unpack_bits
from thc.codec.quantize import dequantize, quantize, stochastic_round, to_grid, uniforms
from thc.codec.table import optimal_table, uniform_table
from thc.wire import protocol

TABLE = optimal_table(4, 30, 1 / 32)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 2, 7, 8, 1001])
def test_pack_round_trip_bit_exact(bits, count):
    rng = np.random.default_rng(bits * 1000 + count)
    idx = rng.integers(0, 1 << bits, size=count).astype(np.uint8)
    packed = pack_bits(idx, bits)
    assert packed.dtype == np.uint8 and packed.size == packed_size(count, bits)
    assert np.array_equal(unpack_bits(packed, bits, count), idx)
    packed_t = pack_bits(torch.from_numpy(idx), bits)
    assert np.array_equal(packed_t.numpy(), packed)
    assert np.array_equal(unpack_bits(packed_t, bits, count).numpy(), idx)
    if count:
        bitstring = "".join(format(int(v), f"0{bits}b") for v in idx)
        bitstring += "0" * (-len(bitstring) % 8)
        expect = [int(bitstring[i:i + 8], 2) for i in range(0, len(bitstring), 8)]
        assert packed.tolist() == expect


def test_four_bit_packing_is_the_wire_format():
    idx = np.random.default_rng(0).integers(0, 16, 512).astype(np.uint8)
    wire = (idx[0::2] << 4) | idx[1::2]          # protocol.md: first index in the high nibble
    assert np.array_equal(pack_bits(idx, 4), wire)
    data_bytes = protocol.payload_bytes(protocol.PktType.DATA, 512)
    assert pack_bits(idx, protocol.INDEX_BITS).size == data_bytes
    assert np.array_equal(unpack_bits(wire, 4, 512), idx)


def test_pack_errors():
    with pytest.raises(ValueError, match="fit in 3 bits"):
        pack_bits(np.array([8], np.uint8), 3)
    with pytest.raises(ValueError, match="fit in 2 bits"):
        pack_bits(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="need 2 bytes"):
        unpack_bits(np.zeros(3, np.uint8), 4, 4)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(np.zeros(2, np.uint8), 9)


def test_to_grid_truncates_and_maps():
    z = np.array([-10.0, -2.0, 0.0, 1.0, 10.0], np.float32)
    u = to_grid(z.copy(), 2.0, 30)
    assert np.allclose(u, [0.0, 0.0, 15.0, 22.5, 30.0])
    ut = to_grid(torch.from_numpy(z), 2.0, 30)
    assert np.allclose(ut.numpy(), u)


def test_table_points_round_deterministically():
    u = TABLE.astype(np.float32)
    for r in (0.0, 0.5, 0.999999):
        rand = np.full(u.shape, r, np.float32)
        assert np.array_equal(stochastic_round(u.copy(), TABLE, rand), np.arange(16))


@pytest.mark.parametrize("table", [TABLE, uniform_table(4, 30), optimal_table(2, 6, 1 / 32),
                                   optimal_table(8, 300, 1 / 256)])
def test_rounding_is_unbiased(table):
    """For each u, E[T[index]] = u: the mean over K draws is within 5 standard errors, the
    standard error computed from the exact rounding variance (u - a)(b - u)."""
    g = int(table[-1])
    u0 = np.linspace(0, g, 97).astype(np.float32)
    k = 20000
    u = np.repeat(u0[None, :], k, axis=0)
    rng = np.random.default_rng(7)
    idx = stochastic_round(u.copy(), table, rng.random(u.shape, dtype=np.float32))
    assert idx.dtype == np.uint8 and idx.max() < table.size
    vals = table[idx].astype(np.float64)
    j = np.clip(np.searchsorted(table, u0, side="right") - 1, 0, table.size - 2)
    a, b = table[j], table[j + 1]
    assert np.all((vals == a) | (vals == b))
    var = (u0 - a) * (b - u0)
    se = np.sqrt(var / k) + 1e-6
    assert np.all(np.abs(vals.mean(axis=0) - u0) <= 5 * se)
    assert np.allclose(vals.var(axis=0), var, atol=0.05 * max(var.max(), 1e-3))


def test_numpy_and_torch_round_identically():
    rng = np.random.default_rng(3)
    u = rng.uniform(0, 30, 1 << 16).astype(np.float32)
    rand = rng.random(u.shape, dtype=np.float32)
    a = stochastic_round(u.copy(), TABLE, rand)
    b = stochastic_round(torch.from_numpy(u.copy()), TABLE, torch.from_numpy(rand))
    assert np.array_equal(a, b.numpy())


def test_quantize_and_dequantize():
    z = np.random.default_rng(4).standard_normal(1 << 15).astype(np.float32)
    idx = quantize(z, TABLE, 2.1539, 30, generator=5)
    assert np.array_equal(idx, quantize(torch.from_numpy(z), TABLE, 2.1539, 30, 5).numpy())
    zhat = dequantize(idx, TABLE, 2.1539, 30)
    assert np.allclose(dequantize(torch.from_numpy(idx), TABLE, 2.1539, 30).numpy(), zhat)
    err = np.mean((zhat - z) ** 2)
    print(f"z-domain MSE of one quantization: {err:.5f}")
    assert 0.015 < err < 0.026


def test_uniforms_sources():
    like = torch.zeros(1)
    a = uniforms((4, 5), like, np.random.default_rng(1))
    b = uniforms((4, 5), np.zeros(1), np.random.default_rng(1))
    assert np.array_equal(a.numpy(), b)
    c = uniforms((1000,), like, torch.Generator().manual_seed(0))
    assert c.dtype == torch.float32 and 0 <= float(c.min()) and float(c.max()) < 1
    with pytest.raises(TypeError):
        uniforms((3,), np.zeros(1), None)


def _grid_points(g: int, table, n: int = 4000):
    """u on [0, g]: random, each table value, its neighbours one float32 step away, 0, g."""
    rng = np.random.default_rng(g % 1000)
    t = np.asarray(table, dtype=np.float64)
    u = np.concatenate([rng.random(n) * g, t, np.nextafter(t.astype(np.float32), np.float32(0)),
                        np.nextafter(t.astype(np.float32), np.float32(g)), [0.0, g]])
    return np.clip(u, 0, g).astype(np.float32)


def test_a_large_granularity_is_rounded_by_searching_the_table_with_the_same_result(
        monkeypatch):
    """Per-step tables of g entries took 8 GiB at g = 2^30 (the OOM killer ended the process
    where the compiled codec takes a few MB): above LUT_LIMIT floor(u) is searched in the
    table. Here both ways round the same u with the same draws, numpy and torch alike."""
    from thc.codec import quantize as q
    table = tuple(int(v) for v in optimal_table(4, 30, 1 / 32))
    u = _grid_points(30, table)
    rand = uniforms(u.shape, u, np.random.default_rng(5))
    by_lut = stochastic_round(u.copy(), table, rand)
    monkeypatch.setattr(q, "LUT_LIMIT", 16)
    for like in (np.asarray, torch.from_numpy):
        searched = stochastic_round(like(u.copy()), table, like(rand.copy()))
        np.testing.assert_array_equal(np.asarray(searched), by_lut)
    monkeypatch.setattr(q, "segments", None)   # no per-step tables above the limit
    for like in (np.asarray, torch.from_numpy):
        searched = stochastic_round(like(u.copy()), table, like(rand.copy()))
        np.testing.assert_array_equal(np.asarray(searched), by_lut)


@pytest.mark.parametrize("g", [(1 << 30), (1 << 31) - 1])
def test_the_reference_codec_takes_a_large_uniform_table_as_the_compiled_one(g):
    from thc.codec.fastcodec import available
    from thc.codec.params import THCParams
    from thc.codec.thc import THCCodec
    if not available():
        pytest.skip("the compiled codec is not built")
    p = THCParams(slice_size=256, granularity=g, table_kind="uniform")
    x = torch.randn(700, generator=torch.Generator().manual_seed(1))
    ref, comp = THCCodec(p, backend="reference"), THCCodec(p, backend="compiled")
    m = ref.norms(x)
    a, b = ref.encode(x, m, round=3, generator=2), comp.encode(x, m, round=3, generator=2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_table_that_does_not_end_at_the_granularity_is_refused():
    """The grid was scaled to the granularity and the rounding to the table's top: a table
    ending at 30 under granularity 60 estimated 0.5 as 0."""
    with pytest.raises(ValueError, match="granularity 60 ends at it, got one ending at 30"):
        quantize(np.full(8, 0.5, np.float32), TABLE, 2.1539, 60, generator=5)
    with pytest.raises(ValueError, match="ending at 30"):
        dequantize(np.zeros(4, np.uint8), TABLE, 2.1539, 60)


def test_zero_bits_are_refused_as_a_width():
    """A width of 0 passed the 1..8 check's lower end only by luck of the caller: it ran into
    8 % 0 (a ZeroDivisionError) instead of the width's ValueError."""
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        pack_bits(np.zeros(2, np.uint8), 0)
    with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
        unpack_bits(np.zeros(0, np.uint8), 0, 0)


def test_a_packed_value_of_256_is_not_a_byte():
    """256 is the first value a cast to uint8 wraps (to 0): the range check's top is 255."""
    for packed in (np.array([256, 0], np.int16), torch.tensor([256, 0], dtype=torch.int16)):
        with pytest.raises(ValueError, match="are not bytes"):
            unpack_bits(packed, 4, 4)
    assert unpack_bits(np.array([255, 0], np.int16), 4, 4).tolist() == [15, 15, 0, 0]


def test_a_bool_tensor_is_not_packed_bytes():
    """A bool tensor would be cast to bytes 0/1 and unpacked as such; numpy's bool is refused
    by its kind, torch's by its dtype."""
    for packed in (torch.ones(2, dtype=torch.bool), np.ones(2, bool)):
        with pytest.raises(TypeError, match="packed indices are bytes"):
            unpack_bits(packed, 4, 4)


@pytest.mark.parametrize("table", [[0], [0, 15, 15, 30], [1, 15, 30], list(range(257))],
                         ids=["one-entry", "repeated", "not-from-0", "257-entries"])
def test_a_table_that_is_not_2_to_256_increasing_integers_from_0_is_refused(table):
    """Each breaks the rounding: a repeated value is a zero-width segment (0/0), a table not
    from 0 leaves u below T[0] without a lower neighbour, and a 257th entry's index 256 does
    not fit the uint8 indices (it wraps to 0)."""
    u = np.linspace(0, table[-1], 9).astype(np.float32)
    with pytest.raises(ValueError, match="2..256 strictly increasing integers from 0"):
        stochastic_round(u, table, np.zeros(u.shape, np.float32))


def test_table_points_round_deterministically_in_torch():
    """As in numpy: u on a table value gives its index even when the draw is 0 (the step is
    taken when r < (u - T[j]) / width, strictly)."""
    u = torch.from_numpy(TABLE.astype(np.float32))
    for r in (0.0, 0.5, 0.999999):
        rand = torch.full(u.shape, r, dtype=torch.float32)
        assert stochastic_round(u.clone(), TABLE, rand).tolist() == list(range(16))
