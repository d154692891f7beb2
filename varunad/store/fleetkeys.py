"""The daemon's keys beyond those of ``varunad.store.keys``: job state, bundles, worker reports, history, logs.

``varunad.store.keys.Keys`` names the keys of membership, election, plan, jobs, calibration and
progress. The daemon also keeps (under the same root)::

    bundles/<job>                       the job's script directory, zipped (written once by varunactl)
    signatures/<job>                    the submitter's signature of jobs/<job> (varunad.node.signing)
    state/<job>                         the job's state as the leader sees it (leader-written, fenced)
    cancel/<job>                        a cancel request (varunactl)
    workers/<member>                    a daemon's workers and how they ended (on the member's lease)
    history/<job>/<epoch>/<member>      (step, loss) pairs one daemon saw in one epoch
    logs/<job>/<member>/<seq>           chunks of the workers' output
    notes/<job>/<member>                what a daemon's workers refused (a corrupt checkpoint), for status

Like ``Keys``, every key name is built here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from varunad.store.keys import Keys, check_component

__all__ = ["FleetKeys"]

BUNDLES = "bundles/"
SIGNATURES = "signatures/"
NOTES = "notes/"
STATE = "state/"
CANCEL = "cancel/"
WORKERS = "workers/"
HISTORY = "history/"
LOGS = "logs/"


@dataclass(frozen=True, slots=True)
class FleetKeys(Keys):
    @property
    def states(self) -> str:
        return self.root + STATE

    @property
    def cancels(self) -> str:
        return self.root + CANCEL

    @property
    def workers(self) -> str:
        return self.root + WORKERS

    def signature(self, job: str) -> str:
        return self.root + SIGNATURES + check_component("job id", job)

    def bundle(self, job: str) -> str:
        return self.root + BUNDLES + check_component("job id", job)

    def state(self, job: str) -> str:
        return self.states + check_component("job id", job)

    def cancel(self, job: str) -> str:
        return self.cancels + check_component("job id", job)

    def workers_of(self, member: str) -> str:
        return self.workers + check_component("member name", member)

    def history_of(self, job: str) -> str:
        return self.root + HISTORY + check_component("job id", job) + "/"

    def history_entry(self, job: str, epoch: int, member: str) -> str:
        return f"{self.history_of(job)}{epoch:012d}/{check_component('member name', member)}"

    def parse_history(self, job: str, key: str) -> tuple[int, str]:
        """(epoch, member) of a ``history/<job>/<epoch>/<member>`` key; ValueError otherwise."""
        prefix = self.history_of(job)
        if not key.startswith(prefix):
            raise ValueError(f"{key!r} is not under {prefix!r}")
        epoch, sep, member = key[len(prefix):].partition("/")
        if not sep or not epoch.isdigit() or not member or "/" in member:
            raise ValueError(f"{key!r} is not a history entry")
        return int(epoch), member

    def notes_of(self, job: str) -> str:
        return self.root + NOTES + check_component("job id", job) + "/"

    def note_entry(self, job: str, member: str) -> str:
        return self.notes_of(job) + check_component("member name", member)

    def logs_of(self, job: str) -> str:
        return self.root + LOGS + check_component("job id", job) + "/"

    def log_chunk(self, job: str, member: str, seq: int) -> str:
        return f"{self.logs_of(job)}{check_component('member name', member)}/{seq:020d}"

    def logs_of_member(self, job: str, member: str) -> str:
        return f"{self.logs_of(job)}{check_component('member name', member)}/"

    def state_job(self, key: str) -> str:
        return self._last_component(self.states, key)

    def cancel_job(self, key: str) -> str:
        return self._last_component(self.cancels, key)

    def workers_member(self, key: str) -> str:
        return self._last_component(self.workers, key)
