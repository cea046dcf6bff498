"""An independent float64 NumPy ELMo forward pass, written from the published formulas (ELMO.md), one
sentence at a time, with plain Python loops. It shares no code with elmo.model.bilm: tests compare the two.

Weights come as a dict of NumPy arrays in a neutral layout (x @ W convention):
  char_embed (262, d) row 0 = padding · conv_{i}: W (width, d, n), b (n,) · highway_{k}: W_nonlin, b_nonlin,
  W_gate, b_gate (d, d)/(d,) with y = g*x + (1-g)*relu(x W_nonlin + b_nonlin), g = σ(x W_gate + b_gate)
  · proj: W (d, P), b (P,) · lstm_{dir}_{layer}: W_in (in, 4C), W_rec (P, 4C), b (4C,), W_proj (C, P),
  gate order (i, f, g, o).
"""

from __future__ import annotations

import numpy as np

MAX_CHARS = 50


def char_ids(word: str) -> np.ndarray:
    if word == "<S>":
        raw = [258, 256, 259]
    elif word == "</S>":
        raw = [258, 257, 259]
    else:
        raw = [258, *word.encode("utf-8", "ignore")[:48], 259]
    ids = raw + [260] * (MAX_CHARS - len(raw))
    return np.array(ids) + 1


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def encode_token(w: dict, word: str, n_filters: int, n_highway: int, activation: str = "relu") -> np.ndarray:
    chars = w["char_embed"][char_ids(word)]  # (50, d)
    pooled = []
    for i in range(n_filters):
        kernel, bias = w[f"conv_{i}.W"], w[f"conv_{i}.b"]
        width = kernel.shape[0]
        windows = np.stack([chars[p : p + width] for p in range(MAX_CHARS - width + 1)])  # (pos, width, d)
        conv = np.einsum("pwd,wdn->pn", windows, kernel) + bias
        best = conv.max(axis=0)
        pooled.append(np.maximum(best, 0) if activation == "relu" else np.tanh(best))
    x = np.concatenate(pooled)
    for k in range(n_highway):
        gate = sigmoid(x @ w[f"highway_{k}.W_gate"] + w[f"highway_{k}.b_gate"])
        nonlinear = np.maximum(x @ w[f"highway_{k}.W_nonlin"] + w[f"highway_{k}.b_nonlin"], 0)
        x = gate * x + (1 - gate) * nonlinear
    return x @ w["proj.W"] + w["proj.b"]


def run_lstm(w: dict, prefix: str, xs: list[np.ndarray], cell_clip: float, proj_clip: float) -> list[np.ndarray]:
    w_in, w_rec, b, w_proj = (w[f"{prefix}.{k}"] for k in ("W_in", "W_rec", "b", "W_proj"))
    cell_dim = w_proj.shape[0]
    c = np.zeros(cell_dim)
    h = np.zeros(w_proj.shape[1])
    out = []
    for x in xs:
        z = x @ w_in + h @ w_rec + b
        i, f, g, o = (z[k * cell_dim : (k + 1) * cell_dim] for k in range(4))
        c = sigmoid(i) * np.tanh(g) + sigmoid(f) * c
        if cell_clip:
            c = np.clip(c, -cell_clip, cell_clip)
        h = (sigmoid(o) * np.tanh(c)) @ w_proj
        if proj_clip:
            h = np.clip(h, -proj_clip, proj_clip)
        out.append(h)
    return out


def elmo_forward(w: dict, sentence: list[str], cfg: dict) -> np.ndarray:
    """One tokenized sentence -> (n_layers + 1, n_tokens, 2P) float64, boundaries removed."""
    words = ["<S>", *sentence, "</S>"]
    tokens = [encode_token(w, t, len(cfg["filters"]), cfg["n_highway"], cfg.get("activation", "relu")) for t in words]
    layers = [[np.concatenate([t, t]) for t in tokens]]
    fwd, bwd = tokens, tokens[::-1]
    for layer in range(cfg["n_layers"]):
        new_fwd = run_lstm(w, f"lstm_0_{layer}", fwd, cfg["cell_clip"], cfg["proj_clip"])
        new_bwd = run_lstm(w, f"lstm_1_{layer}", bwd, cfg["cell_clip"], cfg["proj_clip"])
        if layer > 0 and cfg.get("residual", True):
            new_fwd = [a + b for a, b in zip(new_fwd, fwd)]
            new_bwd = [a + b for a, b in zip(new_bwd, bwd)]
        fwd, bwd = new_fwd, new_bwd
        layers.append([np.concatenate([f, b]) for f, b in zip(fwd, bwd[::-1])])
    return np.array(layers)[:, 1:-1]


def from_torch_state(state: dict, cfg) -> dict:
    """Translate an elmo.model.bilm.BiLM state dict (torch layout) into the neutral layout above."""
    a = {k: v.detach().double().numpy() for k, v in state.items()}
    w = {"char_embed": a["encoder.char_embedding.weight"]}
    for i in range(len(cfg.filters)):
        w[f"conv_{i}.W"] = a[f"encoder.convs.{i}.weight"].transpose(2, 1, 0)  # (n, d, width) -> (width, d, n)
        w[f"conv_{i}.b"] = a[f"encoder.convs.{i}.bias"]
    d = cfg.n_filters
    for k in range(cfg.n_highway):
        weight, bias = a[f"encoder.highway.layers.{k}.weight"], a[f"encoder.highway.layers.{k}.bias"]
        w[f"highway_{k}.W_nonlin"], w[f"highway_{k}.b_nonlin"] = weight[:d].T, bias[:d]
        w[f"highway_{k}.W_gate"], w[f"highway_{k}.b_gate"] = weight[d:].T, bias[d:]
    w["proj.W"], w["proj.b"] = a["encoder.projection.weight"].T, a["encoder.projection.bias"]
    for direction, name in ((0, "forward_layers"), (1, "backward_layers")):
        for layer in range(cfg.n_layers):
            p = f"{name}.{layer}"
            w[f"lstm_{direction}_{layer}.W_in"] = a[f"{p}.input_linearity.weight"].T
            w[f"lstm_{direction}_{layer}.W_rec"] = a[f"{p}.state_linearity.weight"].T
            w[f"lstm_{direction}_{layer}.b"] = a[f"{p}.state_linearity.bias"]
            w[f"lstm_{direction}_{layer}.W_proj"] = a[f"{p}.state_projection.weight"].T
    return w


def config_dict(cfg) -> dict:
    return {
        "filters": cfg.filters,
        "n_highway": cfg.n_highway,
        "activation": cfg.activation,
        "n_layers": cfg.n_layers,
        "cell_clip": cfg.cell_clip,
        "proj_clip": cfg.proj_clip,
        "residual": cfg.residual,
    }
