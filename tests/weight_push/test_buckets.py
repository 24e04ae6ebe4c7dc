"""The push's wire format: the same buckets from the metadata alone on both sides, and every
dtype back bit for bit."""

from __future__ import annotations

import pytest
import torch

from orchestrator.weight_push.buckets import ParamSpec, pack, plan_buckets, unpack


def specs_of(tensors: list[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    return [ParamSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors]


def tensors(dtype_of=lambda i: torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 3), (1,), (11, 4), (5,)]
    return [(f"t{i}", torch.randn(s, generator=g).to(dtype_of(i))) for i, s in enumerate(shapes)]


def test_a_bucket_closes_once_it_holds_more_than_the_size_and_a_big_tensor_travels_alone():
    specs = [ParamSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 100, 1, 1])]
    # 40 B, 40 B, 400 B, 4 B, 4 B with 64 B buckets: 80 > 64 closes [0, 1]; 400 alone; the rest
    assert plan_buckets(specs, 64) == [[0, 1], [2], [3, 4]]
    assert plan_buckets(specs, 10_000) == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError):
        plan_buckets(specs, 0)


@pytest.mark.parametrize("bucket_bytes", [1, 50, 200, 1 << 20])
@pytest.mark.parametrize("mixed", [False, True])
def test_what_is_packed_unpacks_bit_for_bit_from_the_wire_metadata(bucket_bytes, mixed):
    # mixed: bf16 and fp32 alternate, so fp32 tensors start at offsets that are not multiples of 4
    named = tensors((lambda i: torch.bfloat16 if i % 2 else torch.float32) if mixed else (lambda i: torch.float32))
    wire = [spec.wire() for spec in specs_of(named)]
    received = [ParamSpec.from_wire(*w) for w in wire]  # what the receiver knows: no tensor
    assert received == specs_of(named)
    out = []
    for bucket in plan_buckets(received, bucket_bytes):
        buffer = pack([named[i][1] for i in bucket]).clone()  # as it arrives: a buffer of its own
        assert buffer.dtype == torch.uint8 and buffer.numel() == sum(received[i].nbytes for i in bucket)
        out += list(unpack(buffer, [received[i] for i in bucket]))
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_bucket_whose_size_disagrees_with_its_tensors_is_refused():
    named = tensors()
    buffer = pack([t for _, t in named[:2]])
    with pytest.raises(ValueError):
        list(unpack(buffer, specs_of(named[:1])))
    with pytest.raises(ValueError):
        ParamSpec.from_wire("x", "float33", [1])
