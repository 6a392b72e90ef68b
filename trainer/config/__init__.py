"""The config API: the schema (trainer/config/schema.py), loading (config_loader), checks
(config_checks) and the TOML writer (config_toml), under one import for callers."""

from trainer.config.checks import Layout, check_layout, notes, validate
from trainer.config.loader import DEFAULT_CONFIG, build_config, help_text, load_toml, parse_cli
from trainer.config.schema import (
    SECTIONS,
    ActivationCheckpointConfig,
    ActivationCheckpointMode,
    CheckpointConfig,
    CompileConfig,
    CompileMode,
    Config,
    DataConfig,
    DataKind,
    Float8Impl,
    Float8Scaling,
    Float8TrainingConfig,
    JobConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
    choices_of,
)
from trainer.config.sources import SourceConfig
from trainer.config.toml_writer import to_toml

__all__ = [
    "DEFAULT_CONFIG", "SECTIONS", "ActivationCheckpointConfig", "ActivationCheckpointMode", "CheckpointConfig",
    "CompileConfig", "CompileMode", "Config", "DataConfig", "DataKind", "Float8Impl", "Float8Scaling",
    "Float8TrainingConfig", "JobConfig", "LRSchedulerConfig", "Layout", "MetricsConfig", "ModelConfig", "OptimizerConfig",
    "ParallelismConfig", "ProfilingConfig", "SourceConfig", "TrainingConfig", "ValidationConfig", "build_config",
    "check_layout", "choices_of", "help_text", "load_toml", "notes", "parse_cli", "to_toml", "validate",
]
