"""The settings of a training run (:class:`TrainConfig`), in one package: the fields and their
validation (:mod:`~consequence.config.settings`), which settings each choice reads
(:mod:`~consequence.config.effects`), and YAML nested by box (:mod:`~consequence.config.nested`).

Every check that compares settings with each other lives here; checks that need the model,
the tasks, the file system or the machine run where those are loaded.
"""

from consequence.config.settings import (
    BOXES,
    DEFAULT_RUN_DIR,
    DEVICE_CHOICES,
    DEVICE_SPEC,
    MODEL_NAMES,
    OWN_FOLDERS,
    TrainConfig,
    absolute,
    box_model,
    box_of,
    box_settings,
    comma_list,
    flat_settings,
    generation_budget,
    is_hub_id,
    ray_host_port,
    saved_settings,
    yaml_problem,
)

__all__ = [
    "BOXES",
    "DEFAULT_RUN_DIR",
    "DEVICE_CHOICES",
    "DEVICE_SPEC",
    "MODEL_NAMES",
    "OWN_FOLDERS",
    "TrainConfig",
    "absolute",
    "box_model",
    "box_of",
    "box_settings",
    "comma_list",
    "flat_settings",
    "generation_budget",
    "is_hub_id",
    "ray_host_port",
    "saved_settings",
    "yaml_problem",
]
