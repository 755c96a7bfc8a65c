"""The tag lanes of a SUM all-reduce (agreement.sum_tags): exact sums, and any other key or
collective told apart."""
from __future__ import annotations

import pytest
import torch

from thc.collective import agreement


def _tags(key: int, world: int) -> torch.Tensor:
    return agreement.sum_tags(key, world, torch.empty(agreement.sum_tag_lanes(world)))


def _summed(lanes: list[torch.Tensor]) -> torch.Tensor:
    """The workers' lanes added one by one in float32, as a ring all-reduce adds them."""
    out = torch.zeros_like(lanes[0])
    for lane in lanes:
        out += lane
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 16, 17, 1000, 1 << 20])
def test_workers_with_one_key_agree_exactly_at_any_world(world):
    """The largest lanes a key can hold, summed by every worker in float32, come out exact."""
    top = (1 << agreement.SUM_TAG_BITS) - 1   # every lane at its largest value
    lanes = _tags(top, world)
    assert float(lanes.max()) * world < 1 << 24
    assert agreement.sum_tags_agree(lanes * world, top, world)
    if world <= 17:
        assert agreement.sum_tags_agree(_summed([lanes] * world), top, world)


@pytest.mark.parametrize("bit", range(agreement.SUM_TAG_BITS))
def test_a_peer_with_a_key_one_bit_apart_is_told(bit):
    key = agreement.key_of("fp32 spans", 3)
    other = key ^ (1 << bit)
    summed = _summed([_tags(key, 2), _tags(other, 2)])
    assert not agreement.sum_tags_agree(summed, key, 2)
    assert not agreement.sum_tags_agree(summed, other, 2)


def test_a_peer_whose_collective_holds_other_values_is_told():
    """A peer's gradient values, or another collective's lanes, where this worker's tags are."""
    key = agreement.key_of("fp32 spans", 0)
    mine = _tags(key, 2)
    for theirs in (torch.randn(len(mine)), torch.zeros(len(mine)), mine + 0.5):
        assert not agreement.sum_tags_agree(mine + theirs, key, 2)


def test_a_world_whose_sums_cannot_be_exact_is_refused():
    with pytest.raises(ValueError, match="do not fit in float32"):
        _tags(1, (1 << 23) + 1)


def test_a_refused_input_stands_in_with_its_half_type_and_never_raises():
    """A stand-in of the input's half type keeps the round's key its half-type peers hold;
    a dtype that cannot be read made input_of raise, and that worker sent no round."""
    import numpy as np

    class Unreadable:
        @property
        def dtype(self):
            raise RuntimeError("no dtype")

        def __len__(self):
            return 4
    cases = [(np.zeros(4, np.float16), torch.float16),
             (np.zeros(4, ">f2"), torch.float16),
             (torch.empty(4, device="meta", dtype=torch.bfloat16), torch.bfloat16),
             (np.zeros(4), torch.float32), ([1.0, 2.0], torch.float32),
             (Unreadable(), torch.float32)]
    for obj, dtype in cases:
        stand_in, error = agreement.input_of(obj)
        assert error is not None and stand_in.dtype == dtype, (obj, stand_in.dtype)
        assert not stand_in.any()
