"""Telling a rank that lost its peer from a rank whose own code failed."""

from __future__ import annotations

import torch.distributed as dist

from training.distributed import lost_peer


def test_a_collective_that_lost_its_peer_is_a_lost_peer() -> None:
    gloo = RuntimeError(
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19862: Connection reset by peer. GLHF!"
    )
    assert lost_peer(gloo)
    assert lost_peer(dist.DistNetworkError("store went away"))


def test_an_error_in_model_code_is_not() -> None:
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"))
    assert not lost_peer(ValueError("injected fault at step 2"))
