"""The creator torch.distributed calls for every cam group, and lookup helpers."""
from __future__ import annotations

import json
import os
import weakref

import torch
import torch.distributed as dist

from . import _C
from .config import GROUP_WIDE, Options

BACKEND_NAME = "cam"

# group_id -> backend, so extensions find the native object even when a debug wrapper
# (TORCH_DISTRIBUTED_DEBUG=DETAIL) sits between the ProcessGroup and it.
_backends: "weakref.WeakValueDictionary[str, _C.CamBackend]" = weakref.WeakValueDictionary()


def _describe_group(dist_backend_opts) -> str:
    """How messages name a group: its name and the global ranks it spans (torch passes no
    ranks for the default group)."""
    ranks = list(dist_backend_opts.global_ranks_in_group)
    return f"'{dist_backend_opts.group_id}' (global ranks {ranks if ranks else 'all'})"


# group_id -> backend of groups that span hosts (their extensions refuse with a clear error).
_spanning: "weakref.WeakValueDictionary[str, _C.HierarchicalBackend]" = weakref.WeakValueDictionary()


def rank_record(opts: Options) -> str:
    """This rank's entry of the table below: host key, hostname, group-wide options (JSON)."""
    shared = opts.group_wide()
    shared["inter_host_engine"] = _resolved_engine(opts)
    return "\n".join((_C.host_key(), _C.host_name(), json.dumps(shared)))


