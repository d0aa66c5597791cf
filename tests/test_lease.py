"""A worker's lease on its own (a fake clock): who may call, when it expires, what its end frees."""

from __future__ import annotations

import asyncio

import pytest

from minedraft.errors import LeaseError
from minedraft.rpc.lease import Leases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_refuses_others_outlives_its_calls_and_frees_what_it_held_at_its_end() -> None:
    clock, freed = Clock(), []

    async def free_all() -> int:
        freed.append(clock.now)
        return 3

    async def main() -> None:
        leases = Leases(5.0, free_all, clock)
        lease = await leases.take("a", 0, give_up=False)
        assert (lease.owner, lease.epoch, lease.ttl_s) == ("a", 1, 5.0)
        leases.check(("a", 1))
        for ticket in (None, ("a", 2), ("b", 1)):
            with pytest.raises(LeaseError, match="holds this worker's lease"):
                leases.check(ticket)
        with pytest.raises(LeaseError, match="a second coordinator is refused"):
            await leases.take("b", 0, give_up=False)
        with leases.held(("a", 1)):  # a call longer than the lease (a Prepare) keeps it
            clock.now += 60
            assert leases.live
        clock.now += 4.9
        assert leases.live  # renewed when the call ended
        clock.now += 0.2
        assert not leases.live
        with pytest.raises(LeaseError, match="expired"):
            leases.check(("a", 1))
        lease = await leases.take("b", 0, give_up=False)  # what "a" held is freed first
        assert (lease.owner, lease.epoch, freed) == ("b", 2, [clock.now])
        await leases.take("a", 2, give_up=True)  # not a's to give up: nothing happens
        assert leases.owner == "b" and len(freed) == 1
        await leases.take("b", 2, give_up=True)
        assert leases.owner is None and len(freed) == 2
        lease = await leases.take("a", 0, give_up=False)  # at once after a give-up
        assert lease.epoch == 3 and len(freed) == 2

    asyncio.run(main())
