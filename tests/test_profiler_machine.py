"""profiler/machine: CPU-type Vulkan/OpenCL devices (lavapipe, PoCL) become unified-memory devices only
when their backend is named with --backends; the default profile does not change."""

from __future__ import annotations

from colibri_plan.profiler.machine import list_host_memory_devices, relabel_rows

_DEVS = [{"backend": "cpu", "index": 0, "name": "host", "kind": "cpu", "unified_memory": True},
         {"backend": "vulkan", "index": 0, "name": "llvmpipe", "kind": "cpu", "unified_memory": True},
         {"backend": "opencl", "index": 0, "name": "pocl", "kind": "cpu", "unified_memory": True},
         {"backend": "vulkan", "index": 1, "name": "RTX", "kind": "gpu", "unified_memory": False}]


def test_default_profile_keeps_cpu_type_devices_as_cpus():
    assert list_host_memory_devices(_DEVS, None) == _DEVS
    assert list_host_memory_devices(_DEVS, ("cpu",)) == _DEVS


def test_named_backend_lists_its_cpu_device_as_unified():
    out = list_host_memory_devices(_DEVS, ("cpu", "vulkan"))
    lava, pocl, rtx = out[1], out[2], out[3]
    assert lava["kind"] == "igpu" and lava["unified_memory"] is True and lava["host_memory_device"] is True
    assert "--backends named vulkan" in lava["note"]
    assert pocl == _DEVS[2] and rtx == _DEVS[3] and out[0] == _DEVS[0]      # only what was named
    assert list_host_memory_devices(_DEVS, ("opencl",))[2]["kind"] == "igpu"
    rows = [{"backend": "vulkan", "device_index": 0, "device_kind": "cpu"},
            {"backend": "cpu", "device_index": 0, "device_kind": "cpu"}]
    kinds = [r["device_kind"] for r in relabel_rows(rows, out)]
    assert kinds == ["igpu", "cpu"]          # lavapipe's figures are never taken for the CPU's
