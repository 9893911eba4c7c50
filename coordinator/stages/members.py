"""A worker that joined, as the join listener keeps it, and what is said of it.

The listener (coordinator.stages.join) admits members, places them and follows
them; these are its plain records and the sentences its errors are made of.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from coordinator.plan.place import member_name, speed_view
from coordinator.stages.link import Link
from coordinator.stages.node import Node
from workers.protocol.messages import Offer
from workers.protocol.report import NodeReport


@dataclass(eq=False)
class Member:
    """One worker that joined, and the stage it builds or serves.

    offer: what it said it can hold, and where it serves.
    peer: where its join connection comes from.
    writer: its join connection.
    node: the stage it builds or serves; None while it waits.
    timer: ends its build when it takes too long.
    dropped: why the coordinator closed its connection, if it did.
    ticket: what its Assign carried; the worker at the address it offered must prove it holds it.
    link: its link to the coordinator as probed (None: it does not echo probes).
    why_spare: why the plan left it out, when it says.
    """

    offer: Offer
    peer: str
    writer: asyncio.StreamWriter
    joined_at: float = field(default_factory=time.time)
    node: Node | None = None
    timer: asyncio.TimerHandle | None = None
    dropped: str | None = None
    ticket: bytes = b""
    link: Link | None = None
    why_spare: str | None = None

    @property
    def name(self) -> str:
        return member_name(self.offer)

    def view(self, planned: bool) -> dict:
        """The member as /nodes shows it."""
        if self.node is not None:
            state = "building" if self.node.state == "building" else "holding"
        else:
            state = "spare" if planned else "waiting"
        offer = self.offer
        return {"addr": offer.addr, "peer": self.peer, "state": state,
                "stage": None if self.node is None else self.node.index, "model": offer.model,
                "precision": offer.precision, "memory_bytes": offer.memory_bytes, "cores": offer.cores,
                "pid": offer.pid, "joined_at": self.joined_at, "speed": speed_view(offer),
                "link": None if self.link is None else self.link.view(),
                "why_spare": self.why_spare if state == "spare" else None}  # fmt: skip


def someone_else(member: Member, addr: str, there: NodeReport) -> str:
    """Why the worker reached at the address a member offered is not that member."""
    return (
        f"the worker at {addr} cannot prove it is the one that joined from {member.peer} (it serves "
        f"layers {there.layers} of {there.model!r}, pid {there.pid}): start this worker with --advertise "
        "naming its own address (or, if that is its address, upgrade an rlx-worker older than join tickets)"
    )


def unlike(member: Member, node: Node, there: NodeReport) -> str | None:
    """How the stage the member serves differs from its assignment, or None."""
    if there.layers == node.layers and there.model == member.offer.model:
        return None
    return (
        f"the worker at {there.addr} serves layers {there.layers} of {there.model!r}, "
        f"it was assigned layers {node.layers} of {member.offer.model!r}"
    )


def waiting_for(joined: int, stages: int, plan_error: str | None = None) -> str:
    """Why the stages are vacant before the first plan."""
    why = f"waiting for workers to join: {joined} of {stages} have joined"
    return f"{why}; {plan_error}" if plan_error else why
