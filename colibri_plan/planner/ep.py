"""Expert placement for expert-parallel serving (SGLang, vLLM): which logical expert every physical slot
of every GPU holds, per MoE layer, balanced from heat and chosen with a cost model.

Per layer the solver builds candidates and keeps the cheapest by :class:`~colibri_plan.planner.ep_cost.
EpCostModel` (slowest GPU's selections plus cross-node sends), among those whose slowest GPU carries no
more than DeepSeek's eplb gives for the same heat and slots (so it is never less balanced than the
engines' own balancer, layer by layer):

* ``eplb+search`` — eplb's placement (:mod:`~colibri_plan.planner.ep_eplb`) improved by the search of
  :mod:`~colibri_plan.planner.ep_pack`, inside each node when eplb placed groups on nodes;
* ``global`` — replicas over all GPUs, searched from greedy packing (the best balance, the most sends);
* ``grouped`` — with group-limited routing over several nodes: whole groups on nodes (balanced by the
  same swap search over groups), then the search inside every node (few sends, less balance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.planner import ep_cost, ep_pack
from colibri_plan.planner.ep_eplb import eplb_rebalance, greedy_pack


@dataclass(frozen=True)
class EpTopology:
    """GPUs, nodes and physical slots of an expert-parallel deployment.

    Attributes:
        n_experts: logical experts per MoE layer (E).
        n_gpus: GPUs (G), node-major: GPU g is on node g // gpus_per_node.
        n_nodes: nodes (N, divides G).
        n_redundant: redundant slots per layer (R); P = E + R physical slots.
        gpu_slots: slots of each GPU ``[G]`` (P / G each, or the two nearest counts when G does not
            divide P, the larger ones spread over the nodes in turn).
    """

    n_experts: int
    n_gpus: int
    n_nodes: int
    n_redundant: int
    gpu_slots: tuple[int, ...] = field(default=())

    @classmethod
    def make(cls, n_experts: int, n_gpus: int, n_nodes: int = 1, n_redundant: int = 0,
             max_slots_per_gpu: int | None = None) -> EpTopology:
        """Validate the counts and lay out the slots.

        Raises:
            InputError: G < 1, N does not divide G, R < 0, more GPUs than slots, or a GPU would need more
                slots than ``max_slots_per_gpu`` (its expert memory).
        """
        if n_gpus < 1 or n_nodes < 1:
            raise InputError(f"{n_gpus} GPUs in {n_nodes} nodes: give at least one GPU and one node")
        if n_gpus % n_nodes:
            raise InputError(f"{n_gpus} GPUs do not split into {n_nodes} nodes of equal size; give a node "
                             "count that divides the GPU count")
        if n_redundant < 0:
            raise InputError(f"redundant slots must be >= 0, got {n_redundant}")
        slots = n_experts + n_redundant
        if n_gpus > slots:
            raise InputError(f"{n_gpus} GPUs but only {slots} expert slots per layer ({n_experts} experts + "
                             f"{n_redundant} redundant): every GPU needs one; use --redundant "
                             f"{n_gpus - n_experts} or more, or fewer GPUs")
        base, extra = divmod(slots, n_gpus)
        caps = np.full(n_gpus, base, dtype=np.int64)
        gpn = n_gpus // n_nodes
        for i in range(extra):                       # larger GPUs in turn over the nodes
            caps[(i % n_nodes) * gpn + i // n_nodes] += 1
        if max_slots_per_gpu is not None and caps.max() > max_slots_per_gpu:
            raise InputError(f"a GPU needs {int(caps.max())} expert slots per layer but its expert memory "
                             f"holds {max_slots_per_gpu}; use more GPUs or fewer redundant slots")
        return cls(n_experts, n_gpus, n_nodes, n_redundant, tuple(int(c) for c in caps))

    @property
    def n_slots(self) -> int:
        return self.n_experts + self.n_redundant

    @property
    def gpus_per_node(self) -> int:
        return self.n_gpus // self.n_nodes

    @property
    def even(self) -> bool:
        """Every GPU holds the same number of slots (what SGLang and vLLM require)."""
        return len(set(self.gpu_slots)) == 1

    def slot_gpu(self) -> np.ndarray:
        """GPU of every physical slot ``[P]`` (GPU 0's slots first)."""
        return np.repeat(np.arange(self.n_gpus), self.gpu_slots)

    def slot_node(self) -> np.ndarray:
        """Node of every physical slot ``[P]``."""
        return self.slot_gpu() // self.gpus_per_node


@dataclass
class EpSolution:
    """A placement of every MoE layer, beside eplb's for the same inputs.

    Attributes:
        phy2log: int64 ``[layers, P]`` logical expert of every slot (the solver's choice).
        loads: float ``[layers, G]`` GPU loads, selections per token.
        sends: float ``[layers]`` expected cross-node sends per token (0 on one node).
        layer_s: float ``[layers]`` cost-model seconds per token.
        method: the candidate kept per layer.
        candidates: per layer, {candidate: {"max_load", "sends", "layer_s"}} of every candidate tried.
        eplb: the same figures of DeepSeek eplb's placement: {"phy2log", "loads", "sends", "layer_s",
            "policy"}.
        seconds: wall seconds of the solve (eplb's run included).
    """

    phy2log: np.ndarray
    loads: np.ndarray
    sends: np.ndarray
    layer_s: np.ndarray
    method: list[str]
    candidates: list[dict]
    eplb: dict
    seconds: float = 0.0


def grouped_applies(topo: EpTopology, n_group: int) -> bool:
    """Whether group-limited routing can keep groups whole on nodes (eplb's hierarchical condition)."""
    return topo.n_nodes > 1 and n_group > 1 and n_group % topo.n_nodes == 0 and \
        topo.n_experts % n_group == 0


def _fill_slots(topo: EpTopology, pools: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """One layer's ``phy2log [P]`` from pool placements ``(experts, item_e, gpu)``: ``experts`` maps the
    pool's local expert ids to logical ones, ``gpu`` are global GPU ids; each GPU's slots in expert order."""
    base = np.concatenate([[0], np.cumsum(topo.gpu_slots)])
    row = np.full(topo.n_slots, -1, dtype=np.int64)
    for experts, item_e, gpu in pools:
        for g in np.unique(gpu):
            held = np.sort(experts[item_e[gpu == g]])
            row[base[g]:base[g] + held.size] = held
    if np.any(row < 0):
        raise AssertionError("a slot was left empty")   # the pools cover every GPU's slots exactly
    return row


def _node_pools(topo: EpTopology, w: np.ndarray, node_experts: list[np.ndarray],
                starts: list | None = None) -> list:
    """Search every node's GPUs for its experts; ``starts`` (optional) are per-node (item_e, gpu) in
    node-local ids to improve."""
    gpn, caps = topo.gpus_per_node, np.asarray(topo.gpu_slots)
    pools = []
    for node, experts in enumerate(node_experts):
        gpus = np.arange(node * gpn, (node + 1) * gpn)
        item_e, gpu = ep_pack.solve_pool(w[experts], caps[gpus], None if starts is None else starts[node])
        pools.append((experts, item_e, gpus[gpu]))
    return pools


def _from_row(topo: EpTopology, row: np.ndarray, node_experts: list[np.ndarray] | None):
    """A layer's ``phy2log`` row as pool starts: one pool of all GPUs, or one per node (local ids)."""
    slot_gpu = topo.slot_gpu()
    if node_experts is None:
        return [(row.copy(), slot_gpu.copy())]
    gpn, starts = topo.gpus_per_node, []
    for node, experts in enumerate(node_experts):
        mine = slot_gpu // gpn == node
        local = np.searchsorted(experts, row[mine])          # experts sorted: logical -> local id
        starts.append((local, slot_gpu[mine] - node * gpn))
    return starts


def _group_nodes(topo: EpTopology, w: np.ndarray, n_group: int) -> list[np.ndarray]:
    """Whole groups onto nodes, node loads balanced (greedy, then the swap search over groups); the
    sorted logical experts of every node."""
    size = topo.n_experts // n_group
    group_w = w.reshape(n_group, size).sum(axis=1)
    per_node = np.full(topo.n_nodes, n_group // topo.n_nodes)
    node_of, _ = greedy_pack(group_w[None, :], per_node)
    one = np.ones(n_group, dtype=np.int64)   # a group is never on a node twice
    node_of = ep_pack.swap_search(group_w, np.arange(n_group), node_of[0], topo.n_nodes, one)
    return [np.sort((np.flatnonzero(node_of == n)[:, None] * size + np.arange(size)).ravel())
            for n in range(topo.n_nodes)]


def _eplb_nodes(topo: EpTopology, row: np.ndarray) -> list[np.ndarray]:
    """The logical experts eplb's placement put on every node (sorted)."""
    node = topo.slot_node()
    return [np.unique(row[node == n]) for n in range(topo.n_nodes)]


def solve_ep(weight: np.ndarray, topo: EpTopology, cost: ep_cost.EpCostModel, *, top_k: int,
             n_group: int = 1, topk_group: int = 1, traces: list | None = None, trace_tokens: int = 1024,
             seed: int = 0, progress=None) -> EpSolution:
    """Place the physical slots of every MoE layer (module docstring).

    Args:
        weight: float ``[layers, E]`` selection probability per token of every expert (heat).
        topo: GPUs, nodes and slots.
        cost: the cost model that picks among candidates.
        top_k: experts a token selects (for sampled traces).
        n_group, topk_group: group-limited routing of the model (1, 1 without).
        traces: optional per-layer int ``[T, k]`` routing traces (None entries: sample one).
        trace_tokens: tokens of a sampled trace.
        seed: seed of sampled traces.
        progress: optional ``fn(done, total)`` per layer.

    Raises:
        InputError: weight is not ``[layers, E]`` of finite values >= 0.
    """
    import time

    t0 = time.perf_counter()
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2 or weight.shape[1] != topo.n_experts or not np.all(np.isfinite(weight)) \
            or np.any(weight < 0):
        raise InputError(f"heat must be [layers, {topo.n_experts}] finite loads >= 0, got {weight.shape}")
    layers = weight.shape[0]
    slot_gpu, slot_node = topo.slot_gpu(), topo.slot_node()
    e_p2l, _, _ = eplb_rebalance(weight, topo.n_slots, max(n_group, 1), topo.n_nodes, topo.n_gpus,
                                 np.asarray(topo.gpu_slots))
    hier = n_group > 1 and n_group % topo.n_nodes == 0 and topo.n_experts % n_group == 0
    grouped = grouped_applies(topo, n_group)
    out_rows, method, cands, sends, e_sends = [], [], [], np.zeros(layers), np.zeros(layers)

    def evaluate(row, w, trace):
        load = ep_cost.gpu_loads(row[None, :], w[None, :], slot_gpu, topo.n_gpus)[0]
        snd = 0.0 if trace is None else ep_cost.sends_per_token(
            trace, ep_cost.node_share(row, slot_node, topo.n_nodes, topo.n_experts))
        return {"max_load": float(load.max()), "sends": snd, "layer_s": cost.layer_s(float(load.max()), snd)}

    for li in range(layers):
        w = weight[li]
        trace = None
        if topo.n_nodes > 1:
            given = traces[li] if traces is not None and li < len(traces) else None
            trace = given if given is not None else ep_cost.sample_group_trace(
                w / max(w.sum(), 1e-300) * top_k, trace_tokens, top_k, n_group, topk_group, seed + li)
        rows = {}
        nodes = _eplb_nodes(topo, e_p2l[li]) if hier and topo.n_nodes > 1 else None
        rows["eplb+search"] = _fill_slots(topo, _search_from(topo, w, e_p2l[li], nodes))
        rows["global"] = _fill_slots(topo, [(np.arange(topo.n_experts),
                                             *ep_pack.solve_pool(w, np.asarray(topo.gpu_slots)))])
        if grouped:
            rows["grouped"] = _fill_slots(topo, _node_pools(topo, w, _group_nodes(topo, w, n_group)))
        base = evaluate(e_p2l[li], w, trace)
        e_sends[li] = base["sends"]
        scored = {k: evaluate(r, w, trace) for k, r in rows.items()}
        allowed = [k for k, s in scored.items() if s["max_load"] <= base["max_load"] * (1 + 1e-12)]
        best = min(allowed, key=lambda k: (scored[k]["layer_s"], scored[k]["max_load"]))
        out_rows.append(rows[best])
        method.append(best)
        cands.append(scored)
        sends[li] = scored[best]["sends"]
        if progress is not None:
            progress(li + 1, layers)
    phy2log = np.array(out_rows, dtype=np.int64)
    loads = ep_cost.gpu_loads(phy2log, weight, slot_gpu, topo.n_gpus)
    e_loads = ep_cost.gpu_loads(e_p2l, weight, slot_gpu, topo.n_gpus)
    layer_s = np.array([cost.layer_s(m, s) for m, s in zip(loads.max(axis=1), sends)])
    e_layer_s = np.array([cost.layer_s(m, s) for m, s in zip(e_loads.max(axis=1), e_sends)])
    return EpSolution(phy2log=phy2log, loads=loads, sends=sends, layer_s=layer_s, method=method,
                      candidates=cands, eplb={"phy2log": e_p2l, "loads": e_loads, "sends": e_sends,
                                              "layer_s": e_layer_s,
                                              "policy": "hierarchical" if hier else "global"},
                      seconds=time.perf_counter() - t0)


def _search_from(topo: EpTopology, w: np.ndarray, row: np.ndarray, nodes: list | None) -> list:
    """eplb's layer placement improved by the pool search: inside every node (eplb placed groups on
    nodes) or over all GPUs."""
    if nodes is None:
        (item_e, gpu), = _from_row(topo, row, None)
        item_e, gpu = ep_pack.solve_pool(w, np.asarray(topo.gpu_slots), (item_e, gpu))
        return [(np.arange(topo.n_experts), item_e, gpu)]
    return _node_pools(topo, w, nodes, _from_row(topo, row, nodes))
