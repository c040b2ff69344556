"""User reward functions named ``package.module:function`` in a spec.

The function is imported when the spec is built, and must take ``(prompt, response, **metadata)``.
Spec arguments are passed as keyword arguments on every call, on top of the sample's metadata (a
spec argument wins over a metadata field of the same name). A function without ``**kwargs`` only
receives the metadata fields it names as parameters, so ``def score(prompt, response, answer)`` works
on samples that carry more fields than ``answer``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from rlfleet.reward.errors import RewardImportError, UnknownRewardArgument

logger = logging.getLogger(__name__)

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def import_function(target: str) -> Callable[..., Any]:
    """Import ``package.module:function`` and return the callable."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise RewardImportError(target, "expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardImportError(target, f"import of {module_name!r} failed: {exc}") from exc
    if not hasattr(module, attr):
        raise RewardImportError(target, f"module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardImportError(target, f"{attr!r} is a {type(fn).__name__}, not a callable")
    return fn


class UserFunction:
    """A user reward function bound to its spec arguments; itself a :class:`RewardFn`."""

    def __init__(self, target: str, fn: Callable[..., Any], args: Mapping[str, Any]) -> None:
        self.target = target
        self.fn = fn
        self.args = dict(args)
        self._accepts: frozenset[str] | None = None  # None: takes **kwargs, gets every field
        self._check_signature()

    @classmethod
    def load(cls, target: str, args: Mapping[str, Any]) -> UserFunction:
        """Import ``target`` and bind ``args`` (checked against its signature)."""
        return cls(target, import_function(target), args)

    def _check_signature(self) -> None:
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # some builtins have no signature: pass everything
            logger.debug("no signature for %s; passing all metadata", self.target)
            return
        params = list(sig.parameters.values())
        positional = [p for p in params if p.kind in _POSITIONAL]
        if len(positional) < 2 and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            raise RewardImportError(
                self.target, f"signature {sig} cannot take (prompt, response, **metadata)"
            )
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return
        taken = {p.name for p in positional[:2]}
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        keywords = {p.name for p in params if p.kind in named and p.name not in taken}
        for key in self.args:
            if key not in keywords:
                raise UnknownRewardArgument(self.target, key, keywords)
        self._accepts = frozenset(keywords)

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> Any:
        if self._accepts is not None:
            metadata = {k: v for k, v in metadata.items() if k in self._accepts}
        return self.fn(prompt, response, **{**metadata, **self.args})

    def __repr__(self) -> str:
        return f"UserFunction({self.target!r}, args={self.args!r})"
