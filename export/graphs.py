"""The torch modules traced into the exported graphs (elmo.model.bilm's modules, reused unchanged).

Three graphs come out of one BiLM:
  model.onnx    char_ids int64 (B, T, W) -> layers (B, L+1, T, 2P), mask (B, T): PrefixGraph + context.onnx.
  encoder.onnx  char_ids int64 (N, W) -> token vectors (N, P): EncoderGraph, the char-CNN once per distinct token
                (rows may be cut short where the scheme allows: export.onnx_export.encoder_trim_window).
  context.onnx  table float32 (R, P) of token vectors, index int64 (B, T+2) of table rows with <S>/</S> in place,
                lengths int64 (B,) -> layers: the biLSTM, built by hand (export/context_graph.py): there is no
                recurrence to trace here.
The runtime uses encoder + context (distinct tokens deduplicated and cached, no CNN work on padding); model.onnx
is the self-contained contract graph. W = 50 (byte scheme) or the width of the model's char vocabulary scheme
(elmo.text.chars.VocabScheme: max_chars, plus one word-id column when the model has a word embedding).
"""

from __future__ import annotations

import torch

import elmo.model.bilm as elmo_model


class EncoderGraph(torch.nn.Module):
    """char_ids int64 (N, 50) of distinct tokens -> token vectors float32 (N, P)."""

    def __init__(self, model: elmo_model.BiLM) -> None:
        super().__init__()
        self.encoder = model.encoder

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(char_ids.unsqueeze(0)).squeeze(0)


class PrefixGraph(torch.nn.Module):
    """The front of model.onnx: char_ids int64 (B, T, 50) -> (table (B*(T+2), P): every position's token vector,
    <S>/</S> in place; index int64 (B, T+2): each position's table row; lengths int64 (B,) real tokens per
    sentence; mask bool (B, T)). context.onnx is appended to it."""

    def __init__(self, model: elmo_model.BiLM) -> None:
        super().__init__()
        self.encoder = model.encoder

    def forward(self, char_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with_boundaries, lengths = elmo_model.add_sentence_boundaries(char_ids, self.encoder.boundary_ids)
        lengths = lengths - 2
        steps = torch.arange(char_ids.shape[1], device=char_ids.device).view(1, -1)
        tokens = self.encoder(with_boundaries)  # (B, T+2, P)
        batch, positions, width = tokens.shape
        index = torch.arange(batch * positions, device=char_ids.device).view(batch, positions)
        return tokens.reshape(batch * positions, width), index, lengths, steps < lengths.view(-1, 1)
