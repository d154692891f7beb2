"""A worker's process groups and links: torch.distributed's world, the cut points every worker
agrees on, one group per stage (its replicas) and per tied tensor set spanning stages, the
gradient reducer over them, and the ZeroMQ channel to the neighbouring stages and the peers of
the step's statistics.

`ProcessGroups` is a part of `trainer.engine.varuna.Varuna`, which calls these once, while it is
built; they read its assignment, plan, position, device, layout and tensors, and set
`_owns_process_group`, `_rendezvous`, `stage_group`, `_replica_order`, `reducer` and `_norm_params`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.engine import replica_share, setup
from trainer.engine.comm import PeerChannel
from trainer.engine.data_parallel import GradReducer
from trainer.errors import ConfigError
from trainer.graph.partition import balance, dry_run
from trainer.net.netaddr import bound_gloo_backend, nccl_environment
from trainer.net.rendezvous import RendezvousStore, parse_url

__all__ = ["ProcessGroups"]

log = logging.getLogger("varuna")


class ProcessGroups:
    _owns_process_group = False

    def _init_distributed(self) -> None:
        a = self.assignment
        self._owns_process_group = not dist.is_initialized()
        if dist.is_initialized():
            if dist.get_world_size() != a.world_size or dist.get_rank() != a.rank:
                raise ConfigError(f"torch.distributed is initialised as rank {dist.get_rank()}/"
                                  f"{dist.get_world_size()}, the assignment says {a.rank}/{a.world_size}")
            return
        gloo = "gloo"
        cuda = self.device.type == "cuda"
        if a.bind_address:   # the daemon's advertised address: not the host name's (trainer.net.netaddr)
            gloo = bound_gloo_backend(a.bind_address)
            if cuda and a.gpu_collectives != "gloo":
                os.environ.update(nccl_environment(a.bind_address))
        if cuda:
            # NCCL and every torch.cuda call without an index use the current device: this one,
            # not GPU 0 in every worker of the host
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=float(os.environ.get("VARUNA_DIST_TIMEOUT", "600")))
        over_gloo = a.gpu_collectives == "gloo"
        if a.world_size == 1:
            store = dist.HashStore()
        elif a.bind_address:   # our rendezvous: bound to that address, no reverse DNS (trainer.net.rendezvous)
            host, port = parse_url(a.dist_url)
            store = self._rendezvous = RendezvousStore(host, port, is_server=a.rank == 0, timeout=timeout)
            if cuda and a.gpu_collectives is None and self._gpu_shared(store, timeout):
                over_gloo = True
        else:
            store = None
        backend = f"cpu:{gloo},cuda:nccl" if cuda and not over_gloo else gloo
        if store is None:
            dist.init_process_group(backend, init_method=a.dist_url, rank=a.rank,
                                    world_size=a.world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=a.rank,
                                    world_size=a.world_size, timeout=timeout)

    def _gpu_shared(self, store, timeout: timedelta) -> bool:
        """Whether another rank of the job computes on this rank's GPU (daemons that share a
        machine's one GPU, a launcher naming one GPU for every rank). NCCL refuses two ranks of a
        communicator on one device, so such a job reduces its CUDA tensors over gloo, through
        host memory. Every rank posts its GPU's UUID to the rendezvous store and reads them all,
        so every rank decides alike."""
        a = self.assignment
        store.set(f"varuna/gpu/{a.rank}", str(torch.cuda.get_device_properties(self.device).uuid))
        keys = [f"varuna/gpu/{r}" for r in range(a.world_size)]
        store.wait(keys, timeout)
        gpus = [store.get(k) for k in keys]
        shared = len(set(gpus)) < len(gpus)
        if shared and a.rank == 0:
            log.warning("%d ranks on %d GPU(s): their CUDA tensors are reduced over gloo (NCCL wants a GPU "
                        "per rank)", len(gpus), len(set(gpus)))
        return shared

    def _agree_on_cuts(self, traced, get_batch_fn) -> list[int]:
        """Every worker must cut the same way: rank 0 times the segments and decides."""
        P = self.plan.P
        if self.plan.cuts is not None:   # the plan checked their number and order
            return list(self.plan.cuts)
        if P == 1:
            return []
        decision: list[object] = [None]
        if self.rank == 0:
            try:
                sample = get_batch_fn(self.micro_batch_size, "cpu")
                decision[0] = balance(dry_run(traced, sample), P)
            except Exception as exc:  # sent to every rank, so all fail with the same reason
                decision[0] = exc
        dist.broadcast_object_list(decision, src=0)
        if isinstance(decision[0], Exception):
            raise decision[0]
        return list(decision[0])

    def _build_groups(self) -> None:
        """Process groups: one per stage (its replicas) and one per tied tensor set spanning
        stages. Every rank creates every group, in the same order, as torch.distributed requires."""
        a, layout = self.assignment, self.layout
        stage_groups = [dist.new_group(sorted(a.plan.ranks[s])) for s in range(self.plan.P)]
        self.stage_group = stage_groups[self.stage]
        # where each replica's rank is in the stage's group, for the collectives whose results
        # come by group rank (trainer.engine.replica_share)
        self._replica_order = replica_share.replica_order(self.stage_group, a.plan.ranks[self.stage])
        tied = []
        for names in layout.tied:
            stages = sorted({s for n in names for s in layout.owners[n]})
            # Every replica of every stage holding a copy sums it; on one stage, its replicas.
            group = stage_groups[stages[0]] if len(stages) == 1 else dist.new_group(
                sorted(r for s in stages for r in a.plan.ranks[s]))
            if self.stage in stages:
                tied.append(([self._named[n] for n in names if n in self._named],
                             group if self.plan.D * len(stages) > 1 else None))
        # One reducer owns every gradient: tied copies, on one stage or several, are summed and
        # all-reduced after the backward, never in the buckets that overlap it (data_parallel).
        self.reducer = GradReducer(self.parameters(), self.stage_group, self.plan.D, tied=tied)
        # A tied set is counted once in the gradient norm: on its lowest stage, first name.
        self._norm_params = [p for n, p in self.named_parameters() if self._counts_in_norm(n)]

    def _counts_in_norm(self, name: str) -> bool:
        tied = self.layout.tied_set(name)
        if tied is None:
            return True
        lowest = min(s for n in tied for s in self.layout.owners[n])
        first_here = next(n for n in tied if lowest in self.layout.owners[n])
        return self.stage == lowest and name == first_here

    def _open_channel(self) -> PeerChannel:
        a = self.assignment
        prev = a.plan.ranks[self.stage - 1][self.replica] if self.stage > 0 else None
        nxt = a.plan.ranks[self.stage + 1][self.replica] if self.stage < self.plan.P - 1 else None
        peers = [r for r in (self._stats_parent, *self._stats_children) if r is not None]
        return PeerChannel(bind=a.endpoints[self.rank],
                           prev=None if prev is None else a.endpoints[prev],
                           nxt=None if nxt is None else a.endpoints[nxt],
                           job=a.job, epoch=a.epoch, stage=self.stage,
                           security=setup.stream_security(a.endpoints, a.peer_keys),
                           rank=self.rank, stats_peers={r: a.endpoints[r] for r in peers})
