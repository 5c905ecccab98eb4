"""API conventions, in-process: SparseRequest as concurrent.futures.Future, GradientReducer's
option messages, SparseVector's Python/numpy protocols, environment variables, the CLI."""

from __future__ import annotations

import threading

import pytest

from sparsecoll._progress import SparseRequest


def test_exception_waits_for_the_call_as_a_future_does():
    req = SparseRequest(1, "test call")
    with pytest.raises(TimeoutError, match="did not complete"):
        req.exception(timeout=0)  # pending: not None (which reads as a success)
    error = ValueError("bad input on rank 0")
    threading.Thread(target=req._finish, args=(None, error)).start()
    assert req.exception() is error  # (waits for the thread)
    ok = SparseRequest(2, "test call")
    ok._finish(3, None)
    assert ok.exception(timeout=0) is None and ok.result() == 3
