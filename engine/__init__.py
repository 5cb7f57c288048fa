"""The streaming MoE engine: checkpoint import, expert packs, tiers and residency, forward pass."""
