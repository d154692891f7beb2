"""varunad.cluster.membership against a real etcd: registration, keepalive, expiry, leave.

The in-process tests of tests/integration/test_membership.py (tests/README.md).
"""

from __future__ import annotations

import pytest
from support.fleet import make_member

from varunad.cluster.membership import Member


def test_member_encoding_round_trips_and_tolerates_new_fields():
    member = make_member("vm-7", slots=8, memory_bytes=141 << 30)
    assert Member.decode(member.encode()) == member
    newer = member.encode()[:-1] + b',"numa_nodes":2}'
    assert Member.decode(newer) == member
    with pytest.raises(ValueError, match="lacks"):
        Member.decode(b'{"name": "x"}')
    with pytest.raises(ValueError, match="slots"):
        make_member("bad", slots=-1)
    with pytest.raises(ValueError, match="slashes"):
        make_member("a/b")


