"""Speculation with a target sharded over several processes (several Macs), on MLX's own
distributed engine, started by `mlx.launch` (docs/SEVERAL_MACS.md).

Every rank holds a shard of the target (mlx-lm's `sharded_load`: tensor parallel where the
architecture has `shard`, pipeline parallel where it has `pipeline`) and runs identical forwards
with identical shapes. Rank 0 decides everything else and the others follow:

- the policy's (source, k) is rank 0's, broadcast as a fixed-size packet (`SyncedPolicy`), except
  where every rank computes the same plan from the same tokens (FixedK over a cheap proposer);
- the proposal is rank 0's, broadcast as a fixed-size packet of tokens and tree parents
  (`SyncedProposer`); a draft model runs on rank 0 only (it is loaded whole on every rank);
- the verification result (accepted count, next token, the draft) is rank 0's, broadcast inside
  the graph before the step's one host sync (`Coordinator.sync`, `step.decode_step(sync=...)`),
  and so is every plain token: every rank trims its cache the same way, and nothing depends on
  logits being bit-identical across ranks;
- whole requests are mirrored: rank 0 opens each as a row of a batch of one
  (`Engine.open`: a `MirroredRow`, from generate, chat, bench or the server's worker) and sends
  its opening, steps and close to the other ranks, which run `follow` instead of the command;
  only rank 0 reads input, prints, writes files and serves HTTP.

- prompt caches: before each prefill every rank agrees (one all_min) on the prefix it keeps,
  so the prefill runs the same forwards everywhere; the followers hold their shard of each of
  the server's caches under an id rank 0 gives it (`Coordinator.cache_id`).

Failures: a rank that dies closes its sockets and the ring backend raises on the others, or
the watchdog finds the closed socket (`ring_peer_closed`); a command then exits 1 with a clear
error (`DistributedFailure`), a server first answers its requests in flight with it
(`Coordinator.abandon`, `on_lost`). A rank stuck inside a generation trips the watchdog
(`MLXSPEC_DIST_TIMEOUT`, default 120 s without progress) and the process exits 1.
"""

from __future__ import annotations

from .engine import SHARDED_MODES, check_mode, engine_class, finish, follow
from .group import (
    CollectiveMeter,
    Coordinator,
    DistributedFailure,
    fail,
    init_group,
    launched,
    loopback_hostfile,
    lost,
)
from .sharding import STRATEGIES, choose_strategy, load, sharded_load
from .synced import SyncedPolicy, SyncedProposer

__all__ = ["SHARDED_MODES", "STRATEGIES", "CollectiveMeter", "Coordinator", "DistributedFailure",
           "SyncedPolicy", "SyncedProposer", "check_mode", "choose_strategy", "engine_class",
           "fail", "finish", "follow", "init_group", "launched", "load", "loopback_hostfile",
           "lost", "sharded_load"]
