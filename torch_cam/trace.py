"""Reads the flight-recorder dumps of a job's ranks and says which op and which rank the others
wait on.

    python -m torch_cam.trace /tmp/torch_cam_trace_rank_*.json

For every group it finds the first collective that some rank has not brought to an end (one
that failed on every rank alike, such as a refusal of bad arguments, is passed over) and, for
each rank of the group, whether it is waiting in it, failed in it, or never issued it (and what
it ran last). Point-to-point ops still pending are listed with their peers.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

_DONE = "completed"


@dataclass
class _Member:
    global_rank: int
    host: str
    entries: list


@dataclass
class _Group:
    id: str
    desc: str
    size: int
    members: dict = field(default_factory=dict)  # group rank -> _Member


def load(paths: list[str]) -> dict[str, _Group]:
    groups: dict[str, _Group] = {}
    for path in paths:
        with open(path) as f:
            dump = json.load(f)
        if dump.get("version") != 1:
            raise ValueError(f"{path}: not a torch_cam flight-recorder dump (version {dump.get('version')!r})")
        for g in dump["groups"]:
            group = groups.setdefault(g["group"], _Group(g["group"], g["desc"], g["size"]))
            group.members[g["rank"]] = _Member(dump["rank"], dump["host"], g["entries"])
    return groups


def _describe(e: dict) -> str:
    shape = f" {e['dtype']}{e['sizes']}" if e.get("dtype") else ""
    peer = f" peer {e['peer']}" if e["peer"] >= 0 else ""
    return f"{e['op']} (seq {e['seq']}{shape}{peer})"


def analyse(group: _Group) -> list[str]:
    """Lines saying where the group stands."""
    lines = [f"group {group.desc}: {len(group.members)} of {group.size} ranks dumped"]
    colls = {r: [e for e in m.entries if e["kind"] == "collective"] for r, m in group.members.items()}
    by_seq = {r: {e["seq"]: e for e in es} for r, es in colls.items()}
    unfinished = sorted({e["seq"] for es in colls.values() for e in es if e["state"] != _DONE})

    def settled(seq):  # every rank ran it to an end (a refusal fails everywhere alike)
        return len(by_seq) == group.size and all(
            seq in s and s[seq]["state"] in (_DONE, "failed") for s in by_seq.values())

    # The op the others wait on: the first one some rank has not brought to an end; where every
    # such op ended on every rank, the latest failure.
    stuck = [s for s in unfinished if not settled(s)] or unfinished[-1:]
    if not stuck:
        lines.append("  every recorded collective completed on every dumped rank")
    else:
        seq = stuck[0]
        at_seq = {r: s.get(seq) for r, s in by_seq.items()}
        ops = sorted({e["op"] for e in at_seq.values() if e is not None})
        lines.append(f"  first collective not completed everywhere: seq {seq} ({', '.join(ops)})")
        missing, waiting = [], []
        for r in range(group.size):
            m = group.members.get(r)
            if m is None:
                lines.append(f"  rank {r}: no dump")
                missing.append(r)
                continue
            who = f"  rank {r} (global {m.global_rank}, {m.host})"
            e = at_seq.get(r)
            if e is not None:
                if e["state"] == _DONE:
                    lines.append(f"{who}: completed {_describe(e)}")
                elif e["state"] == "failed":
                    lines.append(f"{who}: failed in {_describe(e)}: {e['error']}")
                    waiting.append(r)
                else:
                    lines.append(f"{who}: waiting in {_describe(e)} ({e['state']})")
                    waiting.append(r)
                continue
            es = colls[r]
            if es and es[0]["seq"] > seq:
                lines.append(f"{who}: its record no longer reaches seq {seq} (oldest kept: seq {es[0]['seq']})")
                continue
            last = es[-1] if es else None
            lines.append(f"{who}: NEVER ISSUED seq {seq}; its last collective is "
                         + (f"{_describe(last)}, {last['state']}" if last else "none"))
            missing.append(r)
        if len(ops) > 1:
            lines.append(f"  => ranks disagree on the op at seq {seq}: {', '.join(ops)}")
        if missing:
            names = ", ".join(map(str, missing))
            lines.append(f"  => {'rank' if len(missing) == 1 else 'ranks'} {names} did not issue "
                         f"{'/'.join(ops) or 'the op'} (seq {seq}); "
                         f"{'rank' if len(waiting) == 1 else 'ranks'} {', '.join(map(str, waiting))} "
                         f"{'waits' if len(waiting) == 1 else 'wait'} on it")
    for r, m in sorted(group.members.items()):
        for e in m.entries:
            if e["kind"] != "collective" and e["state"] != _DONE:
                verb = "failed in" if e["state"] == "failed" else "waiting in"
                lines.append(f"  rank {r}: {verb} {e['kind']} {_describe(e)}"
                             + (f": {e['error']}" if e.get("error") else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_cam.trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+", help="flight-recorder dumps (one per rank)")
    args = ap.parse_args(argv)
    groups = load(args.dumps)
    for g in sorted(groups.values(), key=lambda g: g.id):
        print("\n".join(analyse(g)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
