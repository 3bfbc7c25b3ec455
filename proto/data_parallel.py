"""The data-parallel handshake: an engine started on another host (`kvflow serve
--headless`) tells the frontend's host where its sockets are.

    headless host                                   frontend host
    DEALER ── EngineJoin(index, addresses) ──▶ ROUTER  tcp://<dp address>:<dp rpc port>
           ◀── EngineJoined(accepted, reason) ─┘
"""

from __future__ import annotations

import msgspec


class EngineJoin(msgspec.Struct, tag=True):
    """Engine `index` is ready; `addresses` maps each channel to its tcp endpoint."""

    index: int
    addresses: dict[str, str]
    data_parallel_size: int  # as the headless host was told: both sides must agree


class EngineJoined(msgspec.Struct, tag=True):
    accepted: bool
    reason: str = ""


DataParallelMessage = EngineJoin | EngineJoined
