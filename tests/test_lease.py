"""A worker's lease on its own (a fake clock): who may call, when it expires, what its end frees, and that its secret
cannot be replayed from what errors say."""

from __future__ import annotations

import asyncio

import pytest

from minedraft.errors import LeaseError, LeaseSecretError
from minedraft.rpc.lease import Leases, Presented


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
        lease = await leases.take("a", 0, give_up=False, secret="sa")
        assert (lease.owner, lease.epoch, lease.ttl_s) == ("a", 1, 5.0)
        leases.check(Presented("a", 1, "sa"))
        for ticket in (None, Presented("a", 2, "sa"), Presented("b", 1, "sa"), Presented("a", 1, "sb")):
            with pytest.raises(LeaseError, match="holds this worker's lease"):
                leases.check(ticket)
        with pytest.raises(LeaseError, match="a second coordinator is refused"):
            await leases.take("b", 0, give_up=False, secret="sb")
        with leases.held(Presented("a", 1, "sa")):  # a call longer than the lease (a Prepare) keeps it
            clock.now += 60
            assert leases.live
        clock.now += 4.9
        assert leases.live  # renewed when the call ended
        clock.now += 0.2
        assert not leases.live
        with pytest.raises(LeaseError, match="expired"):
            leases.check(Presented("a", 1, "sa"))
        lease = await leases.take("b", 0, give_up=False, secret="sb")  # what "a" held is freed first
        assert (lease.owner, lease.epoch, freed) == ("b", 2, [clock.now])
        await leases.take("a", 2, give_up=True, secret="sa")  # not a's to give up: nothing happens
        assert leases.owner == "b" and len(freed) == 1
        await leases.take("b", 2, give_up=True, secret="sb")
        assert leases.owner is None and len(freed) == 2
        lease = await leases.take("a", 0, give_up=False, secret="sa")  # at once after a give-up
        assert lease.epoch == 3 and len(freed) == 2

    asyncio.run(main())


def test_owner_and_epoch_without_the_secret_change_nothing() -> None:
    """What a refused call's error says (the owner) and a guessed epoch, sent back without the secret: no call is
    served, the lease is neither renewed, given up nor taken again, nothing is freed, and no error repeats the
    secret or the epoch."""
    clock, freed = Clock(), []

    async def free_all() -> int:
        freed.append(clock.now)
        return 3

    async def main() -> None:
        leases = Leases(5.0, free_all, clock)
        await leases.take("coord", 0, give_up=False, secret="the-secret")
        errors = []
        for epoch in (0, 1, 2):
            for secret in ("", "the-secreT", "x"):
                with pytest.raises(LeaseError) as refused:
                    leases.check(Presented("coord", epoch, secret))
                errors.append(str(refused.value))
                await leases.take("coord", epoch, give_up=True, secret=secret)
                if epoch:
                    with pytest.raises(LeaseError) as refused:
                        await leases.take("coord", epoch, give_up=False, secret=secret)  # a renewal
                    errors.append(str(refused.value))
                else:
                    with pytest.raises(LeaseError, match="a second coordinator is refused") as refused:
                        await leases.take("coord", 0, give_up=False, secret=secret)  # taken again
                    errors.append(str(refused.value))
        assert (leases.owner, leases.epoch, freed) == ("coord", 1, [])
        leases.check(Presented("coord", 1, "the-secret"))  # the owner's own calls go on
        assert all("the-secret" not in e and "epoch" not in e and "coord 1" not in e for e in errors), errors
        assert "coordinator coord holds this worker's lease" in errors[0]  # who holds it, for an operator

    asyncio.run(main())


def test_a_deployment_secret_leases_to_its_holders_alone() -> None:
    async def free_all() -> int:
        return 0

    async def main() -> None:
        leases = Leases(5.0, free_all, Clock(), deployment_secret="deploy")
        for secret in ("", "deplo", "deploy "):
            with pytest.raises(LeaseSecretError, match="MINEDRAFT_LEASE_SECRET"):
                await leases.take("rogue", 0, give_up=False, secret=secret)
        assert leases.owner is None
        lease = await leases.take("coord", 0, give_up=False, secret="deploy")
        assert lease.epoch == 1
        leases.check(Presented("coord", 1, "deploy"))

    asyncio.run(main())
