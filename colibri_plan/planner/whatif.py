"""``solve --what-if ram|vram|nvme``: predicted tok/s of the optimal plan as one resource varies.

Each point re-solves the placement with one figure changed and everything else as in the setup:
``ram`` scales the RAM budget for experts, ``vram`` every discrete GPU's expert budget, ``nvme`` the disk
read GB/s. The plot is drawn with matplotlib's Agg backend (imported only here).

:func:`setup_from_plan` rebuilds the placement problem from a plan file alone (its per-layer selection
probabilities, ``resources``, budgets and coefficients), so `colibri-plan report` can draw the curves
without the profile, model and heat the plan came from.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np

from colibri_plan.errors import ColibriError, InputError
from colibri_plan.fileio import atomic_write_bytes
from colibri_plan.formats.plan import Plan, layer_probabilities
from colibri_plan.planner.baselines import hot_first
from colibri_plan.planner.costmodel import Coefficients, GpuResource, Resources
from colibri_plan.planner.make import Setup, auto_lru_slots
from colibri_plan.planner.options import DEFAULTS
from colibri_plan.planner.solve import Problem, evaluate, solve_placement

KINDS = ("ram", "vram", "nvme")


@dataclasses.dataclass(frozen=True)
class PlanModel:
    """What the what-if needs of a model, as a plan records it (name, top-k, bytes of one expert)."""

    name: str
    top_k: int
    bytes_per_expert: int

    def expert_bytes(self) -> int:
        """Bytes of one routed expert (the ModelSpec method of the same name)."""
        return self.bytes_per_expert


def setup_from_plan(plan: Plan) -> tuple[Setup, list[str]]:
    """The placement problem a plan was solved for, rebuilt from the plan document alone.

    Returns:
        (setup, notes): ``setup.spec`` is a :class:`PlanModel`, ``setup.heat`` and ``setup.budgets`` are
        None; ``notes`` says what the rebuild cannot know (the activation size of GPU transfers).

    Raises:
        InputError: the plan lacks what the what-if needs (selection probabilities per layer, the
            ``resources`` section): re-solve it with `colibri-plan solve`.
    """
    d = plan.doc
    probs = layer_probabilities(plan)
    missing = [what for what, ok in (("selection probabilities per layer (layers[].p)", probs is not None),
                                     ("machine resources (resources)", isinstance(d.get("resources"), dict)))
               if not ok]
    if missing:
        raise InputError(f"the plan has no {' and no '.join(missing)}; re-solve it with `colibri-plan "
                         "solve` to get what-if curves")
    try:
        r = dict(d["resources"])
        r["gpus"] = tuple(GpuResource(**g) for g in r.get("gpus") or ())
        res = Resources(**r)
        coef = Coefficients.from_dict(d.get("coefficients"), "plan: coefficients")
    except (TypeError, ValueError, ColibriError) as exc:
        raise InputError(f"the plan's resources or coefficients cannot be read back ({exc}); re-solve "
                         "it with `colibri-plan solve`") from None
    model = d["model"]
    n_layers = int(model.get("n_layers") or max(plan.layer_ids) + 1)
    weights = np.array([1.0 if lid < n_layers else 0.0 for lid in plan.layer_ids])
    terms = d["predicted"]["terms"]
    fixed = float(terms.get("dense_s") or 0.0) + float(terms.get("attention_s") or 0.0)
    problem = Problem(probs=probs, weights=weights, expert_bytes=plan.expert_bytes, res=res,
                      ram_budget_bytes=int(d["budgets"]["ram_budget_bytes"]), lru_slots=plan.lru_slots(),
                      coef=coef, activation_bytes=0, fixed_cost_s=fixed)
    spec = PlanModel(str(model.get("name", "")), int(model.get("top_k") or 1), plan.expert_bytes)
    notes = []
    if any(not g.unified for g in res.gpus):
        notes.append("the plan does not record the model's hidden size, so these curves leave out the "
                     "per-token activation transfers to and from the GPUs (small beside expert reads)")
    setup = Setup(spec=spec, heat=None, budgets=None, res=res, problem=problem,
                  dense_fmt=str(d.get("dense_format", "")), warnings=[])
    return setup, notes


def _variant(setup: Setup, kind: str, value: float):
    """The placement problem with one resource set to ``value`` (GB for ram/vram, GB/s for nvme)."""
    pr = setup.problem
    res = setup.res
    if kind == "ram":
        ram = int(value * 1e9)
        slots = auto_lru_slots(setup.spec, res, ram, pr.weights, pr.probs)
        return dataclasses.replace(pr, ram_budget_bytes=ram, lru_slots=slots)
    if kind == "vram":
        gpus = tuple(g if g.unified else dataclasses.replace(g, budget_bytes=int(value * 1e9))
                     for g in res.gpus)
        res = dataclasses.replace(res, gpus=gpus)
        slots = auto_lru_slots(setup.spec, res, pr.ram_budget_bytes, pr.weights, pr.probs)
        return dataclasses.replace(pr, res=res, lru_slots=slots)
    if kind == "nvme":
        return dataclasses.replace(pr, res=dataclasses.replace(res, disk_read_gbps=float(value)))
    raise InputError(f"--what-if must be one of {', '.join(KINDS)}, got {kind!r}")


def default_range(setup: Setup, kind: str, points: int = 7) -> np.ndarray:
    """A range around the current value: RAM and VRAM from 0 to what holds every expert (or 2x the current
    budget), NVMe from 1/4x to 4x the measured GB/s."""
    pr, res = setup.problem, setup.res
    b, n_all = pr.expert_bytes, pr.probs.size
    if kind == "ram":
        top = max(pr.ram_budget_bytes * 2, n_all * b) / 1e9
        return np.linspace(0, top, points)
    if kind == "vram":
        discrete = [g for g in res.gpus if not g.unified]
        if not discrete:
            raise InputError("--what-if vram needs a discrete GPU in the profile")
        top = max(2 * max(g.budget_bytes for g in discrete), n_all * b / len(discrete)) / 1e9
        return np.linspace(0, top, points)
    if kind == "nvme":
        if res.disk_read_gbps is None:
            raise InputError("--what-if nvme needs a disk figure in the profile; run `colibri-plan profile`")
        return res.disk_read_gbps * np.geomspace(0.25, 4.0, points)
    raise InputError(f"--what-if must be one of {', '.join(KINDS)}, got {kind!r}")


def what_if(setup: Setup, kind: str, values=None, time_limit_s: float = DEFAULTS.time_limit_s,
            progress=None) -> list[dict]:
    """Predicted tok/s of our plan and of colibrì's hot-first fill at each value.

    Returns:
        rows of {"value", "unit", "tok_s", "hot_first_tok_s", "vram", "ram_pinned", "disk"} (selection
        shares of the optimal plan).
    """
    values = default_range(setup, kind) if values is None else np.asarray(values, dtype=np.float64)
    unit = "GB/s" if kind == "nvme" else "GB"
    out = []
    for i, v in enumerate(values):
        if progress:
            progress(f"what-if {kind} {v:.3g} {unit} ({i + 1}/{len(values)})")
        pr = _variant(setup, kind, float(v))
        sol = solve_placement(pr, time_limit_s=time_limit_s)
        base = evaluate(pr, *hot_first(pr))
        out.append({"value": float(v), "unit": unit, "tok_s": sol.cost["tok_s"],
                    "hot_first_tok_s": base["tok_s"], **{k: sol.cost["hit_rate"][k]
                                                         for k in ("vram", "ram_pinned", "disk")}})
    return out


def plot(rows: list[dict], kind: str, path, title: str = "") -> None:
    """Write a PNG of tok/s against the varied resource (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["value"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(x, [r["tok_s"] for r in rows], "o-", label="optimised plan")
    ax.plot(x, [r["hot_first_tok_s"] for r in rows], "s--", label="colibrì hot-first fill")
    label = {"ram": "RAM for experts (GB)", "vram": "VRAM per GPU (GB)", "nvme": "NVMe read (GB/s)"}[kind]
    ax.set_xlabel(label)
    ax.set_ylabel("predicted decode tok/s")
    ax.set_title(title or f"what-if: {kind}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
