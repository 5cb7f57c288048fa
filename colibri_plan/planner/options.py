"""The options of one solve (`colibri-plan solve`), each default written here once.

:class:`SolveOptions` is built by the CLI from its flags (their click defaults are read from
:data:`DEFAULTS`) and passed whole to :func:`colibri_plan.planner.make.make_plan` and
:func:`~colibri_plan.planner.make.build_setup`; library callers build one with the fields they change.
The values stay as the user typed them ("auto" or a GB figure as text): the planner checks them
(:func:`colibri_plan.planner.make.check_options`), so an error names the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: the cost model is not imported to build options
    from colibri_plan.formats.coefficients import Coefficients

#: prompt length (tokens) the plan predicts the prefill at when ``--prompt-tokens`` is not given (or
#: ``--context`` when that is shorter: a prompt the plan's KV budget holds)
DEFAULT_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class SolveOptions:
    """What to solve for and how (the ``solve`` flags in brackets).

    Budgets:
        ram: "auto" (available memory minus headroom, dense, KV cache and buffers) or the process RAM
            budget in GB, as text [--ram]. vram: "auto" or each card's memory in GB, "a" or "a,b,c" [--vram].
        headroom: OS + page-cache headroom in GB for ``ram`` "auto"; None: max(2.5 GB, 5% of available)
            [--headroom]. vram_reserve_gb: GB taken off each GPU's memory, its free memory under ``vram``
            "auto" or the card's size given in ``vram`` [--vram-reserve].
        context_tokens: tokens the KV cache is budgeted for [--context].
        dense_fmt: quant format the dense trunk is budgeted in; None: as the model stores it (a pack's),
            else the expert format [--dense-format].
        trunk: where the dense trunk, attention and KV cache run: "auto" (least predicted decode time),
            "cpu", a device key ("cuda:0") or "split" [--trunk].
        lru_slots: "auto" or LRU slots per MoE layer (a whole number, int or text) [--lru-slots].
    Engine knobs (planner.knobs):
        target: "colibri-plan" (ours) or "colibri" [--target]. queue_depth: "auto" (the target's) or
            expert reads in flight, 1..64 [--queue-depth]. keep_host_copies: VRAM experts keep a host
            copy in RAM, charged to ``ram`` [--keep-host-copies]. reads: how our engine reads streamed
            experts: "auto" (buffered when they beat O_DIRECT inside the budget, planner.reads),
            "o_direct" or "buffered" [--reads].
        repin_every: live re-pinning every N decode tokens; 0: off [--repin-every]. repin_window: tokens
            of routing the re-pinning remembers; None: 4 x ``repin_every`` [--repin-window].
    Predictions and the solver:
        prompt_tokens: prompt length (tokens) of the predicted prefill; None: no prefill prediction (the
            CLI gives :func:`default_prompt_tokens` then) [--prompt-tokens].
        method: "auto", "exact" or "aggregate" [--method]. time_limit_s: solver seconds [--time-limit].
        seed: seed of synthesised heat [--seed]. coef: cost-model coefficients; None: all 1.0 (the CLI
            reads them from --coefficients FILE).
    """

    ram: str = "auto"
    vram: str = "auto"
    headroom: str | None = None
    vram_reserve_gb: float = 2.0
    context_tokens: int = 4096
    dense_fmt: str | None = None
    trunk: str = "auto"
    lru_slots: str | int = "auto"
    target: str = "colibri-plan"
    queue_depth: str | int = "auto"
    keep_host_copies: bool = False
    reads: str = "auto"
    repin_every: int = 0
    repin_window: int | None = None
    prompt_tokens: int | None = None
    method: str = "auto"
    time_limit_s: float = 30.0
    seed: int = 0
    coef: Coefficients | None = None

    @property
    def vram_reserve_bytes(self) -> int:
        """``vram_reserve_gb`` in bytes (1 GB = 1e9 B)."""
        return int(self.vram_reserve_gb * 1e9)


#: the defaults, for the CLI's flags and for readers of plans that predate a field
DEFAULTS = SolveOptions()


def default_prompt_tokens(context_tokens: int) -> int:
    """The prompt length `solve` predicts the prefill at without ``--prompt-tokens``:
    :data:`DEFAULT_PROMPT_TOKENS`, or ``context_tokens`` when that is shorter (at least 1)."""
    return max(1, min(DEFAULT_PROMPT_TOKENS, int(context_tokens)))
