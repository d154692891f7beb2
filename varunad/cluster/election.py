"""Leader election with fencing, in Patroni's pattern.

* Take leadership with a create-if-absent transaction on the ``leader`` key, attached to the
  member's own lease: if the leader dies, its lease and with it the key vanish within one TTL.
* Believe it only while ``membership.lease_deadline > clock()``. The deadline is the earliest
  moment etcd may expire the lease, so a leader whose renewals fail stops acting as leader
  before anyone else can be elected. No wall clock is involved.
* Write as leader only through a transaction guarded by the leader key still holding this
  member's name *and term* (the key's create revision, also its mod revision: the key is never
  rewritten, so its lease cannot have changed either). A deposed leader, even one whose own sense
  of time is wrong, cannot overwrite the plan of its successor.
* The plan is written with a :class:`PlanWriter` record (name, term, lease) at ``plan-writer`` in
  that same transaction, so a reader can tell a leader's plan from one put by anyone else
  (``varunad.control.fleet.read_plan`` checks it against the leader key).
* Non-leaders watch the leader key and contend as soon as it is deleted or expires.

Every cycle decides from one read of the leader key and records an immutable
:class:`ElectionState` whose ``describe()`` says in one sentence what was decided and why.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

from varunad.cluster.membership import Membership
from varunad.store import schemas
from varunad.store.contract import Key, KeyValue, Store, StoreError, Value, Watch
from varunad.store.keys import Keys

__all__ = ["Role", "ElectionState", "Election", "NotLeader", "PlanWriter"]

log = logging.getLogger(__name__)


class NotLeader(StoreError):
    """This member does not (or no longer) lead; the write was not made."""


class Role(str, enum.Enum):
    LEADER = "leader"
    FOLLOWER = "follower"


@dataclass(frozen=True, slots=True, kw_only=True)
class ElectionState:
    """What one member concluded about leadership, and why."""

    name: str  # this member
    role: Role
    leader: str | None  # who leads as far as this member knows; None when unknown or vacant
    term: int | None  # create revision of the leader key: changes with every new leadership
    reason: str  # completes "because ..."

    @property
    def is_leader(self) -> bool:
        return self.role is Role.LEADER

    def describe(self) -> str:
        if self.role is Role.LEADER:
            return f"{self.name} leads (term {self.term}) because {self.reason}."
        return f"{self.name} follows {self.leader or 'no one'} because {self.reason}."


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanWriter:
    """Who wrote the plan: the leader's name, its term (the leader key's create revision) and the
    lease the leader key was on. Written at ``plan-writer`` in the plan's own transaction, so both
    keys have the same mod revision; a plan put by anyone else (``etcdctl put .../plan ...``, even
    a copy of a real plan) has no record of its revision."""

    name: str
    term: int
    lease: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> PlanWriter:
        return schemas.decode(cls, data, "plan-writer record")

    def held(self, leader: KeyValue | None) -> bool:
        """Whether ``leader`` (the leader key as read, at some revision) is this writer's leadership."""
        return (leader is not None and leader.value == self.name.encode() and leader.create_revision == self.term
                and leader.lease == self.lease)


