"""The trainer's reply cache, now :mod:`rlfleet.common.control.reply_cache` (the rollout worker
answers repeated job ids with it too); this module keeps the old import path working."""

from rlfleet.common.control.reply_cache import DEFAULT_SIZE, ReplyCache

__all__ = ["DEFAULT_SIZE", "ReplyCache"]
