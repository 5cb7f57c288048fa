"""The pictures of the plan report page (`colibri-plan report`), drawn with matplotlib as PNG bytes.

matplotlib (Agg backend) is imported inside each function, so importing this module is cheap. Every
function returns the PNG file's bytes; :mod:`colibri_plan.report_page` embeds them as base64 ``data:``
URIs, so the page needs no network and no file beside it. PNG rather than SVG: a heatmap of a real model
(78 layers x 256 experts) is 20,000 rectangles, a few KB as PNG and megabytes as SVG.
"""

from __future__ import annotations

import io

import numpy as np

from colibri_plan.formats.plan import TIER_DISK, TIER_RAM, Plan, layer_probabilities
from colibri_plan.formats.report import RunReport

#: colours of the tiers: RAM pinned, disk, then one per GPU device in plan order
RAM_COLOUR, DISK_COLOUR = "#2e9e5b", "#c9ccd1"
GPU_COLOURS = ("#6a3d9a", "#1f78b4", "#e31a1c", "#ff7f00", "#b15928", "#a6761d", "#e7298a", "#1b9e77")
PREDICTED_COLOUR, MEASURED_COLOUR = "#7f9fc9", "#e08a3c"


def _pyplot():
    """matplotlib.pyplot on the Agg backend (imported here, on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def tier_legend(plan: Plan) -> list[tuple[str, str]]:
    """(label, colour) of every tier the heatmap can show, GPUs first."""
    gpus = [(f"VRAM {k}", GPU_COLOURS[i % len(GPU_COLOURS)]) for i, k in enumerate(plan.device_keys)]
    return gpus + [("RAM pinned", RAM_COLOUR), ("disk (streamed; LRU-cached when hot)", DISK_COLOUR)]


def heat_order(plan: Plan) -> np.ndarray:
    """[rows, E] expert ids of each layer, hottest first (the plan's selection probabilities, ties by id);
    the identity order when the plan records none."""
    probs = layer_probabilities(plan)                               # [rows, E]
    rows, n = plan.tiers().shape
    if probs is None:
        return np.tile(np.arange(n), (rows, 1))
    return np.argsort(-probs, axis=1, kind="stable")


def placement_heatmap(plan: Plan) -> bytes:
    """Layer x expert -> tier (GPU per device, RAM pinned, disk), the experts of each layer sorted by heat
    (:func:`heat_order`, hottest left: an unsorted real model is confetti), the LRU slots of each layer at
    its right, and under it the sorted selection probabilities with a labelled colour bar."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = _pyplot()
    tiers = plan.tiers()
    rows, n = tiers.shape
    keys = plan.device_keys
    order = heat_order(plan)                                        # [rows, E]
    tiers = np.take_along_axis(tiers, order, axis=1)
    codes = np.where(tiers == TIER_RAM, len(keys), np.where(tiers == TIER_DISK, len(keys) + 1, tiers))
    legend = tier_legend(plan)
    cmap = ListedColormap([c for _, c in legend])
    probs = layer_probabilities(plan)
    if probs is not None:
        probs = np.take_along_axis(probs, order, axis=1)            # [rows, E] hottest first
    panels = 2 if probs is not None else 1
    height = min(9.0, 1.2 + 0.18 * rows) * panels + 1.0
    fig, axes = plt.subplots(panels, 1, figsize=(11, height), squeeze=False, layout="constrained")
    ax = axes[0][0]
    ax.imshow(codes, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=len(legend) - 0.5)
    labels = [str(lid) for lid in plan.layer_ids]
    step = max(1, rows // 24)
    ax.set_yticks(range(0, rows, step), labels[::step])
    ax.set_ylabel("MoE layer")
    ax.set_xlabel("experts of the layer by heat rank (0 = most selected)" if probs is not None else
                  "expert id")
    ax.set_title("where each expert lives")
    slots = plan.lru_slots()
    if slots.any():
        for i in range(0, rows, step):
            ax.text(n - 0.4, i, f" LRU {int(slots[i])}", va="center", ha="left", fontsize=7)
    fig.legend(handles=[Patch(color=c, label=lab) for lab, c in legend], loc="outside upper center",
               ncol=min(5, len(legend)), fontsize=8, frameon=False)
    if probs is not None:
        ax2 = axes[1][0]
        im = ax2.imshow(np.log10(np.maximum(probs, 1e-6)), aspect="auto", interpolation="nearest",
                        cmap="magma")
        ax2.set_yticks(range(0, rows, step), labels[::step])
        ax2.set_ylabel("MoE layer")
        ax2.set_xlabel("experts of the layer by heat rank (0 = most selected)")
        ax2.set_title("selection probability per token: the heat the plan was solved for")
        bar = fig.colorbar(im, ax=ax2, fraction=0.03, pad=0.01)
        bar.set_label("log10 P(selected)", fontsize=8)   # short: a long label is cut at the figure's edge
    return _png(fig)


def term_rows(predicted: RunReport, measured: RunReport) -> list[tuple[str, float | None, float | None]]:
    """(term, predicted ms/token, measured ms/token) of the decode-time terms both sides can have.

    A run times attention inside its dense trunk, so the predicted dense and attention terms are added.
    Expert compute is one row per device of either side. None where a side has no figure.
    """
    def ms(v):
        return None if v is None else 1e3 * float(v)

    def both(a, b):
        return None if a is None and b is None else (a or 0.0) + (b or 0.0)

    rows = [("decode (total)", ms(predicted.decode_s_per_token), ms(measured.decode_s_per_token)),
            ("dense + attention", ms(both(predicted.dense_s_per_token, predicted.attention_s_per_token)),
             ms(both(measured.dense_s_per_token, measured.attention_s_per_token))),
            ("expert layers (wall)", ms(predicted.expert_layers_s_per_token),
             ms(measured.expert_layers_s_per_token))]
    pc, mc = predicted.expert_compute_s_per_token or {}, measured.expert_compute_s_per_token or {}
    rows += [(f"expert compute {dev}", ms(pc.get(dev)), ms(mc.get(dev))) for dev in dict.fromkeys([*pc, *mc])]
    rows += [(label, ms(getattr(predicted, f)), ms(getattr(measured, f)))
             for label, f in (("disk wait", "disk_wait_s_per_token"), ("disk read", "disk_read_s_per_token"),
                              ("transfers", "transfer_s_per_token"))]
    return [r for r in rows if r[1] is not None or r[2] is not None]


def terms_chart(predicted: RunReport, measured: RunReport, title: str = "") -> bytes:
    """Predicted beside measured: ms/token per term (left), share of expert uses per tier (right)."""
    from colibri_plan.formats.report import HIT_TIERS

    plt = _pyplot()
    rows = term_rows(predicted, measured)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8),
                                  gridspec_kw={"width_ratios": [2.2, 1]})
    y = np.arange(len(rows))
    h = 0.38
    ax.barh(y - h / 2, [r[1] or 0.0 for r in rows], h, label="predicted", color=PREDICTED_COLOUR)
    ax.barh(y + h / 2, [r[2] or 0.0 for r in rows], h, label="measured", color=MEASURED_COLOUR)
    for i, (_, p, m) in enumerate(rows):
        for off, v in ((-h / 2, p), (h / 2, m)):
            ax.text(v or 0.0, i + off, " -" if v is None else f" {v:.1f}", va="center", fontsize=7)
    ax.set_yticks(y, [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode token")
    ax.set_title(title or "decode time per term")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    y2 = np.arange(len(HIT_TIERS))
    ax2.barh(y2 - h / 2, [100 * predicted.hit_rate.get(t, 0.0) for t in HIT_TIERS], h,
             color=PREDICTED_COLOUR, label="predicted")
    ax2.barh(y2 + h / 2, [100 * measured.hit_rate.get(t, 0.0) for t in HIT_TIERS], h,
             color=MEASURED_COLOUR, label="measured")
    ax2.set_yticks(y2, list(HIT_TIERS))
    ax2.invert_yaxis()
    ax2.set_xlim(0, 100)
    ax2.set_xlabel("% of expert uses served from")
    ax2.set_title("hit rate per tier")
    ax2.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def whatif_chart(curves: dict[str, list[dict]], current: dict[str, float] | None = None) -> bytes:
    """One panel per what-if kind: predicted tok/s of the optimised plan and of colibrì's hot-first fill as
    the resource varies (rows of :func:`colibri_plan.planner.whatif.what_if`); ``current`` marks the
    plan's own value of each resource."""
    plt = _pyplot()
    labels = {"ram": "RAM for experts (GB)", "vram": "VRAM per GPU (GB)", "nvme": "NVMe read (GB/s)"}
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 3.8), squeeze=False)
    for ax, (kind, rows) in zip(axes[0], curves.items()):
        x = [r["value"] for r in rows]
        ax.plot(x, [r["tok_s"] for r in rows], "o-", label="optimised plan")
        ax.plot(x, [r["hot_first_tok_s"] for r in rows], "s--", label="colibrì hot-first fill")
        if current and kind in current:
            ax.axvline(current[kind], color="#888", linestyle=":", label="this plan")
        if kind == "nvme":  # 1/4x to 4x the measured rate: a log axis, labelled in plain numbers
            from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator(x[::2]))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel(labels[kind])
        ax.set_ylabel("predicted decode tok/s")
        ax.set_title(f"what-if: {kind}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)