def _rank_table(store, rank: int, size: int, opts: Options, timeout, where: str) -> tuple[list[str], list[str]]:
    """Every rank's host key, hostname and group-wide options, read before any window is opened,
    so that every rank decides the group's shape from the same table and every rank refuses a
    group whose ranks disagree. Keys carry the restart attempt: a store reused by a restarted
    job (torchrun --max-restarts) may still hold the last attempt's."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    record = rank_record(opts)
    mine = json.loads(record.split("\n", 2)[2])
    store.set(f"cam_host/{attempt}/{rank}", record)
    keys = [f"cam_host/{attempt}/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except Exception as e:  # noqa: BLE001 (the store's own error names no rank)
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(f"{where}: ranks {missing} did not publish their host within the group "
                           f"timeout ({timeout.total_seconds():.0f} s): {e}") from None
    records = [v.decode().split("\n", 2) for v in store.multi_get(keys)]
    hosts = [r[0] for r in records]
    spanning = len(set(hosts)) > 1
    for r, record in enumerate(records):
        theirs = json.loads(record[2]) if len(record) > 2 else {}
        for name, value in mine.items():
            if name in ("inter_host_engine", "all_to_all_hops") and not spanning:
                continue  # a group on one host has no use for it
            if theirs.get(name) != value:
                raise RuntimeError(
                    f"{where}: rank {r} has {name}={theirs.get(name, '(not given: another torch_cam version?)')} "
                    f"but this rank has {name}={value}; options that lay out the windows or choose an op's "
                    f"algorithm ({', '.join(GROUP_WIDE)}) must be equal on every rank of a group "
                    f"(give them alike through pg_options or TORCH_CAM_* on every rank)")
    return hosts, [r[1] if len(r) > 1 else r[0] for r in records]


def create_backend(dist_backend_opts, pg_options):
    opts = Options.from_env().merged(pg_options)
    # Flight-recorder dumps are named by global rank; torch creates the default group (whose
    # rank is the global one) before dist.get_rank() works.
    _C.set_trace_rank(dist.get_rank() if dist.is_initialized() else dist_backend_opts.group_rank)
    store, rank, size = dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size
    group_id, desc = str(dist_backend_opts.group_id), _describe_group(dist_backend_opts)
    keys, names = _rank_table(store, rank, size, opts, dist_backend_opts.timeout,
                              f"cam init of group {desc} on rank {rank}")
    if len(set(keys)) > 1:
        backend = _create_hierarchical(dist_backend_opts, opts, keys, names)
        _spanning[group_id] = backend
        return backend
    backend = _C.CamBackend(store, rank, size, dist_backend_opts.timeout.total_seconds(), opts.to_native(),
                            group_id, desc)
    _backends[group_id] = backend
    return backend


def _resolved_engine(opts: Options) -> str:
    """What :func:`_inter_host_engine` picks, without raising: what ranks compare at init."""
    try:
        return _inter_host_engine(opts)
    except RuntimeError:
        return "ucx (absent from this build)"


def _inter_host_engine(opts: Options) -> str:
    """"ucx" or "gloo": the engine between hosts that ``opts.inter_host_engine`` asks for."""
    have = _C.ucx_version is not None
    if opts.inter_host_engine == "ucx" and not have:
        raise RuntimeError("torch_cam: inter_host_engine='ucx' but this build of torch_cam has no UCX "
                           "(install libucx-dev, e.g. `apt-get install libucx-dev`, and rebuild)")
    if opts.inter_host_engine == "gloo" or not have:
        return "gloo"
    return "ucx"


def _create_hierarchical(dist_backend_opts, opts: Options, keys: list[str], names: list[str]):
    """A group across hosts: cam over each host's ranks and, between hosts, UCX (one-sided
    operations for collectives, tagged messages for point-to-point; torch's gloo for both where
    this build has no UCX) over all ranks, over the rails of equal local index and over the
    hosts' leaders; the native HierarchicalBackend composes them. Every rank builds the parts in
    the same order."""
    store, rank, size = dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size
    timeout = dist_backend_opts.timeout
    group_id, desc = str(dist_backend_opts.group_id), _describe_group(dist_backend_opts)
    hm = _C.host_map(keys, names)
    host, local_rank = hm["host_of"][rank], hm["local_of"][rank]
    local_ranks, host_names, hosts = hm["ranks"][host], hm["names"], hm["ranks"]
    uniform = len({len(h) for h in hosts}) == 1
    local = _C.CamBackend(dist.PrefixStore(f"cam_host{host}/", store), local_rank, len(local_ranks),
                          timeout.total_seconds(), opts.to_native(), f"{group_id}/host{host}",
                          f"{desc}, its ranks {local_ranks} on host {host_names[host]}")
    engine = _inter_host_engine(opts)

    def inter(prefix: str, r: int, n: int, where: list[str], what: str):
        if engine == "ucx":
            return _C.OneSidedBackend.over_ucx(dist.PrefixStore(prefix, store), r, n, timeout.total_seconds(),
                                               opts.to_native(), f"{desc} ({what})", where)
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), r, n, timeout=timeout)

    rank_hosts = [host_names[h] for h in hm["host_of"]]
    if engine == "ucx":
        all_ranks = None
        collectives = inter("cam_all_ucx/", rank, size, rank_hosts, "all ranks")
        p2p = _C.UcxP2PBackend(dist.PrefixStore("cam_p2p_ucx/", store), rank, size, timeout.total_seconds(),
                               opts.to_native(), f"{desc} (point-to-point)", rank_hosts)
    else:
        all_ranks = dist.ProcessGroupGloo(dist.PrefixStore("cam_all/", store), rank, size, timeout=timeout)
        collectives = p2p = None
    rail = inter(f"cam_rail{local_rank}/", host, len(hosts), host_names, f"rail {local_rank}") if uniform else None
    if local_rank != 0:
        leaders = None
    elif uniform:
        leaders = rail
    else:
        leaders = inter("cam_leaders/", host, len(hosts), host_names, "host leaders")
    return _C.HierarchicalBackend(rank, size, keys, names, local, all_ranks, collectives, rail, leaders, p2p, store,
                                  f"{desc} on hosts {', '.join(host_names)}")


def spanning_backend(group=None) -> "_C.HierarchicalBackend | None":
    """The native backend of ``group`` when its ranks span hosts; None when they share one."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    backend = pg._get_backend(torch.device("cpu"))
    if isinstance(backend, _C.HierarchicalBackend):
        return backend
    return _spanning.get(getattr(pg, "group_name", ""))


