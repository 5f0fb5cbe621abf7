"""The numbers that shape a model's MoE layers, read from config.json (chapter 14).

:class:`~minisgl_ref.models.config.ModelConfig` is the dense models' record and stays as it is; the MoE fields
are read here from its ``raw`` dict. The two families spell them differently:

=====================  ==============================  ======================
meaning                Qwen3-MoE                       Mixtral
=====================  ==============================  ======================
experts per layer      ``num_experts``                 ``num_local_experts``
experts per token      ``num_experts_per_tok``         ``num_experts_per_tok``
expert MLP width       ``moe_intermediate_size``       ``intermediate_size``
renormalise top-k      ``norm_topk_prob``              always
which layers are MoE   ``decoder_sparse_step``,        all
                       ``mlp_only_layers``
=====================  ==============================  ======================

(transformers 5 saves Qwen3-MoE's ``num_experts`` under the name ``num_local_experts``; both are read.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl_ref.models.config import ModelConfig


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert's SwiGLU MLP
    renormalize: bool  # rescale the k kept router weights to sum to 1
    sparse_step: int = 1  # layer i is MoE when (i + 1) % sparse_step == 0 ...
    dense_layers: frozenset[int] = field(default_factory=frozenset)  # ... and i is not listed here

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"an MoE layer needs 1 <= num_experts_per_tok <= num_experts, got "
                             f"{self.top_k} of {self.num_experts}")
        if self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.sparse_step}")

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has experts (else the dense MLP of width ``intermediate_size``): transformers'
        rule for Qwen3-MoE, which makes every layer sparse with the defaults (step 1, no dense layers)."""
        return layer_id not in self.dense_layers and (layer_id + 1) % self.sparse_step == 0

    @classmethod
    def qwen3_moe(cls, config: ModelConfig) -> MoEConfig:
        raw = config.raw
        return cls(
            num_experts=int(_first(raw, "num_experts", "num_local_experts")),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            sparse_step=int(raw.get("decoder_sparse_step", 1)),
            dense_layers=frozenset(int(i) for i in raw.get("mlp_only_layers") or ()),
        )

    @classmethod
    def mixtral(cls, config: ModelConfig) -> MoEConfig:
        raw = config.raw
        return cls(num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
                   intermediate_size=config.intermediate_size, renormalize=True)


def _first(raw: dict[str, Any], *names: str) -> Any:
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    raise KeyError(f"config.json has none of {', '.join(names)}")
