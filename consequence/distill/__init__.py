"""Distillation: the scripted teacher and the tiny warm start, SFT on demonstration rows, the
cold start of any model from verified demonstrations (an environment's demonstrator, a
file, or a teacher behind an OpenAI-compatible URL), rejection sampling, the teacher model of on-policy distillation and
GKD, and fixed data (docs/distillation.md)."""

from consequence.exports import lazy

__all__ = [
    "ColdStartConfig",
    "DemoSet",
    "SFTConfig",
    "ScriptedTeacher",
    "WarmstartConfig",
    "cold_start",
    "collect_demonstrations",
    "draw_fixed_batch",
    "ensure_warmstart",
    "load_fixed_data",
    "load_teacher",
    "rejection_sample",
    "train_sft",
]
__getattr__, __dir__ = lazy(
    __name__,
    {
        "WarmstartConfig": "warmstart",
        "ensure_warmstart": "warmstart",
        "ColdStartConfig": "coldstart",
        "cold_start": "coldstart",
        "SFTConfig": "sft",
        "train_sft": "sft",
        "ScriptedTeacher": "teacher",
        "DemoSet": "teacher",
        "collect_demonstrations": "demonstrations",
        "load_teacher": "teacher_model",
        "load_fixed_data": "fixed_data",
        "draw_fixed_batch": "fixed_data",
        "rejection_sample": "rejection",
    },
)
