"""A policy whose updates can be checked by hand: the next token's logits are a table row of the
current token. Called like a transformers causal LM (its output is a ModelOutput, a pytree FSDP2
looks into for the backward hooks)."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutput


class Bigram(torch.nn.Module):
    def __init__(self, vocab: int = 3) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool
    ) -> CausalLMOutput:
        return CausalLMOutput(logits=self.table[input_ids])
