"""Scheduler, block pool and prefix cache: pure Python, no torch import anywhere in this package."""

from __future__ import annotations

from qserve.scheduler.block_pool import DEFAULT_OWNER, BlockPool, OwnerShare
from qserve.scheduler.kv_cache_manager import KVCacheManager
from qserve.scheduler.output import RunnerOutput, ScheduledSequence, SchedulerOutput, TokenLogprobs
from qserve.scheduler.scheduler import Scheduler

__all__ = [
    "DEFAULT_OWNER",
    "BlockPool",
    "KVCacheManager",
    "OwnerShare",
    "RunnerOutput",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "TokenLogprobs",
]
