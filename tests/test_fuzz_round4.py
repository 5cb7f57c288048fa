"""The bad inputs the fourth fuzzing round found (issue 30, "Bad inputs found (round 4)"), one case each
where the mutation suites (test_fuzz_documents.py, test_fuzz_loaders.py) would only meet them by chance:
hand-edited plans, profiles, heat traces, verify reports and configs that used to pass and change a
result silently, or crash after the work. Each must now be refused up front with a one-line typed error
that says what was wrong and what to do. Items 2-4, 7 and 17 are in test_fuzz_loaders.py,
test_fileio.py and test_cli_common.py.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import FormatError
from colibri_plan.formats.profile import MachineProfile


# ---- item 13: profile figures that contradict each other or the probe -----------------------------

def _trunk_row(backend: str, path: str) -> dict:
    st = {"min": 1e-4, "median": 2e-4, "max": 3e-4, "repetitions": 3}
    return {"backend": backend, "device_index": 0, "device_name": "d", "path": path, "fmt": "int8",
            "hidden": 2048, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128, "context_tokens": 64,
            "layers": 8, "weight_bytes": 18_000_000, "block_seconds": st, "moe_layer_seconds": st,
            "handoff_seconds": st, "attention_seconds": st}


@pytest.mark.parametrize("backend, path", [("cpu", "device"), ("cuda", "host")])
def test_a_trunk_layer_row_relabelled_to_the_other_path_is_refused(backend, path):
    doc = toy_profile().doc
    MachineProfile({**doc, "trunk_layer": [_trunk_row(backend, "host" if path == "device" else "device")]})
    with pytest.raises(FormatError, match=f"path '{path}' on backend '{backend}'.*re-measure"):
        MachineProfile({**doc, "trunk_layer": [_trunk_row(backend, path)]})


def test_available_ram_above_total_ram_is_refused():
    doc = copy.deepcopy(toy_profile().doc)
    doc["machine"]["ram_available_bytes"] = 950_000 * 10**9
    with pytest.raises(FormatError, match="ram_available_bytes 950,000,000,000,000 is more than ram_total"):
        MachineProfile(doc)
