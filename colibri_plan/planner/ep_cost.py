"""What an expert-parallel placement costs: GPU loads, balancedness, cross-node sends, seconds per token.

Loads. A logical expert's load is its selection probability per token (heat counts / tokens; a row sums
to top-k). It is split evenly over the expert's replicas, so GPU g carries ``sum(w[e] / count[e])`` over
its slots, in selections per token of the whole batch.

Balancedness of a layer is mean GPU load / max GPU load (SGLang's utilisation rate). Over layers it is
reported as vLLM's EPLB logs it: the sum over layers of the mean divided by the sum of the max; since a
layer takes as long as its slowest GPU, that is the ideal expert time over the time the placement gives.
The plain mean of the per-layer ratios is reported beside it.

Cross-node sends. Tokens start evenly on every GPU (data-parallel attention); a token sends its hidden
state once to every other node that serves at least one of its top-k selections (DeepEP's internode
dispatch sends once per node and forwards inside it over NVLink); each selection goes to one of the
expert's replicas, chosen evenly. The expected sends per token are read from a routing trace: the heat's
own (``run --stats-out``) when it has one, else one sampled from the probabilities — with group-limited
top-k (DeepSeek-V3's ``n_group`` / ``topk_group``: the groups with the best two expert scores, then the
top-k inside them) when the model routes that way.

Seconds. Per token of a full batch, one layer costs ``max GPU load x selection_s + sends x send_s``:
``selection_s`` = the expert's 6·H·I FLOPs / the GPU's FLOP/s, ``send_s`` = the bytes of one send
(dispatch in FP8 with its scales, combine in BF16: about 3·H) / (GPUs x per-GPU internode bytes/s),
since a GPU sends for its share 1/G of the tokens. Compute and communication are added (no overlap),
which ranks placements the same way as long as neither dominates alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.heatsynth import sample_trace

#: defaults of the cost model: an H200 running FP8 grouped GEMMs, one 400 Gb/s NIC per GPU
DEFAULT_GPU_TFLOPS = 500.0
DEFAULT_INTERNODE_GBPS = 50.0


@dataclass(frozen=True)
class EpCostModel:
    """Seconds of one MoE layer per token of a full batch (module docstring).

    Attributes:
        selection_s: GPU seconds of one (token, expert) selection.
        send_s: seconds one cross-node send of one token adds (already divided by the GPU count).
        gpu_tflops: effective FP8 TFLOP/s of one GPU the figure came from.
        internode_gbps: per-GPU internode GB/s (1e9 B/s) it came from.
        send_bytes: bytes of one send (dispatch + combine).
    """

    selection_s: float
    send_s: float
    gpu_tflops: float
    internode_gbps: float
    send_bytes: int

    @classmethod
    def for_model(cls, hidden_size: int, moe_intermediate_size: int, n_gpus: int,
                  gpu_tflops: float = DEFAULT_GPU_TFLOPS,
                  internode_gbps: float = DEFAULT_INTERNODE_GBPS) -> EpCostModel:
        """The cost model of a model's expert geometry (H, I) on ``n_gpus`` GPUs.

        Raises:
            InputError: a rate that is not positive.
        """
        if not (gpu_tflops > 0 and internode_gbps > 0):
            raise InputError(f"cost model: --gpu-tflops ({gpu_tflops}) and --internode-gbps "
                             f"({internode_gbps}) must be positive")
        flops = 6.0 * hidden_size * moe_intermediate_size              # gate, up, down: 2 FLOPs per MAC
        send_bytes = int(hidden_size * 3 + 4 * -(-hidden_size // 128))  # FP8 + scales out, BF16 back
        return cls(selection_s=flops / (gpu_tflops * 1e12),
                   send_s=send_bytes / (n_gpus * internode_gbps * 1e9),
                   gpu_tflops=float(gpu_tflops), internode_gbps=float(internode_gbps), send_bytes=send_bytes)

    def layer_s(self, max_load: float, sends: float) -> float:
        """Seconds per token of one layer: ``max_load`` selections on the slowest GPU, ``sends``."""
        return max_load * self.selection_s + sends * self.send_s

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_loads(phy2log: np.ndarray, weight: np.ndarray, slot_gpu: np.ndarray, n_gpus: int) -> np.ndarray:
    """GPU loads ``[layers, G]`` (selections per token) of a placement.

    Args:
        phy2log: int ``[layers, P]`` logical expert of every slot.
        weight: float ``[layers, E]`` expert loads.
        slot_gpu: int ``[P]`` GPU of every slot.
        n_gpus: G.
    """
    layers, n_exp = weight.shape
    count = np.stack([np.bincount(r, minlength=n_exp) for r in phy2log])       # [L, E]
    share = np.take_along_axis(weight / np.maximum(count, 1), phy2log, axis=1)  # [L, P]
    out = np.zeros((layers, n_gpus))
    for g in range(n_gpus):
        out[:, g] = share[:, slot_gpu == g].sum(axis=1)
    return out


def balancedness(loads: np.ndarray) -> dict:
    """Balancedness of GPU loads ``[layers, G]``: ``{"balancedness"`` (sum of means / sum of maxes, as
    vLLM's EPLB logs it), ``"layer_mean"`` (mean of the per-layer ratios), ``"per_layer"`` [layers]}``.
    A layer with no load counts as balanced."""
    mean, top = loads.mean(axis=1), loads.max(axis=1)
    per = np.where(top > 0, mean / np.where(top > 0, top, 1.0), 1.0)
    total = float(top.sum())
    return {"balancedness": float(mean.sum() / total) if total > 0 else 1.0,
            "layer_mean": float(per.mean()) if per.size else 1.0, "per_layer": per}


def sample_group_trace(p: np.ndarray, n_tokens: int, top_k: int, n_group: int, topk_group: int,
                       seed: int = 0) -> np.ndarray:
    """A token-level routing trace ``[n_tokens, top_k]`` (int64 expert ids) for one layer.

    Scores are ``log p + Gumbel noise``; with ``n_group > 1`` a token keeps the ``topk_group`` groups
    whose two best scores add up highest and picks its top-k inside them (DeepSeek-V3's rule), else it
    picks the top-k of all. The trace's frequencies are close to ``p``, not equal: it models which
    experts are chosen together, not how often.
    """
    if n_group <= 1 or topk_group >= n_group:
        return sample_trace(p, n_tokens, top_k, seed=seed).astype(np.int64)
    rng = np.random.default_rng(seed)
    n_exp = p.size
    score = np.log(np.maximum(p, 1e-300))[None, :] + rng.gumbel(size=(n_tokens, n_exp))  # [T, E]
    grouped = score.reshape(n_tokens, n_group, n_exp // n_group)
    best_two = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)                  # [T, groups]
    keep = np.argpartition(-best_two, topk_group - 1, axis=1)[:, :topk_group]    # [T, topk_group]
    mask = np.full((n_tokens, n_group), -np.inf)
    np.put_along_axis(mask, keep, 0.0, axis=1)
    score = (grouped + mask[:, :, None]).reshape(n_tokens, n_exp)
    return np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]


def node_share(phy2log_row: np.ndarray, slot_node: np.ndarray, n_nodes: int, n_exp: int) -> np.ndarray:
    """Share of each expert's selections served on each node ``[E, N]`` (its replicas there / all)."""
    share = np.zeros((n_exp, n_nodes))
    np.add.at(share, (phy2log_row, slot_node), 1.0)
    return share / np.maximum(share.sum(axis=1, keepdims=True), 1.0)


def sends_per_token(trace: np.ndarray, share: np.ndarray) -> float:
    """Expected cross-node sends per token for a trace ``[T, k]`` and node shares ``[E, N]``: the
    expected number of nodes a token's selections reach, times (N - 1) / N (its own node is free)."""
    n_nodes = share.shape[1]
    if n_nodes <= 1 or not trace.size:
        return 0.0
    miss = np.prod(1.0 - share[trace], axis=1)                                  # [T, N] node not reached
    reached = (1.0 - miss).sum(axis=1).mean()
    return float(reached * (n_nodes - 1) / n_nodes)
