"""Typed values that cross module borders, by what they are for: `messages` (what environments and datasets speak),
`tool_calls`, `sequences` (what engines and token builders speak) and `episodes` (trajectories, rewards, samples).

Data flows one way: dataset row -> `Task` -> environment (speaks `Message`s) -> engine (speaks token ids, returns
`Generation`) <-> token builder (keeps a `TokenSeq`) -> `Trajectory` -> rewards/advantages -> `Sample`s -> trainer.
Environments never see token ids; token builders never see rewards.
"""

from __future__ import annotations

from vlmrl.types.episodes import (
    CORRECT,
    ENV_METRIC_PREFIX,
    FORMATTED,
    OBSERVATION_REJECTED,
    PARSE_FAIL,
    EndReason,
    Judgement,
    RewardBreakdown,
    Sample,
    Trajectory,
    Turn,
    TurnOutcome,
    TurnReward,
)
from vlmrl.types.messages import (
    ImagePart,
    Message,
    Part,
    Role,
    StoredImagePart,
    Task,
    TextPart,
    Video,
    VideoFile,
    VideoPart,
)
from vlmrl.types.sequences import (
    BoundaryEdit,
    EnginePrompt,
    Generation,
    StopReason,
    TokenSeq,
    VideoInputs,
    VisionInputs,
)
from vlmrl.types.tool_calls import (
    ToolCall,
    ToolCallStatus,
    ToolFailure,
    ToolStats,
)

__all__ = [
    "BoundaryEdit",
    "CORRECT",
    "ENV_METRIC_PREFIX",
    "EndReason",
    "EnginePrompt",
    "FORMATTED",
    "Generation",
    "ImagePart",
    "Judgement",
    "Message",
    "OBSERVATION_REJECTED",
    "PARSE_FAIL",
    "Part",
    "RewardBreakdown",
    "Role",
    "Sample",
    "StopReason",
    "StoredImagePart",
    "Task",
    "TextPart",
    "TokenSeq",
    "ToolCall",
    "ToolCallStatus",
    "ToolFailure",
    "ToolStats",
    "Trajectory",
    "Turn",
    "TurnOutcome",
    "TurnReward",
    "Video",
    "VideoFile",
    "VideoInputs",
    "VideoPart",
    "VisionInputs",
]
