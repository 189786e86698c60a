"""Parameter metadata: which optimizer a parameter belongs to and its natural Newton-Schulz blocks.

The contract (docs/architecture.md, "Parameter metadata"): the *model* says how each parameter splits into
blocks; the optimizer (`etude.optim.groups`) reads it and never guesses from names.

- q/k/v projections ``[H*Dh, D]``: heads along dim 0 (``kind="heads_dim0"``, H blocks of [Dh, D]);
- o projection ``[D, H*Dh]``: heads along dim 1 (``kind="heads_dim1"``, H blocks of [D, Dh]);
- stacked experts ``w1, w3: [E, D, F]``, ``w2: [E, F, D]``: experts along dim 0 (``kind="experts"``);
- any other matrix: one block (``kind="matrix"``);
- embeddings, lm head, norms, router, biases: AdamW (``optimizer="adamw"``).

Modules declare metadata through a method ``param_meta(self) -> dict[str, ParamMeta]`` whose keys
are parameter names relative to the module (dotted names reach into plain children such as
``nn.Linear``). The declaration lives on the module, not on the parameter object, so it survives
FSDP2 (``fully_shard`` swaps parameters for DTensors but keeps modules and their FQNs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import nn

Kind = Literal[
    "heads_dim0", "heads_dim1", "experts", "matrix", "embedding", "head", "norm", "router", "bias"
]
MUON_KINDS = ("heads_dim0", "heads_dim1", "experts", "matrix")


@dataclass(frozen=True, slots=True)
class ParamMeta:
    """How one parameter is optimized and where its natural blocks lie."""

    kind: Kind
    """What the parameter is; Muon kinds are ``heads_dim0``, ``heads_dim1``, ``experts``, ``matrix``."""
    num_blocks: int = 1
    """Number of equal blocks along ``block_dim`` (heads or experts); 1 for a whole matrix."""

    def __post_init__(self) -> None:
        assert self.num_blocks >= 1, self
        if self.kind not in MUON_KINDS:
            assert self.num_blocks == 1, f"AdamW parameter kind {self.kind} has no blocks"

    @property
    def optimizer(self) -> Literal["muon", "adamw"]:
        return "muon" if self.kind in MUON_KINDS else "adamw"

    @property
    def block_dim(self) -> int | None:
        """Tensor dim the blocks are laid out along (None: the whole tensor is one block)."""
        return {"heads_dim0": 0, "experts": 0, "heads_dim1": 1}.get(self.kind)

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Shape ``(m, n)`` of one block of a parameter of the given (full, unsharded) shape."""
        assert self.optimizer == "muon", self
        if self.kind == "experts":
            assert len(shape) == 3 and shape[0] == self.num_blocks, (shape, self)
            return (shape[1], shape[2])
        assert len(shape) == 2, (shape, self)
        m, n = shape
        if self.kind == "heads_dim0":
            assert m % self.num_blocks == 0, (shape, self)
            return (m // self.num_blocks, n)
        if self.kind == "heads_dim1":
            assert n % self.num_blocks == 0, (shape, self)
            return (m, n // self.num_blocks)
        return (m, n)


def collect_param_meta(model: nn.Module) -> dict[str, ParamMeta]:
    """Metadata for every parameter of ``model`` keyed by FQN, from the modules' declarations.

    Raises ``ValueError`` naming a parameter that no module declares (or that two declare).
    """
    declared: dict[str, ParamMeta] = {}
    for prefix, module in model.named_modules():
        fn = getattr(module, "param_meta", None)
        if fn is None:
            continue
        for rel, meta in fn().items():
            fqn = f"{prefix}.{rel}" if prefix else rel
            if fqn in declared:
                raise ValueError(f"parameter {fqn!r} has metadata declared twice")
            declared[fqn] = meta
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in declared]
    if missing:
        raise ValueError(
            f"parameters without metadata: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            "declare them in the owning module's param_meta() (see etude.model.meta)"
        )
    unknown = sorted(set(declared) - set(names))
    assert not unknown, f"metadata declared for parameters that do not exist: {unknown[:5]}"
    return {n: declared[n] for n in names}
