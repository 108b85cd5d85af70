"""The same-rank boundary (engine/runtime/ranks/transport/local_link.py) in one process: what one
stage hands over the other receives as it was sent (the local executor's hand-over), the
handshake's Signature, an error passed on in place of an activation, a receive before its
send refused by name; and the placement map (engine/runtime/exec/placement.py) of the V."""

from __future__ import annotations

import pytest
import torch

from engine.errors import PeerError, PipelineInputError
from engine.runtime.exec.placement import RankPlacement
from engine.runtime.ranks.transport.local_link import LocalLink
from engine.schedule import zbv
from engine.schedule.spec import resolve_schedule


def _link() -> LocalLink:
    return LocalLink(1, [0, 1, 1, 0], torch.device("cpu"), 5.0, "gloo")


def test_hand_over_keeps_the_value_and_its_graph() -> None:
    link = _link()
    x = torch.randn(3, 2, requires_grad=True)
    y = x * 2  # with its graph, as the local executor passes it on
    link.down.send("act", 1, 0, y)
    assert link.down.held() == 1 and link.up.held() == 0
    got = link.up.recv("act", 2, 0)
    assert got is y and link.down.held() == 0
    g = [torch.ones(3, 2)]
    link.up.send("grad", 2, 0, g)
    assert link.down.recv("grad", 1, 0) is g


def test_handshake_signature_and_shape_check() -> None:
    link = _link()
    with pytest.raises(PeerError, match="before that stage announced"):
        link.up.recv_meta("act")
    link.down.send_meta("act", torch.zeros(4, 2))
    sig = link.up.recv_meta("act")
    assert sig is not None and [m.shape for _, m in sig.metas(False)] == [(4, 2)]
    seen = []
    link.up.accept = lambda old, new, mb: seen.append(mb) or ("too long" if mb == 2 else "")
    link.down.send("act", 1, 0, torch.zeros(4, 2))
    link.up.recv("act", 2, 0)
    assert seen == []  # the handshake's shapes: no dry run
    link.down.send("act", 1, 1, torch.zeros(5, 2))
    link.up.recv("act", 2, 1)
    link.down.send("act", 1, 2, torch.zeros(6, 2))
    onward = []
    link.up.onward = type("Down", (), {"poison": lambda self, m: onward.append(m)})()
    with pytest.raises(PipelineInputError, match="too long"):
        link.up.recv("act", 2, 2)
    assert seen == [1, 2] and onward == ["too long"]


def test_error_in_place_of_an_activation_and_receive_before_send() -> None:
    link = _link()
    onward = []
    link.up.onward = type("Down", (), {"poison": lambda self, m: onward.append(m)})()
    link.down.poison("stage 0 cannot take it")
    with pytest.raises(PipelineInputError, match="stage 0 cannot take it"):
        link.up.recv("act", 2, 0)
    assert onward == ["stage 0 cannot take it"]
    with pytest.raises(PeerError, match="before that stage sent it"):
        link.up.recv("act", 2, 1)


def test_placement_of_the_v() -> None:
    spec = resolve_schedule(zbv(2, 4), stages=4, chunks=None)
    place = RankPlacement.of(spec)
    assert place.owner == (0, 1, 1, 0) and place.held(0) == [0, 3] and place.held(1) == [1, 2]
    assert (place.first, place.last) == (0, 0) and not place.round_robin
    assert [place.same_rank(b) for b in range(3)] == [False, True, False]
