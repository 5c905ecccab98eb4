"""Inside torchrun (launched by tests/test_torchrun.py): the ``process_group`` fixture joins
every rank to the default process group (gloo), made on first use and ended after the
tests; ``comm`` is a TorchCommunicator of it. A test that makes its own default group
(the docs' examples) runs before any test that uses these fixtures in its file."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

PG_TIMEOUT = float(os.environ.get("SPARSECOLL_TORCHRUN_PG_TIMEOUT", "300"))


@pytest.fixture(scope="session")
def process_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    return dist.group.WORLD


@pytest.fixture(scope="session")
def comm(process_group):
    from sparsecoll.integrations.torch import TorchCommunicator

    return TorchCommunicator(process_group)


def pytest_unconfigure(config):
    if dist.is_initialized():
        dist.destroy_process_group()
