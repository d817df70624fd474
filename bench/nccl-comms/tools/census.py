"""Which process groups a rank joins and which collectives each one carries: runs the measurement harness
(`python -m headroom_measure ...`, the arguments after this script's own) with torch.distributed's collectives and
`new_group` wrapped, and writes {groups: [{desc, size, ranks, ops: {op: calls}}]} for this rank to $CENSUS_OUT at exit.
Works under the fake process group (a fake world's rank) and under NCCL alike."""

import atexit
import collections
import functools
import json
import os
import runpy
import sys

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast", "reduce",
    "isend", "irecv", "send", "recv", "barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter",
)  # fmt: skip
groups = {}  # desc -> {size, ranks, ops}
me = {}


def entry(group):
    me.setdefault("rank", dist.get_rank())
    me.setdefault("world", dist.get_world_size())
    if group is None or group is dist.GroupMember.WORLD:
        desc, ranks = "default_pg", list(range(dist.get_world_size()))
    else:
        desc, ranks = getattr(group, "group_desc", None) or str(id(group)), dist.get_process_group_ranks(group)
    return groups.setdefault(desc, {"desc": desc, "size": len(ranks), "ranks": ranks, "ops": collections.Counter()})


def wrap(name, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        group = kwargs.get("group")
        if group is None and name in ("isend", "irecv", "send", "recv") and len(args) > 2:
            group = args[2]
        entry(group)["ops"][name] += 1
        return fn(*args, **kwargs)

    return call


def wrap_new_group(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        group = fn(*args, **kwargs)
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            entry(group)
        return group

    return call


# Both names of each function: `P2POp` checks its op against distributed_c10d's isend and irecv, and
# `batch_isend_irecv` calls them from there.
for name in OPS:
    if hasattr(c10d, name):
        wrapped = wrap(name, getattr(c10d, name))
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
dist.new_group = wrap_new_group(dist.new_group)


@atexit.register
def write():
    rows = [dict(g, ops=dict(g["ops"])) for g in groups.values()]
    with open(os.environ["CENSUS_OUT"], "w") as f:
        json.dump({**me, "groups": rows}, f, indent=1)


sys.argv = ["headroom_measure"] + sys.argv[1:]
runpy.run_module("headroom_measure", run_name="__main__", alter_sys=True)
