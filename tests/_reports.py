"""A synthetic verify report for calibrate and report-loading tests (numbers checkable by hand).

Measured figures use the plan's vocabulary (colibri_plan.formats.report), and the dict carries the
file's kind and schema_version, so a test that writes it raw gets a current report.
"""

from colibri_plan.formats.report import KIND, SCHEMA_VERSION


def toy_report(cpu: float = 0.2, disk: float = 0.3, model: str = "m1", machine: str = "hostA",
               layers: bool = False) -> dict:
    """Raw CPU ``cpu`` s and disk ``disk`` s per token, measured at exactly 2x and 0.5x; with ``layers``
    the plan's per-layer CPU-path parts (one layer) are included."""
    rep = {
        "kind": KIND, "schema_version": SCHEMA_VERSION,   # what a report file holds (raw writers keep it)
        "plan": {"coefficients": None, "n_decode_layers": 3},
        "model": {"fingerprint": model}, "machine": {"fingerprint": machine},
        "predicted": {"decode_s_per_token": 1.0, "tok_s": 1.0,
                      "terms": {"dense_s": 0.1, "attention_s": 0.01, "expert_compute_s": {"cpu": cpu},
                                "disk_wait_s": disk, "transfer_s": 0.0}},
        "measured": {"decode_s_per_token": 1.0, "tok_s": 1.0,
                     "terms": {"dense_s": 0.16, "expert_compute_s": {"cpu": 2 * cpu},
                               "disk_wait_s": 0.5 * disk, "expert_layers_s": 2 * cpu + 0.5 * disk},
                     "hit_rate": {"vram": 0.0, "ram_pinned": 0.5, "lru": 0.0, "disk": 0.5}},
        "verdict": {}}
    if layers:
        rep["predicted"]["cpu_path_layers"] = {"weight": [1.0], "cpu_resident_s": [0.0],
                                               "cpu_stream_s": [cpu], "disk_s": [disk]}
    return rep
