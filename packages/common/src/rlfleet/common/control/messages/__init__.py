"""Control-plane messages: every message any tier sends over NATS.

Each message is a pydantic model tagged by ``kind``, one module per family: ``base`` (the
:class:`Message` base, the wire schema version :data:`PROTOCOL`, the generic replies),
``membership``, ``rollout``, ``reward``, ``trainer``, ``environment`` and ``agent``. ``codec`` holds
:data:`AnyMessage`, their one discriminated union, and :func:`decode`, the one way to read bytes
off the wire; another MAJOR version is refused with :class:`ProtocolMismatch`, a MINOR skew is
accepted and unknown fields are ignored. Bulk data never rides here: messages carry
:class:`TensorRef` s to the gRPC tensor plane.

Import messages from here (``from rlfleet.common.control.messages import GenerateRequest``).
"""

from rlfleet.common.control.messages.agent import AgentCollect, AgentOpen, AgentOpened
from rlfleet.common.control.messages.base import (
    MAX_MESSAGE_BYTES,
    PROTOCOL,
    Ack,
    ErrorReply,
    Message,
    Shutdown,
    Tier,
    speaks,
)
from rlfleet.common.control.messages.codec import MESSAGES, AnyMessage, check_protocol, decode, encode
from rlfleet.common.control.messages.environment import EnvClose, EnvObservation, EnvReset, EnvStep
from rlfleet.common.control.messages.membership import Heartbeat, Ping, WorkerAnnounce, WorkerLeave
from rlfleet.common.control.messages.reward import (
    EndpointStats,
    RewardSpecSet,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.messages.rollout import (
    GenerateRequest,
    GenerateResult,
    LoadWeights,
    SamplingParams,
    WeightsLoaded,
)
from rlfleet.common.control.messages.trainer import (
    CheckpointLoaded,
    LatestWeights,
    LoadCheckpoint,
    PublishWeights,
    SaveCheckpoint,
    Saved,
    TrainerConfigure,
    TrainerConfigured,
    TrainStepRequest,
    TrainStepResult,
    WeightsPublished,
)

__all__ = [
    "Ack", "AgentCollect", "AgentOpen", "AgentOpened", "AnyMessage", "CheckpointLoaded", "EndpointStats",
    "EnvClose", "EnvObservation", "EnvReset",
    "EnvStep", "ErrorReply", "GenerateRequest", "GenerateResult", "Heartbeat", "LatestWeights",
    "LoadCheckpoint", "LoadWeights", "MAX_MESSAGE_BYTES", "MESSAGES", "Message", "PROTOCOL", "Ping",
    "PublishWeights", "RewardSpecSet", "RewardStats", "RewardStatsRequest", "SamplingParams",
    "SaveCheckpoint", "Saved", "ScoreRequest", "ScoreResult", "SetRewardSpec", "Shutdown", "Tier",
    "TrainStepRequest", "TrainStepResult", "TrainerConfigure", "TrainerConfigured", "WeightsLoaded",
    "WeightsPublished", "WorkerAnnounce", "WorkerLeave", "check_protocol", "decode", "encode", "speaks",
]  # fmt: skip
