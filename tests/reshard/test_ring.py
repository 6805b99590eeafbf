"""The ring of reused memory: tensors never overlap while held, and a full ring makes the reader wait."""

import threading

import pytest
import torch

from pipeline.reshard.ring import TensorRing


def _take_in_thread(ring, n):
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("t", ring.take((n,), torch.uint8)), daemon=True)
    t.start()
    return t, got


def test_a_wrapped_ring_that_is_exactly_full_admits_nothing_until_a_release():
    ring = TensorRing(1024)
    a = ring.take((512,), torch.uint8)
    b = ring.take((512,), torch.uint8)
    a.fill_(1), b.fill_(2)
    ring.release()  # a
    c = ring.take((512,), torch.uint8)  # wraps into a's place: the ring is full again
    c.fill_(3)
    waiter, got = _take_in_thread(ring, 64)
    waiter.join(0.2)
    assert waiter.is_alive() and bool((b == 2).all())  # b is still held and intact
    ring.release()  # b
    waiter.join(2)
    assert not waiter.is_alive()
    got["t"].fill_(4)
    assert bool((c == 3).all())


def test_tensors_are_aligned_views_of_the_requested_shape_and_dtype():
    ring = TensorRing(4096)
    x = ring.take((3, 5), torch.float32)
    y = ring.take((7,), torch.bfloat16)
    assert x.shape == (3, 5) and x.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert x.data_ptr() % 64 == 0 and y.data_ptr() % 64 == 0
    with pytest.raises(ValueError, match="does not fit a ring"):
        ring.take((5000,), torch.uint8)


def test_stop_releases_a_waiting_reader():
    ring = TensorRing(128)
    ring.take((128,), torch.uint8)
    waiter, got = _take_in_thread(ring, 64)
    ring.stop()
    waiter.join(2)
    assert not waiter.is_alive() and got["t"] is None
