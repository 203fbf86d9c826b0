"""A schedule with a rank dimension: what each rank runs, and the edges along which results cross ranks.

Each rank runs an ordinary `Schedule` over its *local* items (for sequence-parallel attention: its parts
of the batch's requests, each planned as a request of its own). Item i of rank r computes part
`part[r][i]` of batch item `key[r][i]`; a batch item of more than one part is reduced with `combiner` at
its owner, the rank of its part 0. Each such part is one `RankEdge`: a put of the partial and a signal
(fetch-add) on the owner's counter, and the part whose signal completes the count merges the parts in
part order. An edge whose src is its dst stays on its rank. meld.distributed builds these from a `ShardPlan`
and runs them: on emulated ranks (the CPU reference executor) or on GPUs (templates/decode_attention.cuh,
MELD_XRANK).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import serial
from .combiners import COMBINERS
from .schedule import Schedule, ScheduleError


@dataclass(frozen=True)
class RankEdge:
    """Part `part` of `parts` of batch item `key`, computed on rank `src`, reduced on rank `dst`."""

    key: int
    part: int
    parts: int
    src: int
    dst: int

    @property
    def crosses(self) -> bool:
        return self.src != self.dst


@dataclass
class RankedSchedule:
    """Per rank: its `Schedule` and, per local item, the batch item (`key`) and the part of it it computes;
    `edges`: every part of every batch item of more than one part; `combiner`: how the parts merge."""

    world: int
    schedules: list[Schedule]
    key: list[np.ndarray]
    part: list[np.ndarray]
    num_items: int
    combiner: str = "online_softmax"

    def parts_of(self) -> np.ndarray:
        """Parts of each batch item (int64 [num_items])."""
        n = np.zeros(self.num_items, dtype=np.int64)
        for k in self.key:
            np.add.at(n, k.astype(np.int64), 1)
        return n

    def owner(self) -> np.ndarray:
        """The rank of each batch item's part 0."""
        out = np.full(self.num_items, -1, dtype=np.int64)
        for r, (k, p) in enumerate(zip(self.key, self.part)):
            out[k[p == 0]] = r
        return out

    @property
    def edges(self) -> list[RankEdge]:
        n, owner = self.parts_of(), self.owner()
        return [RankEdge(int(b), int(p), int(n[b]), r, int(owner[b]))
                for r, (k, pt) in enumerate(zip(self.key, self.part)) for b, p in zip(k, pt) if n[b] > 1]

    def validate(self) -> "RankedSchedule":
        """Every batch item computed as parts 0..n-1, each exactly once, across the ranks; each rank's
        schedule over exactly its local items; a known combiner. ScheduleError otherwise."""
        if self.combiner not in COMBINERS:
            raise ScheduleError(f"combiner {self.combiner!r} is not one of {sorted(COMBINERS)}")
        if not (len(self.schedules) == len(self.key) == len(self.part) == self.world):
            raise ScheduleError(f"world {self.world}: {len(self.schedules)} schedules, {len(self.key)} key and "
                                f"{len(self.part)} part tables")
        seen: dict[int, list[int]] = {}
        for r, (s, k, p) in enumerate(zip(self.schedules, self.key, self.part)):
            if len(k) != len(s.kv_len) or len(p) != len(k):
                raise ScheduleError(f"rank {r}: {len(s.kv_len)} local items, {len(k)} keys, {len(p)} parts")
            if len(k) and (k.min() < 0 or k.max() >= self.num_items):
                raise ScheduleError(f"rank {r}: a key outside [0, {self.num_items})")
            s.validate()
            for b, q in zip(k.tolist(), p.tolist()):
                seen.setdefault(b, []).append(q)
        for b in range(self.num_items):
            got = sorted(seen.get(b, []))
            if got != list(range(len(got))) or not got:
                raise ScheduleError(f"batch item {b}: parts {got} are not 0..n-1, each once")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "num_items": self.num_items, "combiner": self.combiner,
                "schedules": [s.to_dict() for s in self.schedules],
                "key": [k.tolist() for k in self.key], "part": [p.tolist() for p in self.part]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> "RankedSchedule":
        """The ranked schedule `to_json` wrote, validated; ScheduleError for anything else."""
        d = serial.document(text, "a RankedSchedule", ScheduleError,
                            ("world", "num_items", "combiner", "schedules", "key", "part"))
        world = serial.integer(d["world"], "world", ScheduleError, 1)
        lists = {}
        for name in ("schedules", "key", "part"):
            if not isinstance(d[name], list) or len(d[name]) != world:
                raise ScheduleError(f"{name} must be a list of one entry per rank (world {world}), got {d[name]!r:.80}")
        for name in ("key", "part"):
            lists[name] = [serial.int32_array(v, f"{name}[{r}]", ScheduleError) for r, v in enumerate(d[name])]
        schedules = []
        for r, s in enumerate(d["schedules"]):
            try:
                schedules.append(Schedule.from_dict(s))
            except ScheduleError as e:
                raise ScheduleError(f"schedules[{r}]: {e}") from None
        return RankedSchedule(world, schedules, lists["key"], lists["part"],
                              serial.integer(d["num_items"], "num_items", ScheduleError, 0),
                              serial.text(d["combiner"], "combiner", ScheduleError)).validate()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankedSchedule) and self.to_dict() == other.to_dict()

    def __str__(self) -> str:
        e = self.edges
        return (f"RankedSchedule: {self.num_items} items over {self.world} ranks "
                f"({', '.join(str(len(k)) for k in self.key)} local items), {len(e)} parts reduced at their owner, "
                f"{sum(x.crosses for x in e)} of them across ranks ({self.combiner})")
