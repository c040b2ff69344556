"""Every error rlfleet-reward raises, in one place.

Spec mistakes (an unknown rule, a bad argument, a user function that cannot be imported) are
``ValueError`` s, raised when a spec is parsed or built, before any sample is scored. Failures while
scoring are ``RuntimeError`` s that name the reward component and the sample index. Each error keeps
its fields and builds its own message.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlfleet.common.errors import RlfleetError


class RewardError(RlfleetError):
    """Marker base for every rlfleet-reward error; never raised on its own."""


# --- user mistakes: the spec ----------------------------------------------------------------


class RewardSpecError(RewardError, ValueError):
    """A reward spec is malformed (syntax of the string form, shape of the dict form)."""

    def __init__(self, spec: object, reason: str) -> None:
        self.spec = spec
        self.reason = reason
        super().__init__(f"bad reward spec {spec!r}: {reason}")


class UnknownReward(RewardError, ValueError):
    """A component names neither a registered rule nor a ``module:function``."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(
            f"unknown reward {name!r}: registered rules are {', '.join(self.known)}; "
            "a user function is written 'package.module:function'"
        )


class UnknownRewardArgument(RewardError, ValueError):
    """A component is given an argument its rule or function does not take."""

    def __init__(self, reward: str, argument: str, accepted: Iterable[str]) -> None:
        self.reward = reward
        self.argument = argument
        self.accepted = sorted(accepted)
        listed = ", ".join(self.accepted) or "none"
        super().__init__(f"reward {reward!r} takes no argument {argument!r} (it accepts: {listed})")


class MissingRewardArgument(RewardError, ValueError):
    """A rule's required argument is not given."""

    def __init__(self, reward: str, argument: str) -> None:
        self.reward = reward
        self.argument = argument
        super().__init__(f"reward {reward!r} needs the argument {argument!r}, e.g. '{reward}:{argument}=...'")


class BadRewardArgument(RewardError, ValueError):
    """An argument's value is of the wrong type or out of range."""

    def __init__(self, reward: str, argument: str, value: object, reason: str) -> None:
        self.reward = reward
        self.argument = argument
        self.value = value
        self.reason = reason
        if argument:
            super().__init__(f"reward {reward!r}: argument {argument}={value!r} is invalid: {reason}")
        else:  # a check across several arguments
            super().__init__(f"reward {reward!r}: arguments {value!r} are invalid: {reason}")


class RewardImportError(RewardError, ValueError):
    """A user function ``module:function`` cannot be imported, or is not a usable callable."""

    def __init__(self, target: str, reason: str) -> None:
        self.target = target
        self.reason = reason
        super().__init__(f"cannot load reward function {target!r}: {reason}")


class NoScorer(RewardError, ValueError):
    """A :class:`RewardScaler` was asked to compute rewards but was built without a scorer."""

    def __init__(self, model_name: str | None) -> None:
        self.model_name = model_name
        what = f"model_name={model_name!r} but " if model_name else ""
        super().__init__(
            f"RewardScaler has {what}no scorer: pass fn=... (any callable "
            "(prompts, responses, **kw) -> list[float], e.g. build_reward(spec)) or use .wrap(fn); "
            "reward models are not loaded from a name by this package yet"
        )


# --- user mistakes: the inputs --------------------------------------------------------------


class RewardInputError(RewardError, ValueError):
    """Inputs to score do not fit (lengths differ, metadata a rule needs is missing, NaN scores)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


# --- runtime failures -----------------------------------------------------------------------


class RewardFunctionError(RewardError, RuntimeError):
    """A reward component raised, or returned something that is not a finite number, on one sample."""

    def __init__(self, function: str, index: int, reason: str) -> None:
        self.function = function
        self.index = index
        self.reason = reason
        super().__init__(f"reward {function!r} failed on sample {index}: {reason}")


class UnknownEndpoint(RewardError, KeyError):
    """A score request names an endpoint this reward server does not serve."""

    code = "unknown_endpoint"

    def __init__(self, endpoint: str, known: Iterable[str]) -> None:
        self.endpoint = endpoint
        self.known = sorted(known)
        super().__init__(f"reward endpoint {endpoint!r} is not served here; known endpoints: {self.known}")

    def __str__(self) -> str:
        return str(self.args[0])
