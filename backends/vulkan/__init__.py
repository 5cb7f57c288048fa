"""The ``vulkan`` backend (GLSL compute shaders run from their committed SPIR-V): :mod:`.backend` (weights,
host ops, recorded command buffers), its parts :mod:`.batch` (the device ops' open command buffer and
array pool), :mod:`.device` (the ``d_*`` hooks) and :mod:`.experts` (routed experts on the device), and the
driver plumbing :mod:`.objects` (the logical device's fixed objects) and :mod:`.util` (discovery, memory
types, buffers). Importing this package imports no ``vulkan``."""

from colibri_plan.backends.vulkan.backend import VulkanBackend

BACKEND = VulkanBackend
