"""colibri-plan: measure a machine, plan where every MoE expert lives, run the plan and verify it."""

__version__ = "0.1.0"
