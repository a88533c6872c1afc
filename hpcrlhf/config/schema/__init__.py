"""Typed configs: one frozen tree per job kind, defaults only here.

Sections are shared between job kinds (every trainer has `model`, `data`, `optim`, `engine`, ...);
each job kind is one top-level class (`SFTConfig`, `RMConfig`, `DPOConfig`, ...) built on
`TrainJobConfig`.
Recipes (YAML) and `--set section.key=value` override these defaults; see `hpcrlhf.config.loader`.
The string under each field is its documentation (`hpcrlhf config sft` prints it).

This package is where the configs are imported from; its modules hold them by what they configure:
- `checks`: the checks every section's `__post_init__` runs (a message names key, value and fix)
- `sections`: the sections every job kind shares, and `TrainJobConfig` built of them
- `offline`: the jobs that train on a fixed dataset: sft, rm, dpo, kto, csft
- `online`: the jobs that generate their data from prompts (rollout and reward sections): rs, and
  batch generation (`GenerateConfig`)
- `ppo`: the ppo job: its objective, its critic, the checks across its sections
- `placement`: where a ppo job's roles run on the allocation (the node map's settings)
- `rules`: the built-in rules' settings (math, code, format) and the names rules and metrics take
- `serve`: `hpcrlhf serve-reward`: reward sources served over HTTP
- `evaluation`: `hpcrlhf eval`: models (a folder, or a run's checkpoints) answering benchmark prompts
- `agent`: multi-turn rollouts with environments and tools (attached to the online jobs with the
  trainers' wiring, issue 39)
"""

from hpcrlhf.config.schema.checks import PathText, largest_divisor
from hpcrlhf.config.schema.evaluation import EvalDatasetConfig, EvalJobConfig
from hpcrlhf.config.schema.offline import (CSFTConfig, CSFTDataConfig, CSFTSectionConfig, DPOConfig, DPOLossConfig,
                                           KTOConfig, KTOLossConfig, PairDataConfig, PolicyJobConfig, RMConfig,
                                           SFTConfig, UnpairedDataConfig)
from hpcrlhf.config.schema.online import (KNOWN_RULES, TASK_RULES, GenerateConfig, OnlineJobConfig, PromptDataConfig,
                                          RemoteRewardConfig, RewardConfig,
                                          RewardSourceConfig, RolloutConfig, RSConfig, RSSectionConfig, source_name)
from hpcrlhf.config.schema.placement import (MODEL_ROLES, PLACEMENT_ROLES, PlacementConfig, PlacementRole, RewardServerConfig,
                                             RoleConfig, VLLMPlacementConfig)
from hpcrlhf.config.schema.ppo import CriticConfig, PPOConfig, PPOSectionConfig
from hpcrlhf.config.schema.rules import (BUILTIN_RULES, CodeRuleConfig, FormatRuleConfig, MathRuleConfig, RulesConfig,
                                         metric_name)
from hpcrlhf.config.schema.serve import ServeRewardConfig
from hpcrlhf.config.schema.sections import (BUNDLED_TASKS, DEFAULT_MAX_LENGTH, DEFAULT_NEW_TOKENS, DEFAULT_TASK,
                                            DEFAULT_USER_CODE_TIMEOUT_S, MAX_STEPS, MICRO_BATCH_CAP, BundledTask,
                                            CheckpointConfig, DataConfig, DataSourceConfig, EngineConfig, EvalConfig,
                                            LogConfig, LoRAConfig, ModelConfig, OptimConfig, ReferenceConfig, TaskConfig,
                                            TrainConfig, TrainJobConfig, WatchdogConfig, resolved_max_length,
                                            resolved_new_tokens)

JOB_CONFIGS: dict[str, type] = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "kto": KTOConfig, "csft": CSFTConfig,
                                "ppo": PPOConfig, "rs": RSConfig}
"""Job kind -> its config class (the CLI's `train KIND`)."""

JobConfig = TrainJobConfig | GenerateConfig
"""A config the CLI builds from a recipe: a training job's (`JOB_CONFIGS`) or `hpcrlhf generate`'s."""

__all__ = [
    "JOB_CONFIGS", "JobConfig", "PathText", "largest_divisor", "resolved_max_length", "resolved_new_tokens",
    "BUNDLED_TASKS", "DEFAULT_MAX_LENGTH", "DEFAULT_NEW_TOKENS", "DEFAULT_TASK", "DEFAULT_USER_CODE_TIMEOUT_S",
    "MAX_STEPS", "MICRO_BATCH_CAP", "MODEL_ROLES", "PLACEMENT_ROLES", "TASK_RULES", "KNOWN_RULES", "BUILTIN_RULES", "metric_name", "source_name", "BundledTask", "PlacementRole",
    "TrainJobConfig", "OnlineJobConfig", "PolicyJobConfig",
    "SFTConfig", "RMConfig", "DPOConfig", "KTOConfig", "CSFTConfig", "PPOConfig", "RSConfig", "GenerateConfig",
    "ModelConfig", "TaskConfig", "DataSourceConfig", "DataConfig", "PairDataConfig", "UnpairedDataConfig",
    "CSFTDataConfig", "PromptDataConfig", "OptimConfig", "TrainConfig", "EngineConfig", "EvalConfig", "LogConfig",
    "CheckpointConfig", "LoRAConfig", "ReferenceConfig", "DPOLossConfig", "KTOLossConfig", "CSFTSectionConfig",
    "RolloutConfig", "RewardSourceConfig", "RemoteRewardConfig", "RewardConfig", "CriticConfig", "PPOSectionConfig", "RSSectionConfig",
    "PlacementConfig", "RoleConfig", "VLLMPlacementConfig", "RewardServerConfig", "RulesConfig", "MathRuleConfig", "CodeRuleConfig",
    "FormatRuleConfig", "ServeRewardConfig", "EvalJobConfig", "EvalDatasetConfig", "WatchdogConfig",
]
