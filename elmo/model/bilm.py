"""The ELMo biLM in PyTorch: char-CNN token encoder + independent forward/backward projection-LSTM stacks.

Shapes use B = batch, T = tokens per sentence (padded), W = 50 chars per token, P = projection_dim,
C = cell_dim, L = n_layers, V = vocab size. The model adds the sentence-boundary tokens itself, so callers
pass only real tokens: internally every sentence is ``[<S>, tokens..., </S>]`` (T + 2 positions) and the
boundaries are removed from the output. Nothing is carried between calls (stateless): a sentence gets the
same vectors alone or in any padded batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo.model.config import IGNORE, ModelConfig
from elmo.text.chars import BOS_IDS, EOS_IDS


class Highway(nn.Module):
    """AllenNLP highway: ``y = g * x + (1 - g) * relu(A x)`` with ``g = sigmoid(B x)``.

    One ``Linear(d, 2d)`` per layer: output rows ``[:d]`` are the nonlinear part ``A``, rows ``[d:]`` the
    gate ``B``. The gate weights the *input* (bilm-tf's "carry" weights the transform: see elmo.importers.allennlp).
    """

    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(n_layers))
        for layer in self.layers:
            # Start by passing the input through, as AllenNLP does (gate bias 1).
            nn.init.constant_(layer.bias[dim:], 1.0)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (N, d) -> (N, d)."""
        for layer in self.layers:
            nonlinear, gate = layer(x).chunk(2, dim=-1)
            gate = torch.sigmoid(gate)
            x = gate * x + (1 - gate) * F.relu(nonlinear)
        return x


class CharEncoder(nn.Module):
    """Token encoder: char embedding -> Conv1d per filter width -> max over positions -> activation
    -> highway -> linear projection to P.

    With a word embedding (``cfg.word_dim > 0``, vocab scheme) the last id column of a token row is its word id
    and the projection reads ``[word vector; highway output]`` (ELMoForManyLangs' ConvTokenEmbedder). With the
    vocab scheme the sentence-boundary rows are the buffer ``boundary_ids`` (2, width): <S>, </S>."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_chars = cfg.max_chars
        self.char_embedding = nn.Embedding(cfg.n_chars, cfg.char_dim, padding_idx=0)
        self.word_embedding = nn.Embedding(cfg.n_words, cfg.word_dim, padding_idx=0) if cfg.word_dim > 0 else None
        self.convs = nn.ModuleList(nn.Conv1d(cfg.char_dim, count, width) for width, count in cfg.filters)
        self.activation = torch.relu if cfg.activation == "relu" else torch.tanh
        self.highway = Highway(cfg.n_filters, cfg.n_highway)
        self.projection = nn.Linear(cfg.n_filters + cfg.word_dim, cfg.projection_dim)
        vocab = cfg.char_scheme == "vocab"
        self.register_buffer("boundary_ids", torch.zeros(2, cfg.token_width, dtype=torch.int64) if vocab else None)

    def forward(self, char_ids: Tensor) -> Tensor:
        """``char_ids``: (B, T, W) int -> token embeddings (B, T, P). Padded token slots are not masked here."""
        batch, tokens, width = char_ids.shape
        flat = char_ids.reshape(batch * tokens, width)
        chars = flat if self.word_embedding is None else flat[:, : self.max_chars]
        chars = self.char_embedding(chars).transpose(1, 2)  # (B*T, d, W)
        pooled = [self.activation(conv(chars).max(dim=-1).values) for conv in self.convs]  # each (B*T, n_i)
        features = self.highway(torch.cat(pooled, dim=-1))  # (B*T, n_filters)
        if self.word_embedding is not None:
            features = torch.cat([self.word_embedding(flat[:, self.max_chars]), features], dim=-1)
        return self.projection(features).reshape(batch, tokens, -1)


def clip(x: Tensor, limit: float) -> Tensor:
    return x.clamp(-limit, limit) if limit > 0 else x


def projection_lstm_recurrence(
    gates_x: Tensor,
    w_rec: Tensor,
    b_rec: Tensor,
    w_proj: Tensor,
    cell_clip: float,
    proj_clip: float,
    initial_hidden: Tensor | None = None,
    initial_cell: Tensor | None = None,
) -> Tensor:
    """The exact ELMo recurrence over precomputed input gates.

    ``gates_x``: (B, T, 4C) = ``W_in x_t`` for every step (hoisted out of the loop: one big MatMul).
    ``w_rec``: (4C, P), ``b_rec``: (4C,), ``w_proj``: (P, C). Gate order (i, f, g, o).
    ``c_t = clip(σ(i) tanh(g) + σ(f) c_{t-1})``, ``h_t = clip(W_P (σ(o) tanh(c_t)))``. Returns h: (B, T, P).
    The state starts at zero, or at the fixed warm state ``initial_hidden`` (P,) / ``initial_cell`` (C,) shared
    by every row (so a sentence's vectors still do not depend on its batch).
    """
    batch, _, four_c = gates_x.shape
    cell = gates_x.new_zeros(batch, four_c // 4)
    hidden = gates_x.new_zeros(batch, w_proj.shape[0])
    if initial_hidden is not None and initial_cell is not None:
        cell = cell + initial_cell
        hidden = hidden + initial_hidden
    return projection_lstm_scan(gates_x, w_rec, b_rec, w_proj, cell_clip, proj_clip, hidden, cell)[0]


def projection_lstm_scan(
    gates_x: Tensor,
    w_rec: Tensor,
    b_rec: Tensor,
    w_proj: Tensor,
    cell_clip: float,
    proj_clip: float,
    hidden: Tensor,
    cell: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The loop of ``projection_lstm_recurrence`` from a given state: ``hidden`` (B, P), ``cell`` (B, C)
    -> (h for every step (B, T, P), final hidden (B, P), final cell (B, C))."""
    outputs = []
    # unbind, not gates_x[:, t]: indexing's backward writes a full-size zero gradient per step (O(T^2) memory
    # traffic, about half of a training step's time); unbind's backward stacks the per-step gradients once.
    for gates_t in gates_x.unbind(1):
        z = gates_t + F.linear(hidden, w_rec, b_rec)
        i, f, g, o = z.chunk(4, dim=-1)
        cell = clip(torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * cell, cell_clip)
        hidden = clip(F.linear(torch.sigmoid(o) * torch.tanh(cell), w_proj), proj_clip)
        outputs.append(hidden)
    return torch.stack(outputs, dim=1), hidden, cell


class ProjectionLSTM(nn.Module):
    """One LSTM layer of one direction with a recurrent projection (AllenNLP ``LstmCellWithProjection``).

    ``input_linearity`` (no bias) acts on the input, ``state_linearity`` (with the bias) on the previous
    projected state, ``state_projection`` (no bias) maps the cell output C -> P.
    """

    def __init__(self, input_dim: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_linearity = nn.Linear(input_dim, 4 * cfg.cell_dim, bias=False)
        self.state_linearity = nn.Linear(cfg.projection_dim, 4 * cfg.cell_dim, bias=True)
        self.state_projection = nn.Linear(cfg.cell_dim, cfg.projection_dim, bias=False)
        self.cell_clip = float(cfg.cell_clip)
        self.proj_clip = float(cfg.proj_clip)
        with torch.no_grad():  # forget-gate bias 1, the usual LSTM start
            self.state_linearity.bias.zero_()
            self.state_linearity.bias[cfg.cell_dim : 2 * cfg.cell_dim] = 1.0
        # Optional fixed warm initial state (cfg.warm_state, set by elmo.importers.allennlp at import): part of the
        # state dict.
        self.register_buffer("initial_hidden", torch.zeros(cfg.projection_dim) if cfg.warm_state else None)
        self.register_buffer("initial_cell", torch.zeros(cfg.cell_dim) if cfg.warm_state else None)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, T, input_dim), sentences left-aligned -> (B, T, P)."""
        args = (
            self.input_linearity(x),
            self.state_linearity.weight,
            self.state_linearity.bias,
            self.state_projection.weight,
            self.cell_clip,
            self.proj_clip,
        )
        if self.initial_hidden is None:
            return projection_lstm_recurrence(*args)
        return projection_lstm_recurrence(*args, initial_hidden=self.initial_hidden, initial_cell=self.initial_cell)


def add_sentence_boundaries(char_ids: Tensor, boundary_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(B, T, W) char ids of real tokens -> ((B, T+2, W) with <S> first and </S> after each sentence's last
    token, (B,) lengths counting both boundaries). Written with tensor ops so it exports to ONNX.
    ``boundary_ids`` (2, W): the <S> and </S> rows of a vocab scheme (CharEncoder.boundary_ids); None = bytes."""
    lengths = (char_ids > 0).any(dim=-1).sum(dim=-1)  # (B,)
    # one zero row either side by concatenation: F.pad exports its pads through a reversing Slice that the ONNX
    # exporter cannot fold, and it said so on every `elmo export` ("Only steps=1 can be constant folded")
    edge = char_ids.new_zeros((char_ids.shape[0], 1, char_ids.shape[2]))  # (B, 1, W), also when T is 0
    padded = torch.cat([edge, char_ids, edge], dim=1)  # (B, T+2, W)
    positions = torch.arange(padded.shape[1], device=char_ids.device)
    if boundary_ids is None:
        bos = torch.as_tensor(BOS_IDS, dtype=char_ids.dtype, device=char_ids.device)
        eos = torch.as_tensor(EOS_IDS, dtype=char_ids.dtype, device=char_ids.device)
    else:
        bos, eos = boundary_ids.to(char_ids.dtype).unbind(0)
    is_bos = (positions == 0).view(1, -1, 1)
    is_eos = (positions.view(1, -1) == (lengths + 1).view(-1, 1)).unsqueeze(-1)
    padded = torch.where(is_bos, bos, padded)
    padded = torch.where(is_eos, eos, padded)
    return padded, lengths + 2


def backward_targets(target_ids: Tensor, lengths: Tensor) -> Tensor:
    """Targets of backward positions 1..S-1: ``target_ids`` (B, S) of ``[<S>, tokens..., </S>]`` (-100 padding),
    ``lengths`` (B,) with boundaries -> (B, S-1). Backward position p predicts p - 1; positions at or past a
    sentence's length are padding even where p - 1 is its </S>."""
    steps = torch.arange(1, target_ids.shape[1], device=target_ids.device).view(1, -1)
    return torch.where(steps < lengths.view(-1, 1), target_ids[:, :-1], IGNORE)


def reverse_padded(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse only the valid part of each row: (B, T, D) -> (B, T, D); position t < len_b takes len_b-1-t.
    Padding stays where it is, so the backward LSTM starts at each sentence's own last token."""
    steps = torch.arange(x.shape[1], device=x.device).view(1, -1)
    lengths = lengths.view(-1, 1)
    index = torch.where(steps < lengths, lengths - 1 - steps, steps)  # (B, T)
    return x.gather(1, index.unsqueeze(-1).expand_as(x))


class BiLM(nn.Module):
    """The ELMo bidirectional language model.

    ``forward(char_ids)`` returns ``(layers, mask)``: layers (B, L+1, T, 2P) where layer 0 is the token
    embedding duplicated to 2P and layer l is ``[forward_l; backward_l]``; mask (B, T) bool. Positions past
    a sentence's end are zero. With ``vocab_size > 0`` a softmax shared by both directions predicts the next
    (forward) and previous (backward) token from the top layer.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg.validate()
        self.encoder = CharEncoder(cfg)
        dims = [cfg.projection_dim] * cfg.n_layers
        self.forward_layers = nn.ModuleList(ProjectionLSTM(d, cfg) for d in dims)
        self.backward_layers = nn.ModuleList(ProjectionLSTM(d, cfg) for d in dims)
        self.dropout = nn.Dropout(cfg.dropout)
        self.softmax = nn.Linear(cfg.projection_dim, cfg.vocab_size) if cfg.vocab_size > 0 else None

    def num_parameters(self, include_softmax: bool = False) -> int:
        skip = set() if include_softmax or self.softmax is None else {id(p) for p in self.softmax.parameters()}
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def run_stack(self, layers: nn.ModuleList, x: Tensor, mask: Tensor) -> list[Tensor]:
        """One direction: (B, S, P) -> list of L outputs (B, S, P), zero at padded positions."""
        outputs = []
        for index, layer in enumerate(layers):
            h = layer(self.dropout(x))
            if index > 0 and self.cfg.residual:
                h = h + x
            x = h * mask
            outputs.append(x)
        return outputs

    def contextual_states(self, char_ids: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor], Tensor]:
        """Run the biLM over boundary-padded sentences.

        ``char_ids`` (B, T, W) -> (token_embeddings (B, S, P), forward states [L × (B, S, P)],
        backward states [L × (B, S, P)] in natural order, lengths (B,)) with S = T + 2.
        """
        with_boundaries, lengths = add_sentence_boundaries(char_ids, self.encoder.boundary_ids)
        steps = torch.arange(with_boundaries.shape[1], device=char_ids.device).view(1, -1)
        mask = (steps < lengths.view(-1, 1)).unsqueeze(-1).to(torch.float32)  # (B, S, 1)
        tokens = self.encoder(with_boundaries) * mask
        forward_states = self.run_stack(self.forward_layers, tokens, mask)
        reversed_states = self.run_stack(self.backward_layers, reverse_padded(tokens, lengths), mask)
        backward_states = [reverse_padded(h, lengths) for h in reversed_states]
        return tokens, forward_states, backward_states, lengths

    def forward(self, char_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``char_ids`` (B, T, W) -> (layers (B, L+1, T, 2P), mask (B, T) bool)."""
        tokens, forward_states, backward_states, lengths = self.contextual_states(char_ids)
        layers = [torch.cat([tokens, tokens], dim=-1)]
        layers += [torch.cat([f, b], dim=-1) for f, b in zip(forward_states, backward_states)]
        stacked = torch.stack(layers, dim=1)[:, :, 1:-1]  # drop <S> and the last slot: (B, L+1, T, 2P)
        steps = torch.arange(char_ids.shape[1], device=char_ids.device).view(1, -1)
        mask = steps < (lengths - 2).view(-1, 1)  # (B, T)
        return stacked * mask.view(mask.shape[0], 1, -1, 1).to(stacked.dtype), mask

    def lm_hidden(self, char_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Top-layer states for the LM losses: (forward (B, S, P), backward (B, S, P), lengths (B,)).
        Forward position t predicts the token at t + 1; backward position t predicts the token at t - 1."""
        _, forward_states, backward_states, lengths = self.contextual_states(char_ids)
        return self.dropout(forward_states[-1]), self.dropout(backward_states[-1]), lengths

    def lm_loss(self, char_ids: Tensor, target_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Full-softmax LM losses (mean negative log-likelihood per predicted token).

        ``target_ids`` (B, S) vocabulary ids of ``[<S>, tokens..., </S>]``, -100 on padding.
        Returns (forward_loss, backward_loss) as scalars.
        """
        if self.softmax is None:
            raise ValueError("this model has no softmax (vocab_size=0): it embeds but cannot score text")
        forward_h, backward_h, lengths = self.lm_hidden(char_ids)
        forward_loss = F.cross_entropy(
            self.softmax(forward_h[:, :-1]).flatten(0, 1), target_ids[:, 1:].flatten(), ignore_index=IGNORE
        )
        backward_loss = F.cross_entropy(
            self.softmax(backward_h[:, 1:]).flatten(0, 1),
            backward_targets(target_ids, lengths).flatten(),
            ignore_index=IGNORE,
        )
        return forward_loss, backward_loss
