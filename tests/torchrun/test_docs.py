"""The docs' ``<!-- example: torchrun -->`` examples, each run as a script on every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ..docexamples import examples

TORCHRUN = examples("torchrun")


def test_the_examples_are_found():
    assert {ex.path.name for ex in TORCHRUN} == {"pytorch.md"}


@pytest.mark.parametrize("example", TORCHRUN, ids=[ex.id for ex in TORCHRUN])
def test_example_runs(example):
    assert not dist.is_initialized()  # (each example makes its own process group)
    try:
        example.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