class HostPeers:
    """How an extension (KV, weights, AFD) reaches the ranks of ``group``: ``near[r]`` is rank r's
    index in this host's heap (``backend``, mapped), or -1 for a rank of another host, reached
    over ``link(...)``'s UCX gets and puts. Making it raises on every rank alike, before any
    collective, when the group spans hosts and this build has no UCX (the build is the same
    everywhere)."""

    _made: dict = {}  # (group name, kind) -> links made: every rank makes them in the same order

    def __init__(self, group, what: str, error=RuntimeError):
        self.group = group
        self.spanning = spanning_backend(group)
        self.backend = get_host_backend(group)
        world = group.size()
        if self.spanning is None:
            self.near = list(range(world))
            return
        names = self.spanning.host_names
        if _C.ucx_version is None:
            raise error(f"{what}: group {group.group_name!r} spans hosts ({', '.join(names)}); between hosts it "
                        "needs UCX's one-sided operations and this build of torch_cam has no UCX (install "
                        "libucx-dev, e.g. `apt-get install libucx-dev`, and rebuild)")
        host_of, mine = self.spanning.host_of, self.spanning.host_of[group.rank()]
        self.near = [self.spanning.local_of[r] if host_of[r] == mine else -1 for r in range(world)]

    def link(self, kind: str, timeout_s: float) -> "_C.UcxArenaLink | None":
        """Collective: this group's next UCX link of ``kind`` (every rank's heap registered and its
        key exchanged), or None on one host."""
        if self.spanning is None:
            return None
        key = (self.group.group_name, kind)
        n = HostPeers._made[key] = HostPeers._made.get(key, 0) + 1
        names = [self.spanning.host_names[h] for h in self.spanning.host_of]
        return _C.UcxArenaLink(dist.PrefixStore(f"cam_{kind.replace(' ', '_')}{n}/", self.spanning.store),
                               self.group.rank(), self.group.size(), timeout_s, self.backend,
                               f"'{self.group.group_name}' ({kind} {n})", names)


def get_host_backend(group=None) -> "_C.CamBackend":
    """The cam backend over this rank's host in ``group``: the group's own when it is on one
    host, else the backend of its ranks on this host (their heap, their engine)."""
    spanning = spanning_backend(group)
    return spanning.local if spanning is not None else get_cam_backend(group)


def get_cam_backend(group=None) -> "_C.CamBackend":
    """The native cam backend of ``group`` (default: the world group)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("torch_cam: no default process group; call init_process_group('cam') first")
    backend = pg._get_backend(torch.device("cpu"))
    if isinstance(backend, _C.CamBackend):
        return backend
    for b in _backends.values():
        if b.group_id == getattr(pg, "group_name", None):
            return b
    spanning = backend if isinstance(backend, _C.HierarchicalBackend) else _spanning.get(getattr(pg, "group_name", ""))
    if spanning is not None:
        names = spanning.host_names
        raise RuntimeError(
            f"torch_cam: group {pg.group_name!r} spans {len(names)} hosts ({', '.join(names)}); this "
            "operation reads and writes peers' memory directly, which needs every rank of the group on "
            "one host (between hosts it needs one-sided operations over UCX, which torch_cam's "
            "collectives use but this operation does not yet). Collectives, point-to-point, "
            "torch_cam.all_reduce_, MoE "
            "dispatch / combine, the MoE Buffer, torch_cam.kv.KVTransfer, torch_cam.weights.WeightChannel and "
            "torch_cam.afd.AfdChannel work across hosts")
    raise RuntimeError(f"torch_cam: group {pg.group_name!r} is not a cam group "
                       f"(its CPU backend is {type(backend).__name__})")
