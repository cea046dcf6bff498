"""The biLM configuration: one dataclass, saved as JSON inside every model directory."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from elmo.errors import ConfigError, DataError, ElmoError
from elmo.text.chars import MAX_CHARS, N_CHAR_IDS
from elmo.text.files import read_user_text

CONFIG_FILE = "config.json"
IGNORE = -100  # LM target id of padding and masked targets (F.cross_entropy's ignore_index)


@dataclass
class ModelConfig:
    """Shape of the biLM. Defaults are the published ELMo-small shape.

    ``filters`` is a list of ``[width, count]`` pairs of the char-CNN; ``vocab_size`` is the size of the
    LM softmax (0 = embedding-only model, e.g. imported weights). ``warm_state``: every LSTM starts from a fixed
    warm state stored with the weights instead of zeros (imported models only, see elmo.importers.allennlp).

    ``char_scheme``: "elmo" (the byte scheme, 262 ids x 50) or "vocab" (a char vocabulary stored in the model
    directory, elmo.text.chars.VocabScheme; ``n_chars`` and ``max_chars`` are then the vocabulary's). ``word_dim`` /
    ``n_words``: an optional word embedding (vocab scheme only, elmo.importers.manylangs) whose vector goes beside
    the highway output into the projection; ``n_words`` counts its table rows, the zero row 0 included.
    """

    char_dim: int = 16
    filters: list[list[int]] = field(
        default_factory=lambda: [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]]
    )
    n_highway: int = 1
    activation: str = "relu"
    projection_dim: int = 128
    cell_dim: int = 1024
    n_layers: int = 2
    cell_clip: float = 3.0
    proj_clip: float = 3.0
    residual: bool = True
    n_chars: int = N_CHAR_IDS
    max_chars: int = MAX_CHARS
    vocab_size: int = 0
    dropout: float = 0.1
    warm_state: bool = False
    char_scheme: str = "elmo"
    word_dim: int = 0
    n_words: int = 0

    @property
    def n_filters(self) -> int:
        return sum(count for _, count in self.filters)

    @property
    def token_width(self) -> int:
        """Ids per token row: the chars, plus one word id when the model has a word embedding."""
        return self.max_chars + (1 if self.word_dim > 0 else 0)

    @property
    def output_dim(self) -> int:
        """Width of every output layer: forward and backward projections side by side."""
        return 2 * self.projection_dim

    @property
    def n_output_layers(self) -> int:
        """Token layer plus one per LSTM layer."""
        return self.n_layers + 1

    def validate(self) -> ModelConfig:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"config field '{name}': {why} (got {getattr(self, name)!r})")

        for name in ("char_dim", "projection_dim", "cell_dim", "n_layers"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "must be a positive integer")
        need(isinstance(self.n_highway, int) and self.n_highway >= 0, "n_highway", "must be an integer >= 0")
        need(self.activation in ("relu", "tanh"), "activation", "must be 'relu' or 'tanh'")
        need(self.char_scheme in ("elmo", "vocab"), "char_scheme", "must be 'elmo' (bytes) or 'vocab'")
        if self.char_scheme == "elmo":
            need(self.n_chars == N_CHAR_IDS, "n_chars", f"must be {N_CHAR_IDS} (the ELMo char scheme)")
            need(self.max_chars == MAX_CHARS, "max_chars", f"must be {MAX_CHARS} (the ELMo char scheme)")
            need(self.word_dim == 0, "word_dim", "a word embedding needs char_scheme 'vocab'")
        else:
            need(isinstance(self.n_chars, int) and self.n_chars >= 2, "n_chars", "must be an integer >= 2")
            need(isinstance(self.max_chars, int) and self.max_chars >= 3, "max_chars", "must be an integer >= 3")
        need(isinstance(self.word_dim, int) and self.word_dim >= 0, "word_dim", "must be an integer >= 0")
        need(isinstance(self.n_words, int) and self.n_words >= 0, "n_words", "must be an integer >= 0")
        need((self.word_dim > 0) == (self.n_words > 0), "n_words", "must be > 0 exactly when word_dim > 0")
        need(isinstance(self.filters, list) and bool(self.filters), "filters", "must be a non-empty list")
        for pair in self.filters:
            need(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(v, int) and v > 0 for v in pair),
                "filters",
                "every entry must be [width, count] with positive integers",
            )
            need(pair[0] <= self.max_chars, "filters", f"a filter width exceeds max_chars={self.max_chars}")
        need(self.cell_clip >= 0 and self.proj_clip >= 0, "cell_clip", "clips must be >= 0 (0 = no clipping)")
        need(isinstance(self.vocab_size, int) and self.vocab_size >= 0, "vocab_size", "must be an integer >= 0")
        need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        need(isinstance(self.warm_state, bool), "warm_state", "must be true or false")
        return self

    # -- persistence -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown config field(s) {unknown}; known fields: {sorted(known)}")
        cfg = cls(**data)
        cfg.filters = [list(p) for p in cfg.filters]
        return cfg.validate()

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory_or_file: str | Path) -> ModelConfig:
        path = Path(directory_or_file)
        if path.is_dir():
            path = path / CONFIG_FILE
        return cls.from_dict(read_json_config(path, "config file"), source=str(path))


def read_json_config(path: Path, what: str, error: type[ElmoError] = ConfigError) -> dict:
    """A JSON file's contents; a missing file or bad JSON raises ``error`` naming the file."""
    try:
        text = read_user_text(path, what)  # not found, or not UTF-8: one line naming the file
    except DataError as exc:
        raise error(str(exc)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None


def elmo_small() -> ModelConfig:
    """Published ELMo small: 1024 cell / 128 projection, 1 highway (13.6 M parameters)."""
    return ModelConfig()


def elmo_medium() -> ModelConfig:
    """Published ELMo medium: 2048 cell / 256 projection, 1 highway (28.0 M parameters)."""
    return ModelConfig(cell_dim=2048, projection_dim=256)


def elmo_original() -> ModelConfig:
    """Published ELMo original: 4096 cell / 512 projection, 2 highway (93.6 M parameters)."""
    return ModelConfig(cell_dim=4096, projection_dim=512, n_highway=2)


def tiny(vocab_size: int = 0) -> ModelConfig:
    """A few-thousand-parameter model for tests."""
    return ModelConfig(
        char_dim=4,
        filters=[[1, 4], [2, 8], [3, 16]],
        n_highway=1,
        projection_dim=8,
        cell_dim=16,
        n_layers=2,
        vocab_size=vocab_size,
        dropout=0.0,
    )


PRESETS = {"small": elmo_small, "medium": elmo_medium, "original": elmo_original, "tiny": tiny}
