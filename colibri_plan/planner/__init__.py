"""The planner: cost model, placement solver, baselines, exports and what-if sweeps."""
