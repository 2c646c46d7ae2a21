"""What a dynamic sparse training run does: the method, its budget and schedule, the permutations
(:class:`DSTConfig`); and what it trains, on what, for how long (:class:`TrainConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shuffleprune.errors import UserError, check_values
from shuffleprune.masks import parse_pattern
from shuffleprune.runtime.determinism import check_seed

METHODS = ("dense", "rigl", "set", "srigl", "dsb", "pixelfly", "diag", "nm", "keep")
MASK_METHODS = ("rigl", "set", "srigl", "dsb", "nm", "keep")  # a mask is all they add: fused MoE experts can take them
DEFAULT_SPARSITY = 0.9   # the unstructured methods' budget, as RigL's papers train


@dataclass
class DSTConfig:
    method: str = "rigl"
    sparsity: float | None = None  # None: 1 − N/M for nm, the model's own zeros for keep, else 0.9
    distribution: str = "erk"     # erk | uniform
    delta_t: int = 100            # steps between mask updates
    alpha: float = 0.3            # initial drop fraction
    t_end: int = 1000             # no updates from here on (RigL: 75% of training)
    gamma_sal: float = 0.3        # srigl: neuron ablation threshold
    block: int = 16               # dsb / pixelfly: block size (rows and columns)
    lowrank_share: float = 0.25   # pixelfly: share of a layer's budget given to the low-rank term
    tau_start: float = 1.0        # diag: soft top-K temperature, annealed geometrically to tau_end
    tau_end: float = 0.01         #       over the first t_end steps, then the K diagonals are frozen
    pattern: str = "2:4"          # nm: keep N of every M consecutive input columns (sparsity must be 1 − N/M)
    perm: str = "none"            # none | random | learned (ShuffleSparse, for column-structured methods)
    perm_lr: float = 1e-3         # Adam on the soft permutations
    lambda_max: float = 1e-4      # l1−l2 penalty weight, ramped from 0 over t_perm steps
    t_perm: int = 1000            # permutation learning stops (all layers hardened) at this step
    delta: float = 0.22           # a layer hardens once its P(M) < delta
    perm_init: float = 0.5        # soft start α·I + (1−α)/d·11ᵀ
    sparse_head: bool = False     # also sparsify an untied LM head (prune leaves it dense; export compresses it)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sparsity is None and self.method != "keep":   # the budget a method implies (nm: its pattern's)
            self.sparsity = 1 - self.nm()[0] / self.nm()[1] if self.method == "nm" else DEFAULT_SPARSITY

    def check(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown DST method '{self.method}'; use one of {', '.join(METHODS)}")
        if self.method == "keep":
            if self.sparsity is not None or self.perm != "none":
                raise UserError("method 'keep' holds the zeros the model already has (a pruned checkpoint's, in its "
                                "own order): it takes no sparsity and no permutation")
            return
        check_values(("--sparsity", self.sparsity, 0.0 <= self.sparsity < 1.0, "in [0, 1)"))
        if self.distribution not in ("erk", "uniform"):
            raise UserError(f"unknown --distribution '{self.distribution}'; use erk or uniform")
        check_values(("--delta-t", self.delta_t, self.delta_t >= 1, ">= 1"),
                     ("--t-end", self.t_end, self.t_end >= 0, ">= 0"),
                     ("--alpha", self.alpha, 0 <= self.alpha <= 1, "in [0, 1]"),
                     ("--block", self.block, self.block >= 1, ">= 1"),
                     ("lowrank_share", self.lowrank_share, 0.0 <= self.lowrank_share < 1.0, "in [0, 1)"),
                     ("gamma_sal", self.gamma_sal, 0.0 <= self.gamma_sal <= 1.0, "in [0, 1]"))
        if not 0.0 < self.tau_end <= self.tau_start:
            raise UserError("the diag temperatures need 0 < tau_end ≤ tau_start")
        check_values(("--perm-lr", self.perm_lr, self.perm_lr > 0, "> 0"),
                     ("--lambda-max", self.lambda_max, self.lambda_max >= 0, ">= 0"),
                     ("--t-perm", self.t_perm, self.t_perm >= 0, ">= 0"),
                     ("--delta", self.delta, self.delta > 0, "> 0"),
                     ("--perm-start", self.perm_init, 0.0 <= self.perm_init <= 1.0, "in [0, 1]"))
        if self.perm not in ("none", "random", "learned"):
            raise UserError(f"unknown --perm '{self.perm}'; use none, random or learned")
        if self.perm != "none" and self.method in ("dense", "rigl", "set"):
            raise UserError(f"--perm needs a structured method (srigl, dsb, pixelfly, diag, nm); {self.method} has no "
                            "structure for a permutation to help")
        if self.method == "nm":
            n, m = self.nm()
            if abs(self.sparsity - (1 - n / m)) > 1e-9:
                raise UserError(f"--method nm --pattern {self.pattern} means sparsity {1 - n / m:g}; "
                                f"pass --sparsity {1 - n / m:g} (or leave it out)")

    def nm(self) -> tuple[int, int]:
        """``(N, M)`` of ``pattern``."""
        p = parse_pattern(self.pattern, None)
        return p.n, p.m


@dataclass
class TrainConfig:
    arch: str = "gpt2"
    config_kw: dict = field(default_factory=dict)   # overrides of the transformers config
    tokenizer: str = "default"                      # embedded model's tokenizer, bpe:N (trained here), a dir / hub id
    data: str = "wiki"
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_tokens: int | None = 65536
    checkpoint_every: int = 200
    seed: int = 0
    trust_remote_code: bool = False   # run the config, model and tokenizer code an --arch / --tokenizer checkpoint ships
    init: str | None = None           # a pruned checkpoint to fine-tune (its zeros held) instead of a fresh model

    def check(self) -> None:
        """Refuse sizes and schedule settings no run can use."""
        check_values(("--steps", self.steps, self.steps >= 1, ">= 1"),
                     ("--batch-size", self.batch_size, self.batch_size >= 1, ">= 1"),
                     ("--seq-len", self.seq_len, self.seq_len >= 8, ">= 8"),
                     ("--lr", self.lr, self.lr > 0, "> 0"),
                     ("--warmup", self.warmup, self.warmup >= 0, ">= 0"),
                     ("weight_decay", self.weight_decay, self.weight_decay >= 0, ">= 0"),
                     ("grad_clip", self.grad_clip, self.grad_clip > 0, "> 0"))
        check_seed(self.seed)
        evals = "only before the first step and at the end" if self.init is not None else "only at the end"
        check_values(("--eval-every", self.eval_every, self.eval_every >= 0, f">= 0 (0: {evals})"),
                     ("--checkpoint-every", self.checkpoint_every, self.checkpoint_every >= 0,
                      ">= 0 (0: only at the end)"))
        if self.eval_tokens is not None and self.eval_tokens < self.seq_len:
            raise UserError(f"--eval-tokens must be at least one window (--seq-len {self.seq_len}), "
                            f"got {self.eval_tokens}")
        if self.init is None:
            _check_tokenizer(self.tokenizer)


def _check_tokenizer(spec: str) -> None:
    """Refuse a ``--tokenizer`` that cannot be had, before anything is read or written."""
    from shuffleprune.models import check_tokenizer_spec, is_embedded

    if spec.startswith("bpe:"):
        if not spec[4:].isdigit() or int(spec[4:]) < 1:
            raise UserError(f"--tokenizer {spec}: use bpe:VOCAB_SIZE, e.g. bpe:8192")
    elif not is_embedded(spec):
        check_tokenizer_spec(spec)