class Election:
    """Contend for and hold leadership for one :class:`Membership`.

    ``run()`` is the loop (an asyncio task); ``run_once()`` is one cycle, for tests and for
    callers with their own loop. ``on_change`` is called with the new state whenever the role
    or the known leader changes, including the moment the lease deadline passes.
    """

    def __init__(
        self,
        store: Store,
        keys: Keys,
        membership: Membership,
        *,
        loop_wait: float | None = None,
        on_change: Callable[[ElectionState], None] | None = None,
    ) -> None:
        self.store = store
        self.keys = keys
        self.membership = membership
        self.clock = membership.clock
        # Patroni's rule of thumb: a cycle (and any call in it) well within the TTL.
        self.loop_wait = membership.ttl / 3 if loop_wait is None else float(loop_wait)
        if not 0 < self.loop_wait < membership.ttl:
            raise ValueError(f"loop_wait {self.loop_wait}s must be positive and below the TTL {membership.ttl}s")
        self._on_change = on_change
        self._lease_id: int | None = None  # lease the leader key was created with, while leading
        self._suspect: tuple[int, int] | None = None  # a leader key whose lease matched no member once
        self._vouched: tuple[int, int] | None = None  # a leader key found on its holder's member lease
        self._state = ElectionState(
            name=membership.name, role=Role.FOLLOWER, leader=None, term=None, reason="it has not run yet"
        )

    @property
    def name(self) -> str:
        return self.membership.name

    @property
    def state(self) -> ElectionState:
        """The last decision, demoted on the spot if the lease deadline has passed since."""
        self._step_down_if_lease_lapsed()
        return self._state

    def _step_down_if_lease_lapsed(self) -> None:
        if self._state.role is Role.LEADER and not self._lease_holds():
            self._decide(Role.FOLLOWER, None, None,
                         "my lease deadline passed without a renewal, so I stopped before anyone "
                         "else could be elected")

    def is_leader(self) -> bool:
        return self.state.is_leader

    def _lease_holds(self) -> bool:
        lease = self.membership.lease
        return (
            lease is not None
            and lease.id == self._lease_id
            and self.membership.lease_deadline > self.clock()
        )

    def _time_left(self) -> float:
        return self.membership.lease_deadline - self.clock()

    def _decide(self, role: Role, leader: str | None, term: int | None, reason: str) -> ElectionState:
        old = self._state
        if role is not Role.LEADER:
            self._lease_id = None
        self._state = ElectionState(name=self.name, role=role, leader=leader, term=term, reason=reason)
        if (old.role, old.leader, old.term) != (role, leader, term):
            log.info("%s", self._state.describe())
            if self._on_change is not None:
                self._on_change(self._state)
        else:
            log.debug("%s", self._state.describe())
        return self._state

    # -- one cycle

    async def run_once(self) -> ElectionState:
        """Read the leader key once and decide: keep leading, take the vacant key, or follow."""
        self._step_down_if_lease_lapsed()  # a lapsed leader says so in those words first
        lease = self.membership.lease
        left = self._time_left()
        if lease is None or left <= 0:
            return self._decide(Role.FOLLOWER, None, None,
                                "my own lease may have expired, so I do not contend until it is renewed")
        was_leader = self.state.is_leader
        # No call may outlive the lease deadline: past it, any answer is too late to act on.
        timeout = min(self.loop_wait, left)
        try:
            current = await self.store.get(self.keys.leader, timeout=timeout)
            if current is None:
                # A create-if-absent (absent keys have mod revision 0) that also returns the
                # revision of the creation: our term.
                term = await self.store.compare_and_swap(
                    self.keys.leader, self.name, mod_revision=0, lease=lease,
                    timeout=min(self.loop_wait, self._time_left()),
                )
                if term is None:
                    return self._decide(Role.FOLLOWER, None, None,
                                        "another member took the vacant leader key first")
                self._lease_id = lease.id
                return self._decide(Role.LEADER, self.name, term,
                                    f"the leader key was vacant and I created it at revision {term}")
        except StoreError as exc:
            if was_leader and self._lease_holds():
                return self._decide(Role.LEADER, self.name, self._state.term,
                                    f"etcd did not answer ({exc.__class__.__name__}) but my lease is "
                                    f"certain for {self._time_left():.1f}s more")
            if was_leader:
                return self._decide(Role.FOLLOWER, None, None,
                                    "etcd did not answer before my lease deadline passed, so I stopped "
                                    "before anyone else could be elected")
            return self._decide(Role.FOLLOWER, None, None, f"etcd did not answer: {exc}")

        holder = current.value.decode(errors="replace")
        if self._time_left() <= 0:  # the answer came too late to build on
            return self._decide(Role.FOLLOWER, None, None,
                                "my lease deadline passed while I read the leader key, so I stopped "
                                "before anyone else could be elected")
        if holder == self.name and current.lease == lease.id:
            self._lease_id = lease.id
            return self._decide(Role.LEADER, self.name, current.create_revision,
                                f"I hold the leader key and my lease is certain for {self._time_left():.1f}s")
        if holder == self.name and current.lease != 0:
            return self._decide(Role.FOLLOWER, None, None,
                                f"the leader key holds my name under an earlier lease {current.lease:x}, "
                                "which must expire before anyone can lead")
        bogus = await self._bogus(current, holder, timeout)
        if bogus is not None:
            return self._decide(Role.FOLLOWER, None, None, bogus)
        return self._decide(Role.FOLLOWER, holder, current.create_revision,
                            f"{holder} holds the leader key")

    async def _bogus(self, current: KeyValue, holder: str, timeout: float) -> str | None:
        """Why the leader key is no leader's (and was removed), or None when it may be one.

        A leader key lives on its holder's member lease, so that it vanishes with the holder. A key
        with no lease (``etcdctl put .../leader x``) never would, and one on a lease that is not
        the named member's would outlive it: either would leave the fleet leaderless for good. Such
        a key is deleted (only if unchanged) so that the members contend again. A member whose
        key is missing for a moment (it is re-registering it) is given one more cycle."""
        why = None
        if current.lease == 0:
            why = "it has no lease, so it would never expire"
        elif self._vouched == (current.create_revision, current.lease):
            # Checked once for this key: it lives on its holder's lease and goes with it (a holder
            # registering anew leaves it on the old lease, which ends within a TTL). Reading the
            # member key every cycle was half of a big fleet's election reads.
            return None
        else:
            try:
                member = await self.store.get(self.keys.member(holder), timeout=timeout)
            except StoreError:
                return None  # cannot tell now; decide next cycle
            except ValueError:
                member = None  # the holder cannot even be a member name
            if member is None or member.lease != current.lease:
                suspect = (current.create_revision, current.lease)
                if self._suspect != suspect:
                    self._suspect = suspect
                    return None
                why = (f"its lease {current.lease:x} is not the lease of a member named {holder!r}, "
                       "so it would outlive its holder")
        self._suspect = None
        if why is None:
            self._vouched = (current.create_revision, current.lease)
            return None
        try:
            removed = await self.store.delete_if(self.keys.leader, value=current.value, timeout=timeout)
        except StoreError:
            removed = False
        log.warning("%s: the leader key (%r) is no leader's: %s; %s", self.name, holder, why,
                    "deleted it" if removed else "could not delete it yet")
        return f"the leader key naming {holder!r} is no leader's ({why})"

    # -- the loop

    async def run(self) -> None:
        """Run cycles until cancelled: after each, wait for a change of the leader key, the
        lease deadline (when leading) or ``loop_wait`` (the TTL for a follower whose watch
        runs), whichever comes first."""
        watch: Watch | None = None
        try:
            while True:
                if watch is None:
                    watch = await self._start_watch()
                state = await self.run_once()
                wait = self.loop_wait
                if state.is_leader:
                    wait = min(wait, max(self._time_left(), 0.0) + 0.01)
                elif watch is not None and state.leader is not None:
                    # A follower hears of the leader key's change from the watch; reading the key
                    # again every loop_wait would be most of a big fleet's etcd load at rest (300
                    # VMs: 150 reads/s). A watch gone silent (a frozen etcd) costs a TTL at most.
                    wait = self.membership.ttl
                if watch is None:
                    await asyncio.sleep(wait)
                    continue
                try:
                    await watch.next(timeout=wait)
                except StoreError as exc:
                    log.debug("%s: leader watch broke (%s); starting another", self.name, exc)
                    await watch.cancel()
                    watch = None
                # A leader whose deadline passed while waiting must say so now, not next cycle.
                self._step_down_if_lease_lapsed()
        finally:
            if watch is not None:
                await watch.cancel()

    async def _start_watch(self) -> Watch | None:
        # Started before the cycle reads the key, so no change between read and watch is missed.
        watch = self.store.watch(self.keys.leader)
        try:
            return await watch.start(timeout=self.loop_wait)
        except StoreError as exc:
            log.debug("%s: cannot watch the leader key yet (%s)", self.name, exc)
            return None

    # -- acting as leader

    async def write_as_leader(self, key: Key, value: Value) -> int:
        """Write ``key`` only while this member leads; returns the write's revision (the epoch).

        Raises NotLeader when this member does not lead or etcd refuses the guarded write
        (another member leads now). StoreError when etcd did not answer: the write may or may
        not have happened, and this member may still lead; read the key back to know.
        """
        return await self._write(key, value)

    async def write_plan(self, value: Value) -> int:
        """Write the plan and its :class:`PlanWriter` record in one guarded transaction; returns
        the epoch. Raises as :meth:`write_as_leader`."""
        return await self._write(self.keys.plan, value, plan_writer=True)

    async def _write(self, key: Key, value: Value, *, plan_writer: bool = False) -> int:
        what = repr(key)
        state = self.state
        if not state.is_leader:
            raise NotLeader(f"{self.name} will not write {what}: {state.describe()}",
                            hint="only the leader writes; followers read the plan from etcd")
        items = [(key, value)]
        if plan_writer:
            writer = PlanWriter(name=self.name, term=state.term or 0, lease=self._lease_id or 0)
            items.append((self.keys.plan_writer, writer.encode()))
        # mod revision == term: the leader key was not rewritten since this member created it
        revision = await self.store.put_all_if(
            items, guard_key=self.keys.leader, guard_value=self.name,
            guard_create_revision=state.term, guard_mod_revision=state.term,
            timeout=min(self.loop_wait, self._time_left()),
        )
        if revision is None:
            self._decide(Role.FOLLOWER, None, None,
                         f"etcd refused a write guarded by my term {state.term}, so my leadership ended")
            raise NotLeader(f"{self.name} was deposed; {what} was not written",
                            hint="the new leader writes the next plan")
        return revision

    async def resign(self) -> None:
        """Give up leadership now (delete the leader key if it is still ours)."""
        if self._state.is_leader:
            try:
                await self.store.delete_if(self.keys.leader, value=self.name)
            except StoreError as exc:
                log.warning("%s: could not delete the leader key (%s); it expires with my lease",
                            self.name, exc)
        self._decide(Role.FOLLOWER, None, None, "I resigned")
