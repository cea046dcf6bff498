"""The torch modules traced into the exported graphs (elmo.model.bilm's modules, reused unchanged).

Three graphs come out of one BiLM:
  model.onnx    char_ids int64 (B, T, W) -> layers (B, L+1, T, 2P), mask (B, T): PrefixGraph + context.onnx.
  encoder.onnx  char_ids int64 (N, W) -> token vectors (N, P): EncoderGraph, the char-CNN once per distinct token
                (its convolutions as one MatMul over windows; rows may be cut short where the scheme allows:
                export.onnx_export.encoder_trim_window).
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
    """char_ids int64 (N, W) of distinct tokens -> token vectors float32 (N, P): the model's char-CNN, with its
    convolutions as one MatMul over windows.

    onnxruntime's ``Conv`` runs one small product per token and width and barely gains from a second thread; here
    every position's K char vectors side by side (N, W, K·(d+1)), K the widest filter, meet all filters' weights at
    once (K·(d+1), F), a filter narrower than K holding zeros for the taps it lacks (measured: bench.runtime.
    char_cnn_forms, bench/notes/front-door.md). A filter of width w has no window at the last w-1 positions;
    a window that reads past the row is pushed below every real one instead: the char vectors get a (d+1)-th
    component, 0 inside the row and 1 for the ids padding it past its end, weighted on each tap the filter uses by
    :func:`past_the_row_weight` (an exact 0 for the windows that stay inside). The max over positions is then the
    ``Conv``'s, the bias is added after it (the same value: rounding is monotone), and the activation, highway and
    projection are the model's.
    Rows cut short (export.onnx_export.encoder_trim_window) give the same vectors bit for bit: each window is the
    same dot product."""

    def __init__(self, model: elmo_model.BiLM) -> None:
        super().__init__()
        encoder, filters = model.encoder, model.cfg.filters
        self.encoder = encoder
        self.width = max(width for width, _ in filters)  # K
        chars = encoder.char_embedding.weight.detach()  # (n_chars, d)
        n_chars, dim = chars.shape
        self.past_the_row_id = n_chars  # the id that pads windows past a row's end: its own table row [0 .. 0, 1]
        table = torch.zeros(n_chars + 1, dim + 1, dtype=chars.dtype)
        table[:n_chars, :dim] = chars
        table[n_chars, dim] = 1.0
        self.register_buffer("table", table)
        weights = torch.zeros(self.width, dim + 1, model.cfg.n_filters, dtype=chars.dtype)  # (K, d+1, F)
        past_the_row = past_the_row_weight(chars, encoder.convs)
        column = 0
        for conv, (width, count) in zip(encoder.convs, filters):
            weights[:width, :dim, column : column + count] = conv.weight.detach().permute(2, 1, 0)  # (w, d, count)
            weights[:width, dim, column : column + count] = past_the_row
            column += count
        self.register_buffer("weights", weights.reshape(-1, model.cfg.n_filters))  # (K·(d+1), F)
        self.register_buffer("bias", torch.cat([conv.bias.detach() for conv in encoder.convs]))  # (F,)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        encoder = self.encoder
        chars = char_ids if encoder.word_embedding is None else char_ids[:, : encoder.max_chars]
        rows, length = chars.shape
        # torch.cat, not F.pad: F.pad traces to a reversed Slice that the exporter warns it cannot fold
        padded = torch.cat([chars, chars.new_full((rows, self.width - 1), self.past_the_row_id)], dim=1)  # (N, W+K-1)
        taps = torch.arange(length).unsqueeze(1) + torch.arange(self.width).unsqueeze(0)  # (W, K)
        windows = self.table[padded[:, taps]].reshape(rows, length, -1)  # (N, W, K·(d+1))
        scores = torch.matmul(windows, self.weights)  # (N, W, F)
        features = encoder.highway(encoder.activation(scores.max(dim=1).values + self.bias))  # (N, F)
        if encoder.word_embedding is not None:
            features = torch.cat([encoder.word_embedding(char_ids[:, encoder.max_chars]), features], dim=-1)
        return encoder.projection(features)


def past_the_row_weight(chars: torch.Tensor, convs: torch.nn.ModuleList) -> float:
    """The weight of the "past the row" component: every real window scores within ±B (B = the largest Σ|w| of a
    filter times the largest |char vector component|), a window reading past the row gets this at least once on top
    of at most B, so -(3B + 1) keeps it at least B + 1 below every real window: room for float16's rounding under
    ``--fp16``. Finite and no larger than that: no 0·inf, and within float16's range (which would clip it, with a
    warning)."""
    largest_char = float(chars.detach().abs().max())
    bound = max(float(conv.weight.detach().abs().sum(dim=(1, 2)).max()) for conv in convs) * largest_char
    return -(3.0 * bound + 1.0)


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
