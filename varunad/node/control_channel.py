"""Where a daemon and its workers talk: a Unix socket in a private directory, secret identities.

The control socket carries progress (which becomes the job's step, loss and history) and the
daemon's stop and checkpoint requests. Over TCP on 127.0.0.1 any local process could connect,
report a step 10000 with loss 123.456, or take over ``rank-N`` with ROUTER_HANDOVER. Here:

* the socket is ``ipc://<dir>/control`` where ``<dir>`` is made by ``mkdtemp`` (mode 0700, owned
  by the daemon's user) in its state directory, so other users cannot even reach it;
* each worker gets a fresh random token in its environment (``VARUNA_CONTROL_TOKEN``, readable
  only by its own user) and uses ``rank-<r>-<token>`` as its ZeroMQ identity; the supervisor
  takes a report only from the identity of the current epoch's worker of that rank.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from trainer.engine.control import TOKEN_ENV, control_identity

__all__ = ["ControlChannel", "TOKEN_ENV", "control_identity", "new_token"]


def new_token() -> str:
    return secrets.token_hex(16)


_PREFIX = "varunad-ctl-"
_MAX_PATH = 100  # a Unix socket path holds at most 107 bytes


class ControlChannel:
    """A private directory for one daemon's control socket; ``close()`` removes it.

    Under ``parent`` (the daemon's state dir) when the socket path fits there, so that a daemon
    killed with -9 leaves nothing elsewhere (and the next start removes what it left); else under
    the temp dir."""

    def __init__(self, parent: str | os.PathLike[str] | None = None) -> None:
        if parent is not None:
            for old in Path(parent).glob(f"{_PREFIX}*"):  # left by an earlier incarnation killed with -9
                shutil.rmtree(old, ignore_errors=True)
            if len(os.path.join(os.fspath(parent), _PREFIX + "x" * 8, "control")) > _MAX_PATH:
                parent = None
        # mkdtemp: 0700 and owned by us, atomically (no window in which another user could enter
        # or pre-create it).
        self.directory = tempfile.mkdtemp(prefix=_PREFIX, dir=parent)
        st = os.stat(self.directory)
        if stat.S_IMODE(st.st_mode) != 0o700 or st.st_uid != os.getuid():
            raise OSError(f"{self.directory} is not a private directory (mode {stat.S_IMODE(st.st_mode):o})")
        self.path = os.path.join(self.directory, "control")
        self.endpoint = f"ipc://{self.path}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.directory)
