"""planner/costmodel: a machine figure of 0 or NaN is named in the error."""

from __future__ import annotations

import math

import pytest

from colibri_plan.errors import InputError
from colibri_plan.planner.costmodel import GpuResource, Resources


def test_zero_machine_figure_is_named():
    with pytest.raises(InputError, match=r"disk random-read 0\.0 GB/s") as err:
        Resources(cpu_matmul_gbps=21.58, ram_read_gbps=53.23, disk_read_gbps=0.0)
    assert "CPU expert matmul" not in str(err.value)
    with pytest.raises(InputError, match=r"cuda:1 GPU expert matmul nan GB/s"):
        Resources(cpu_matmul_gbps=1, ram_read_gbps=1,
                  gpus=(GpuResource("cuda:0", 5.0, 1, 1), GpuResource("cuda:1", math.nan, 1, 1)))
