"""The onnxruntime runtime: a model directory in, per-sentence layer vectors out. Imports no torch.

``Embedder(model_dir)`` loads the exported graphs (checked against ``onnx.json`` and ``config.json``), picks the
execution provider (CUDA where a GPU is visible and its libraries load, else CPU; one log line says which one
is active and why), and embeds tokenized or raw sentences into float32 arrays ``(n_layers, n_tokens, dim)``.

How a call runs: the distinct tokens of all sentences go through the char-CNN graph (encoder.onnx) once each,
skipping those in an LRU cache of token vectors (a token's vector does not depend on its context: AllenNLP's
``vocab_to_cache`` idea), their char rows cut after the longest token where the model allows it; the sentences are
sorted by length and cut into batches under a token budget; each batch sends its rows of the call's token table
and its ``[<S>, tokens, </S>]`` as indices into them through the biLSTM graph (context.onnx), which projects each
row once for layer 0. Results come back in input order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from elmo.embedding import Embedding
from elmo.errors import ElmoError, InputError, ModelFileError
from elmo.runtime.batching import (
    CPU_STEP_COST,
    CUDA_STEP_COST,
    ENCODER_CHUNK,
    EmbedStats,
    TokenVectorCache,
    batch_positions,
    padded_count,
    plan_batches,
)
from elmo.runtime.host import int8_accumulates_in_int32, usable_cores
from elmo.runtime.memory import register_release
from elmo.runtime.modeldir import (
    CONTEXT_IN_STEP_FILE,
    CONTEXT_LAYOUTS,
    CONTEXT_S8_FILE,
    CONTEXT_S8_KEY,
    ENCODER_FILE,
    char_scheme_of,
    member_file,
    model_directory,
    read_onnx_metadata,
)
from elmo.runtime.priority import BACKGROUND_NICE, MAX_NICE, background_executor
from elmo.runtime.probe import ProbeResult, check_probe, read_probe
from elmo.runtime.providers import (
    CPU,
    CUDA,
    ProviderRequest,
    cuda_hint,
    open_session,
    provider_reason,
    requested_providers,
    shrink_run_options,
)
from elmo.text.chars import char_lengths
from elmo.text.plain import prepare_fast_path
from elmo.text.tokenize import tokenize

log = logging.getLogger("elmo.runtime")

DEFAULT_MAX_BATCH_TOKENS = 4096
DEFAULT_MAX_BATCH_TOKENS_CUDA = 16384  # a GPU step costs about the same for 16 rows or 500: wider batches
DEFAULT_MAX_TOKENS_PER_SENTENCE = 1024
DEFAULT_CACHE_SIZE = 50_000
MAX_DEFAULT_RUNS_IN_FLIGHT = 4  # beyond a few, each run's share of threads and cache gets too small
# A lone batch is cut in two for the parallel runs from this many padded positions up: below it, the all-threads
# session is as fast (measured: 32 rows of 30 tokens, one run 111 ms vs two halves 131 ms; 64 rows, 327 vs 251 ms).
SPLIT_BATCH_TOKENS = 2048
# Rows of the per-call token table that every batch gathers from.
_PAD_ROW, _BOS_ROW, _EOS_ROW, _FIRST_TOKEN_ROW = 0, 1, 2, 3


@dataclass(frozen=True)
class EmbedderInfo:
    """What a caller needs to know about a loaded model."""

    name: str
    n_layers: int  # output layers, the token layer included
    dim: int
    max_tokens_per_sentence: int
    provider: str  # the execution provider that is really active
    model_dir: Path


def _axis_matches(want: int | str | None, got: int | str | None) -> bool:
    """A declared graph axis against the expected one: None = anything, "symbolic" = a named (dynamic) axis."""
    return want is None or (isinstance(got, str) if want == "symbolic" else want == got)


# -- the embedder --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbedderOptions:
    """How an :class:`Embedder` runs its model; every field has a default.

    ``providers``: None = CUDA then CPU where a GPU is visible (``requested_providers``), else CPU; a list without the
    CPU provider is a demand (ElmoError if unmet). ``max_batch_tokens``: rows x (longest + 2) per biLSTM run (None:
    4096 on CPU, 16384 on CUDA); ``max_tokens_per_sentence``: longer -> InputError; ``cache_size``: token vectors
    kept (0 = off); ``cuda_options``: merged over DEFAULT_CUDA_OPTIONS; ``io_binding`` / ``context_layout``
    ('separate' | 'fused' | 'in_step'): None = by provider; ``wide_batches``: the caller's calls are wide (the batch
    job): on CPU the in_step context graph, where the export has it (1.1x faster per run at 64 rows and more, slower
    at a few: modeldir.CONTEXT_LAYOUTS); ``runs_in_flight``: biLSTM batches run at once on CPU (None: the threads, at
    most 4; 1 = one at a time; CUDA always runs one: one session is one stream); ``background_nice``: how much lower
    the threads run that compute the parallel batches of a ``background=True`` call (elmo.runtime.priority; 0 = no
    lower); ``check_on_load``: run the export's probe now (elmo.runtime.probe: ModelFileError when this host's
    answers miss the export's bar); False defers it to :meth:`Embedder.check` / :meth:`Embedder.warmup` (the server
    runs it while its health says NOT_SERVING). The probe's file is read and checked either way. ``signed_int8``: an
    int8 export's products as u8 x s8 (context_s8.onnx: the same integers, faster where the CPU's int8 kernels
    accumulate in int32); None = where they do (elmo.runtime.host.int8_accumulates_in_int32), True = demanded
    (ModelFileError where the export has no such graph), False = never."""

    providers: Sequence[str] | None = None
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    max_batch_tokens: int | None = None
    max_tokens_per_sentence: int = DEFAULT_MAX_TOKENS_PER_SENTENCE
    cache_size: int = DEFAULT_CACHE_SIZE
    cuda_options: dict | None = None
    io_binding: bool | None = None
    context_layout: str | None = None
    wide_batches: bool = False
    runs_in_flight: int | None = None
    background_nice: int = BACKGROUND_NICE
    check_on_load: bool = True
    signed_int8: bool | None = None

    def check(self) -> EmbedderOptions:
        """The values no model is needed to refuse, each named (InputError)."""
        if (self.max_batch_tokens is not None and self.max_batch_tokens < 1) or self.max_tokens_per_sentence < 1:
            raise InputError("max_batch_tokens and max_tokens_per_sentence must be >= 1")
        if self.runs_in_flight is not None and self.runs_in_flight < 1:
            raise InputError(f"runs_in_flight must be >= 1, not {self.runs_in_flight}")
        if not 0 <= self.background_nice <= MAX_NICE:
            raise InputError(f"background_nice must be in 0..{MAX_NICE}, not {self.background_nice}")
        return self


class Embedder:
    """Embed sentences with an exported biLM. Safe to call from several threads (onnxruntime sessions are; the
    cache has a lock), but on CUDA one session is one stream: feed it large batches from one batcher."""

    def __init__(self, model_dir: str | Path, options: EmbedderOptions | None = None, **fields) -> None:
        """``options``: how to run the model (:class:`EmbedderOptions`); ``fields`` set some of them by name
        (``Embedder(path, intra_op_threads=1)``), over ``options``."""
        options = replace(options or EmbedderOptions(), **fields).check()
        self.options = options
        self.model_dir = model_directory(model_dir)
        self.meta = read_onnx_metadata(self.model_dir)
        self.scheme = char_scheme_of(self.model_dir, self.meta)  # token -> char ids (elmo.text.chars)
        self.probe = read_probe(self.model_dir, self.meta)  # what this host must reproduce before serving
        self.checked: ProbeResult | None = None
        # Char rows may be cut after their token (Embedder._encode) when the export says so and the scheme allows it.
        self._trim_window = self.meta.get("encoder_trim_window") if self.scheme.trimmable else None
        self.cache = TokenVectorCache(options.cache_size)
        request = requested_providers(options.providers)
        settings = (options.intra_op_threads, options.inter_op_threads, options.cuda_options)
        self._open_sessions(
            request.providers,
            settings,
            options.context_layout,
            options.wide_batches,
            options.runs_in_flight,
            options.signed_int8,
        )
        active = self._active_provider(request)
        self.info = EmbedderInfo(
            name=str(self.meta.get("name") or self.model_dir.resolve().name),
            n_layers=int(self.meta["n_layers"]),
            dim=int(self.meta["dim"]),
            max_tokens_per_sentence=int(options.max_tokens_per_sentence),
            provider=active,
            model_dir=self.model_dir,
        )
        self._check_graphs()
        self._step_cost = CUDA_STEP_COST if active == CUDA else CPU_STEP_COST
        default_budget = DEFAULT_MAX_BATCH_TOKENS_CUDA if active == CUDA else DEFAULT_MAX_BATCH_TOKENS
        self.max_batch_tokens = int(options.max_batch_tokens or default_budget)
        # On CUDA the outputs are written straight into host arrays through an IOBinding (None: on CUDA only).
        self.io_binding = (active == CUDA) if options.io_binding is None else bool(options.io_binding)
        self._pad_encoder_batches = active == CUDA
        self._projection_dim = int(self.meta["projection_dim"])
        self.background_nice = int(options.background_nice)
        self._open_parallel_runs()
        self._boundaries = self._encode(np.stack([self.scheme.bos_ids, self.scheme.eos_ids]))  # (2, P)
        register_release(self.release_memory)  # the server's idle release shrinks this runtime's arenas
        if options.check_on_load:
            try:
                self.check()
            except ModelFileError:
                self.close()
                raise

    def _open_sessions(
        self,
        requested: list[str],
        settings: tuple,
        context_layout: str | None,
        wide_batches: bool,
        runs_in_flight: int | None,
        signed_int8: bool | None,
    ) -> None:
        """The encoder graph, the context graph and, on CPU, the parallel runs' copy of it (:meth:`_parallel_runs`).
        The encoder's provider decides the context graph's layout (docs/explanation/runtime.md): a Scan each way on CPU,
        both directions per Scan on CUDA; so where CUDA was asked for, the encoder loads first, and where only the
        CPU was, all load side by side (onnxruntime gives the GIL up while it builds a session: ELMo-small's three
        took 0.085-0.096 s against 0.142-0.152 one after another, 2 cores)."""
        graphs = self.meta.get("graphs") or {}
        encoder = member_file(self.model_dir, graphs.get("encoder", ENCODER_FILE), "encoder graph", must_exist=False)
        self._paths = {"encoder": encoder}
        with ThreadPoolExecutor(3, thread_name_prefix="elmo-load") as loads:
            encoder_session = loads.submit(open_session, encoder, requested, *settings)
            first = CPU if requested == [CPU] else encoder_session.result().get_providers()[0]
            if first not in requested:
                raise ElmoError(
                    f"execution provider {requested[0]} was demanded but {first} is active{cuda_hint(requested)}"
                )
            self.context_layout = self._pick_layout(context_layout, first, graphs, wide_batches)
            key, default = self._context_graph(graphs, first, signed_int8)
            self._paths["context"] = member_file(
                self.model_dir, graphs.get(key, default), "context graph", must_exist=False
            )
            # When CUDA did not load for the first graph, asking again would only repeat onnxruntime's complaint.
            context = loads.submit(
                open_session, self._paths["context"], [CPU] if first == CPU else requested, *settings
            )
            self.runs_in_flight, run_threads = self._parallel_runs(runs_in_flight, settings[0], first)
            parallel = None
            if self.runs_in_flight > 1:
                parallel = loads.submit(open_session, self._paths["context"], [CPU], run_threads, 1)
            self.encoder, self.context = encoder_session.result(), context.result()
            self._parallel = parallel.result() if parallel else None

    def _pick_layout(self, asked: str | None, provider: str, graphs: dict, wide_batches: bool) -> str:
        """The context graph's layout: the one asked for, else CUDA's "fused"; on CPU "in_step" for a caller of
        wide batches where the export has it (older and int8 exports do not), else "separate"."""
        if asked is not None and asked not in CONTEXT_LAYOUTS:
            raise InputError(f"context_layout must be one of {', '.join(CONTEXT_LAYOUTS)}, not {asked!r}")
        if asked == "in_step" and "context_in_step" not in graphs:
            raise ModelFileError(
                f"{self.model_dir}: this export has no in_step context graph ({CONTEXT_IN_STEP_FILE}, which "
                "`elmo export` writes for float models); re-run `elmo export`, or use context_layout='separate'"
            )
        if asked is not None:
            return asked
        if provider == CUDA:
            return "fused"
        return "in_step" if wide_batches and "context_in_step" in graphs else "separate"

    def _context_graph(self, graphs: dict, provider: str, signed_int8: bool | None) -> tuple[str, str]:
        """onnx.json's key and the default file of the context graph to load: the layout's, or for an int8 export on
        CPU its u8 x s8 form where ``signed_int8`` (None: this CPU) says so. ``int8_products`` records which."""
        has_signed = CONTEXT_S8_KEY in graphs
        if signed_int8 and not has_signed:
            raise ModelFileError(
                f"{self.model_dir}: signed_int8 was demanded but this export has no "
                f"{CONTEXT_S8_FILE} (the current `elmo export --int8` writes it: re-run `elmo "
                "export --int8`)"
            )
        self.int8_products = None
        if has_signed and self.context_layout == "separate" and provider == CPU:
            signed = int8_accumulates_in_int32() if signed_int8 is None else signed_int8
            self.int8_products = "u8 x s8" if signed else "u8 x u8"
            log.info(
                "int8 products of %s as %s (%s)",
                self.model_dir,
                self.int8_products,
                CONTEXT_S8_FILE if signed else CONTEXT_LAYOUTS["separate"][1],
            )
            if signed:
                return CONTEXT_S8_KEY, CONTEXT_S8_FILE
        return CONTEXT_LAYOUTS[self.context_layout]

    @staticmethod
    def _parallel_runs(runs: int | None, threads: int | None, provider: str) -> tuple[int, int]:
        """(biLSTM batches run at once, intra-op threads of each): on CPU a second context session runs them, with
        ``threads // runs`` threads a run (the weights are held twice, the graph's working memory once per run);
        on CUDA one run at a time."""
        threads = int(threads or usable_cores())
        runs = 1 if provider == CUDA else min(threads, MAX_DEFAULT_RUNS_IN_FLIGHT) if runs is None else int(runs)
        return runs, max(1, threads // runs)

    def _open_parallel_runs(self) -> None:
        """The pools that run batches on the parallel session concurrently (:meth:`_run_batches`)."""
        self._pool = self._background_pool = None
        # Context runs submitted or executing now, over all calls: a lone batch takes the all-threads session only
        # when none is, and a pool's run waits while it executes (both would start every thread on the same cores).
        self._runs_lock = threading.Condition()
        self._runs_busy = 0
        self._all_threads_running = False
        if self._parallel is not None:
            self._pool = ThreadPoolExecutor(self.runs_in_flight, thread_name_prefix="elmo-run")
            # Threads are started on first use, so a background call never creates a foreground thread, nor the
            # other way round: each pool's threads keep the priority they were made with.
            self._background_pool = background_executor(
                self.runs_in_flight, "elmo-run-background", self.background_nice
            )

    def close(self) -> None:
        """Release the sessions and thread pools (a server unloading this model version); unusable afterwards. The
        memory comes back once the last reference to the Embedder is gone (then ``gc`` and ``malloc_trim``)."""
        for pool in (self._pool, self._background_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._background_pool = None
        self.encoder = self.context = self._parallel = None
        self.cache = TokenVectorCache(0)

    def _active_provider(self, request: ProviderRequest) -> str:
        active = {self.encoder.get_providers()[0], self.context.get_providers()[0]}
        if len(active) > 1:
            raise ElmoError(f"encoder and context graphs run on different providers {sorted(active)}")
        (provider,) = active
        if provider not in request.providers:
            raise ElmoError(f"execution provider {request.providers[0]} was demanded but {provider} is active")
        reason = provider_reason(request, provider)
        # A GPU left unused is a warning, so that it shows under any logging set-up; a CPU host is the normal case.
        fallback = request.gpu_unused or (CUDA in request.providers and provider != CUDA)
        level = logging.WARNING if fallback else logging.INFO
        log.log(level, "onnxruntime provider: %s active for %s (%s)", provider, self.model_dir, reason)
        return provider

    def _check_graphs(self) -> None:
        """The graphs' declared inputs/outputs must agree with onnx.json (catches foreign or stale graphs)."""
        p, layers, dim = int(self.meta["projection_dim"]), self.info.n_layers, self.info.dim
        expected = {
            "encoder": ({"char_ids": [None, self._char_axis()]}, {"token_vectors": [None, p]}),
            "context": (
                {"table": [None, p], "index": [None, None], "lengths": [None]},
                {"layers": [None, layers, None, dim]},
            ),
        }
        for part, (inputs, outputs) in expected.items():
            session = getattr(self, part)
            declared = {x.name: x.shape for x in session.get_inputs()}, {x.name: x.shape for x in session.get_outputs()}
            for want, got in zip((inputs, outputs), declared):
                ok = set(want) == set(got) and all(
                    len(got[name]) == len(shape) and all(_axis_matches(w, g) for w, g in zip(shape, got[name]))
                    for name, shape in want.items()
                )
                if not ok:
                    raise ModelFileError(
                        f"{self._paths[part]}: graph does not match onnx.json: declares {got}, expected {want}"
                    )

    def _char_axis(self) -> int | str:
        """The encoder's declared char-id axis: symbolic where onnx.json says rows may be cut, else the width."""
        return "symbolic" if self._trim_window else self.scheme.width

    # -- public API ------------------------------------------------------------------------------------------------
    def embed_tokens(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Tokenized sentences -> per sentence float32 ``(n_layers, n_tokens, dim)`` (empty -> n_tokens 0)."""
        return self.embed_tokens_with_stats(sentences)[0]

    def embed_tokens_with_stats(
        self, sentences: Sequence[Sequence[str]], background: bool = False, views: bool = False
    ) -> tuple[list[np.ndarray], EmbedStats]:
        """:meth:`embed_tokens` plus what the call cost (:class:`EmbedStats`: real vs padded tokens).

        ``background``: the call yields the cores to others under load: its parallel batches run on threads of
        lower priority (``background_nice``); a call of one batch while no other run executes runs on the calling
        thread, at the caller's priority (the service calls from a lowered thread: service.models.batcher).

        ``views``: each sentence's layers are a read-only view into its batch's output, not a copy of its own. A
        copy of more than a few hundred floats gives the GIL away and must take it back; beside a busy thread (the
        service's event loop) each take waits up to the switch interval: 64 sentences' copies took 0.2 ms alone and
        140 ms beside a spinning thread (measured: bench/notes/front-door.md). A caller that copies the vectors anyway
        (the service writes them into its answers) asks for views."""
        return self._embed_valid(self._validated(sentences), background, views)

    def _embed_valid(
        self, sentences: list[list[str]], background: bool = False, views: bool = False
    ) -> tuple[list[np.ndarray], EmbedStats]:
        """:meth:`embed_tokens_with_stats` past the input checks (the load-time check's probe sentences are the
        export's, longer than a server's ``max_tokens_per_sentence`` may be)."""
        table, rows = self._token_table(sentences)
        results: list[np.ndarray | None] = [None] * len(sentences)
        batches = self._batches([len(s) for s in sentences])
        padded = 0
        pool = self._background_pool if background else self._pool
        for indices, layers in zip(batches, self._run_batches(table, rows, batches, pool)):  # (B, L+1, T, D)
            padded += batch_positions([len(sentences[i]) for i in indices])
            if views:
                layers.flags.writeable = False  # the views share it: none may change another's vectors
            for row, index in enumerate(indices):
                layer_rows = layers[row, :, : len(sentences[index])]
                results[index] = layer_rows if views else np.ascontiguousarray(layer_rows)
        empty = np.zeros((self.info.n_layers, 0, self.info.dim), dtype=np.float32)
        stats = EmbedStats(len(sentences), sum(len(s) for s in sentences), padded, len(batches))
        return [empty.copy() if r is None else r for r in results], stats

    def embed_texts(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Raw texts -> per text its layers ``(n_layers, n_tokens, dim)``, tokenized by elmo.text.tokenize.tokenize
        (what ``EmbedderClient.embed_texts`` returns for the same call; :meth:`embed` adds tokens and offsets)."""
        return [embedding.layers for embedding in self.embed(self._texts(texts))]

    def embed(self, inputs: Sequence[str | Sequence[str]]) -> list[Embedding]:
        """Raw texts (tokenized here) or token lists -> per input its tokens, offsets (code points into the text;
        None for token lists) and every layer: the value ``EmbedderClient.embed`` returns for the same call."""
        if isinstance(inputs, str):
            raise InputError("embed takes a list of texts or token lists, not one string")
        tokenized = [tokenize(item) if isinstance(item, str) else None for item in inputs]
        sentences = [t.tokens if t is not None else list(item) for t, item in zip(tokenized, inputs)]
        vectors = self.embed_tokens(sentences)
        return [
            Embedding(tokens, t.offsets if t is not None else None, layers, None)
            for t, tokens, layers in zip(tokenized, sentences, vectors)
        ]

    @staticmethod
    def _texts(texts: Sequence[str]) -> list[str]:
        if isinstance(texts, str):
            raise InputError("embed_texts takes a list of texts, not one string")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"text {i} is {type(text).__name__}, not str")
        return list(texts)

    def check(self) -> ProbeResult:
        """The load-time check (elmo.runtime.probe): the export's probe through this runtime as it serves, judged
        against the export's own bar; one log line; ModelFileError when it misses. Runs once per Embedder."""
        if self.checked is None:
            self.checked = check_probe(self.model_dir, self.probe, lambda batch: self._embed_valid(batch)[0])
        return self.checked

    def warmup(self) -> None:
        """Real forward passes (allocations, kernel selection) before the first request: the load-time check when
        it has not run yet, else a short call; and the tokenizer's tables (its fast path's classes: ~0.2 s once)."""
        prepare_fast_path()
        if self.checked is None:
            self.check()
        else:
            self.embed_tokens([["Warm", "up", "."], ["a"]])

    def release_memory(self) -> None:
        """Hand the free regions of this runtime's onnxruntime memory arenas back to the system: one tiny run (one
        token) per session with onnxruntime's arena shrinkage (:func:`shrink_run_options`). Regions a concurrent run
        uses stay. What the server does once idle (:func:`elmo.runtime.memory.release_memory`); no-op after close."""
        encoder, context, parallel = self.encoder, self.context, self._parallel
        if encoder is None or context is None:
            return
        chars = np.array([self.scheme.token_ids("a")], dtype=np.int64)
        table = np.concatenate([np.zeros_like(self._boundaries[:1]), self._boundaries, self._boundaries[:1]])
        feeds = self._feeds(table, [[_FIRST_TOKEN_ROW]])
        for session, output, inputs in (
            (encoder, "token_vectors", {"char_ids": chars}),
            (context, "layers", feeds),
            (parallel, "layers", feeds),
        ):
            options = None if session is None else shrink_run_options(session)
            if options is not None:
                session.run([output], inputs, options)

    # -- internals -------------------------------------------------------------------------------------------------
    def _validated(self, sentences: Sequence[Sequence[str]]) -> list[list[str]]:
        if isinstance(sentences, str):
            raise InputError("embed_tokens takes a list of tokenized sentences, not one string")
        out = []
        limit = self.info.max_tokens_per_sentence
        for i, sentence in enumerate(sentences):
            if isinstance(sentence, str):
                raise InputError(f"sentence {i} is a string; pass a list of tokens (or use embed_texts)")
            tokens = list(sentence)
            for j, token in enumerate(tokens):
                if not isinstance(token, str) or not token:
                    raise InputError(f"sentence {i} token {j}: tokens must be non-empty strings, got {token!r}")
            if len(tokens) > limit:
                raise InputError(f"sentence {i} has {len(tokens)} tokens; the limit is {limit}")
            out.append(tokens)
        return out

    def _token_table(self, sentences: list[list[str]]) -> tuple[np.ndarray, list[list[int]]]:
        """(table (3 + U, P): pad, <S>, </S>, then the U distinct tokens; per sentence its rows in the table)."""
        distinct: dict[str, int] = {}
        rows = [[distinct.setdefault(t, len(distinct) + _FIRST_TOKEN_ROW) for t in s] for s in sentences]
        tokens = list(distinct)
        vectors = self.cache.lookup(tokens)
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            fresh = self._encode(np.array([self.scheme.token_ids(tokens[i]) for i in missing]))
            self.cache.store([tokens[i] for i in missing], fresh)
            for i, vector in zip(missing, fresh):
                vectors[i] = vector
        table = np.empty((_FIRST_TOKEN_ROW + len(tokens), self._boundaries.shape[1]), dtype=np.float32)
        table[_PAD_ROW] = 0.0
        table[_BOS_ROW : _EOS_ROW + 1] = self._boundaries
        if tokens:
            # Rows copied straight from the list: np.stack of small vectors costs ~3x more (~0.3 us a row)
            table[_FIRST_TOKEN_ROW:] = vectors
        return table, rows

    def _encode(self, char_ids: np.ndarray) -> np.ndarray:
        """(N, width) char ids -> (N, P) token vectors, in chunks that bound the conv activations' memory.

        Where the model allows it (onnx.json ``encoder_trim_window``), the rows are sorted by token length and each
        chunk is cut to its longest token + the window: the conv then skips the trailing padding (most of a
        50-id row) with the same result bit for bit (export.onnx_export.encoder_trim_window says why)."""
        lengths = char_lengths(char_ids, self.scheme.pad_id) if self._trim_window else None
        order = None if lengths is None else np.argsort(lengths, kind="stable")
        vectors = np.empty((len(char_ids), self._projection_dim), dtype=np.float32)
        for start in range(0, len(char_ids), ENCODER_CHUNK):
            rows = slice(start, start + ENCODER_CHUNK) if order is None else order[start : start + ENCODER_CHUNK]
            chunk = char_ids[rows].astype(np.int64)
            if lengths is not None:
                chunk = chunk[:, : self._trimmed_width(int(lengths[rows].max()))]
            n = len(chunk)
            if self._pad_encoder_batches:  # few distinct shapes: cuDNN plans and allocations get reused
                chunk = np.concatenate([chunk, np.zeros((padded_count(n) - n, chunk.shape[1]), np.int64)])
            vectors[rows] = self.encoder.run(["token_vectors"], {"char_ids": chunk})[0][:n]
        return vectors

    def _trimmed_width(self, longest: int) -> int:
        """Columns a chunk keeps: its longest token + the trim window; on CUDA rounded up to a multiple of 8 (few
        distinct shapes), never past the full row."""
        width = longest + self._trim_window
        if self._pad_encoder_batches:
            width = -(-width // 8) * 8
        return min(width, self.scheme.width)

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices of the non-empty sentences, sorted by length and cut into batches (each within
        max_batch_tokens, a longer sentence alone) that minimise the padded work (see plan_batches). With parallel
        runs, a lone batch of SPLIT_BATCH_TOKENS or more is cut in two, so that both runs have work."""
        order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
        sizes = plan_batches([lengths[i] + 2 for i in order], self.max_batch_tokens, self._step_cost)
        if self._parallel is not None and len(sizes) == 1 and sizes[0] > 1:
            if sizes[0] * (lengths[order[-1]] + 2) >= SPLIT_BATCH_TOKENS:
                sizes = [sizes[0] // 2, sizes[0] - sizes[0] // 2]
        batches, start = [], 0
        for size in sizes:
            batches.append(order[start : start + size])
            start += size
        return batches

    def _run_batches(
        self, table: np.ndarray, rows: list[list[int]], batches: list[list[int]], pool: ThreadPoolExecutor | None
    ):
        """Each batch's (B, L+1, T, D) layers, in order. A call of one batch on an otherwise idle runtime runs on
        the all-threads session (a lone sentence's latency); otherwise every batch runs on the parallel session's
        ``pool`` (started longest first, so that the call does not end on one long batch while the other runs
        idle): calls from several threads at once (the service's batcher) then share the cores run by run instead
        of each starting all the threads (measured: bench/notes/front-door.md)."""
        if pool is None:
            return (self._contextualize(table, [rows[i] for i in indices]) for indices in batches)
        if len(batches) == 1 and self._claim_all_threads():
            return [self._on_all_threads(table, [rows[i] for i in batches[0]])]
        work = [batch_positions([len(rows[i]) for i in indices]) for indices in batches]
        futures = {}
        for b in sorted(range(len(batches)), key=lambda b: -work[b]):
            # counted from its submission, not from its start: a call that claimed every thread between the two
            # would run beside it
            with self._runs_lock:
                self._runs_busy += 1
            try:
                futures[b] = pool.submit(self._counted_run, table, [rows[i] for i in batches[b]])
            except BaseException:
                self._run_ended()
                raise
        return (futures[b].result() for b in range(len(batches)))

    def _claim_all_threads(self) -> bool:
        """True (and counted as a run) when no context run is submitted or executing: the caller may use every
        thread, and runs submitted meanwhile wait for it to end (:meth:`_counted_run`)."""
        with self._runs_lock:
            if self._runs_busy:
                return False
            self._runs_busy += 1
            self._all_threads_running = True
            return True

    def _on_all_threads(self, table: np.ndarray, rows: list[list[int]]) -> np.ndarray:
        """One batch on the all-threads session, its claim (:meth:`_claim_all_threads`) given back after."""
        try:
            return self._contextualize(table, rows)
        finally:
            self._run_ended(all_threads=True)

    def _counted_run(self, table: np.ndarray, rows: list[list[int]]) -> np.ndarray:
        """One batch on the parallel session (a pool's thread), counted from its submission (:meth:`_run_batches`)
        until it ends; it starts once no all-threads run executes (a call's lone batch may have claimed every
        thread between this run's submission and its start)."""
        try:
            with self._runs_lock:
                self._runs_lock.wait_for(lambda: not self._all_threads_running)
            return self._contextualize(table, rows, True)
        finally:
            self._run_ended()

    def _run_ended(self, all_threads: bool = False) -> None:
        """A run's count given back; an all-threads run's end lets the pool's waiting runs start."""
        with self._runs_lock:
            self._runs_busy -= 1
            if all_threads:
                self._all_threads_running = False
                self._runs_lock.notify_all()

    def _contextualize(self, table: np.ndarray, rows: list[list[int]], parallel: bool = False) -> np.ndarray:
        """One batch through the biLSTM graph -> (B, L+1, T, D)."""
        feeds = self._feeds(table, rows)
        if parallel:
            return self._parallel.run(["layers"], feeds)[0]
        if not self.io_binding:
            return self.context.run(["layers"], feeds)[0]
        binding = self.context.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("layers", "cpu")  # onnxruntime copies the result once, into host memory
        self.context.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    @staticmethod
    def _feeds(table: np.ndarray, rows: list[list[int]]) -> dict[str, np.ndarray]:
        """The context graph's inputs for one batch: the batch's own rows of the call table (ascending), and each
        sentence's ``[<S>, tokens, </S>]`` as indices into them (padding: the zero row, there when some sentence is
        shorter than the longest). Built in plain Python, without a sort: numpy's sorts give the GIL away, and
        beside the service's busy event loop each take back waited for the switch interval."""
        longest = max(map(len, rows))
        used = set().union(*rows, (_BOS_ROW, _EOS_ROW))
        if any(len(r) < longest for r in rows):
            used.add(_PAD_ROW)
        used = sorted(used)
        at = {row: i for i, row in enumerate(used)}
        pad = at.get(_PAD_ROW, 0)
        index = [[at[_BOS_ROW], *map(at.__getitem__, r), at[_EOS_ROW]] + [pad] * (longest - len(r)) for r in rows]
        return {
            "table": table[used],
            "index": np.array(index, dtype=np.int64),
            "lengths": np.array([len(r) for r in rows], dtype=np.int64),
        }
