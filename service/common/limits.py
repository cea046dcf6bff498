"""Every limit of the service in one place: defaults, ``elmo serve`` flags, and validation of the values.

The defaults keep a 2-core CPU box responsive and a single response under gRPC's usual message sizes; raise them
deliberately (see docs/reference/commands.md, elmo serve).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from elmo.errors import ConfigError, InputError
from elmo.flags import add_fields_as_flags, fields_from_args
from elmo.runtime.priority import BACKGROUND_NICE, MAX_NICE
from elmo.sizes import human_bytes  # noqa: F401  (the one byte formatter; importers of this module use it)
from elmo.text.overflow import DEFAULT_WINDOW_OVERLAP, Overflow

MIB = 1024 * 1024
TIMEOUTS = (
    "http_header_timeout",
    "http_body_timeout",
    "http_body_deadline_s",
    "http_idle_timeout",
    "grpc_idle_timeout",
    "grpc_message_timeout",
    "answer_write_timeout_s",
)
# the others must be positive
NON_NEGATIVE = (
    "max_delay_ms",
    "drain_seconds",
    "shutdown_delay",
    "window_overlap",
    "express_tokens",
    "grpc_connection_age",
)


@dataclass(frozen=True)
class Limits:
    # -- per request ---------------------------------------------------------------------------------------------
    max_inputs: int = 256  # sentences in one EmbedRequest / texts in one TokenizeRequest
    max_tokens_per_sentence: int = 512  # further capped by the model's own limit
    max_tokens_per_request: int = 8192
    max_message_bytes: int = 8 * MIB  # largest request gRPC accepts (larger: RESOURCE_EXHAUSTED from gRPC itself)
    max_response_bytes: int = 64 * MIB  # largest response the server builds (larger: INVALID_ARGUMENT, up front)
    # -- answers built and not yet taken by their clients (service.core.budget) -----------------------------------
    answer_bytes_in_flight: int = 1024 * MIB  # all answers being computed or sent; beyond: RESOURCE_EXHAUSTED / 503
    answer_bytes_in_flight_per_peer: int = 256 * MIB  # of those, what one client address may hold
    answer_write_timeout_s: float = 30.0  # HTTP: a 256 KiB piece of an answer not taken this soon: connection closed
    # -- per pooled request (OpenAI's /v1/embeddings: one vector per input, so far larger requests) --------------
    max_pooled_inputs: int = 2048  # OpenAI's own limit
    max_pooled_tokens: int = 300_000  # all inputs together (OpenAI's per-request limit); embedded in chunks
    # -- queue and batching --------------------------------------------------------------------------------------
    max_queue_tokens: int = 65536  # tokens waiting across all requests; beyond: RESOURCE_EXHAUSTED "overloaded"
    max_batch_tokens: int = 8192  # real tokens in one runtime call (the runtime cuts padding-minimal sub-batches)
    max_batch_sentences: int = 256
    max_delay_ms: float = 2.0  # while a batch runs, how long a partial batch waits for company
    express_tokens: int = (
        64  # requests this small (about one sentence) may run on one extra runtime worker while all others are busy
    )
    # -- server --------------------------------------------------------------------------------------------------
    max_concurrent_rpcs: int = 1024  # calls open at once, health checks not counted; beyond: RESOURCE_EXHAUSTED
    max_calls_per_peer: int = 256  # of those, what one client address may hold (behind a proxy: raise to the whole)
    # -- gRPC connections: one peer must not hold the whole server (half-sent calls, idle streams) ---------------
    max_streams_per_connection: int = 100  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: RPCs open at once per connection
    grpc_idle_timeout: float = 300.0  # a connection with no RPC, or a stream with no message, this long is closed
    grpc_message_timeout: float = 30.0  # a unary call's request message must be whole this soon after its headers
    grpc_connection_age: float = 3600.0  # a connection this old is closed, its RPCs given the write timeout more
    max_stream_inflight: int = 16  # EmbedStream requests in flight per stream (backpressure)
    # SIGTERM: seconds of NOT_SERVING health while requests are still answered (a balancer's checks take the
    # replica out first), then the drain
    shutdown_delay: float = 0.0
    drain_seconds: float = 30.0  # SIGTERM: how long in-flight requests get to finish
    request_workers: int = 2  # threads that tokenize, plan windows and build/encode answers (off the event loop)
    background_nice: int = BACKGROUND_NICE  # how much lower long requests' threads run (elmo.runtime.priority)
    # -- HTTP connections (service.http.connections) -------------------------------------------------------------
    http_header_timeout: float = 10.0  # a request's headers must arrive within this (from connect or first byte)
    http_body_timeout: float = 30.0  # longest pause between two reads of a request body
    http_body_deadline_s: float = 120.0  # the whole body must arrive within this, whatever its pace
    http_idle_timeout: float = 60.0  # a keep-alive connection with no request for this long is closed
    max_connections: int = 1000  # open HTTP connections; more are closed at once with 503
    max_connections_per_peer: int = 250  # of those, what one client address may hold open
    # -- long sentences (elmo.text.overflow) ----------------------------------------------------------------
    overflow: str = Overflow.REJECT.value  # requests that name no policy get this one
    window_overlap: int = DEFAULT_WINDOW_OVERLAP  # tokens shared by neighbouring windows under 'window'

    def validate(self) -> Limits:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "overflow":
                ok = True  # checked below, with its own message
            elif f.name in NON_NEGATIVE:
                ok = value >= 0
            elif f.name == "background_nice":
                ok = isinstance(value, int) and 0 <= value <= MAX_NICE
            elif f.name in TIMEOUTS:
                ok = isinstance(value, (int, float)) and value > 0
            else:
                ok = isinstance(value, int) and value > 0
            if not ok:
                allowed = _RANGES.get(f.name, "positive")
                raise ConfigError(f"limit --{flag_name(f.name)} must be {allowed} (got {value!r})")
        try:
            Overflow.parse(self.overflow)
        except InputError as exc:
            raise ConfigError(f"--overflow: {exc}") from None
        if self.max_tokens_per_sentence > self.max_tokens_per_request:
            raise ConfigError("--max-sentence-tokens must not exceed --max-request-tokens")
        if self.max_tokens_per_sentence > self.max_batch_tokens:
            raise ConfigError("--max-sentence-tokens must not exceed --max-batch-tokens (a sentence must fit)")
        if self.max_pooled_tokens < self.max_tokens_per_sentence:
            raise ConfigError("--max-pooled-tokens must be at least --max-sentence-tokens (a sentence must fit)")
        if self.answer_bytes_in_flight_per_peer > self.answer_bytes_in_flight:
            raise ConfigError("--in-flight-answer-bytes-per-peer must not exceed --in-flight-answer-bytes")
        if self.max_tokens_per_request > self.max_queue_tokens:
            raise ConfigError("--max-request-tokens must not exceed --max-queue-tokens (a request must fit)")
        return self


_RANGES = {
    **{name: ">= 0" for name in NON_NEGATIVE},
    "background_nice": f"in 0..{MAX_NICE}",
}

_HELP = {
    "max_inputs": "sentences per request",
    "max_tokens_per_sentence": "tokens per sentence (also capped by the model)",
    "max_tokens_per_request": "tokens per request, all sentences together",
    "max_message_bytes": "largest request message in bytes",
    "max_response_bytes": "largest response message in bytes",
    "answer_bytes_in_flight": "bytes of answers the server holds at once, all clients together: from before an "
    "answer is computed until its client has taken it (a call whose answer would go over is refused before any work: "
    "gRPC RESOURCE_EXHAUSTED, HTTP 503 with Retry-After)",
    "answer_bytes_in_flight_per_peer": "bytes of answers one client address may hold at once, its share of "
    "--in-flight-answer-bytes: a client that does not read its answers gets its next calls refused (behind a proxy "
    "raise it to --in-flight-answer-bytes)",
    "answer_write_timeout_s": "seconds an HTTP client may take to read each 256 KiB piece of its answer, then the "
    "connection is closed and the answer freed; on gRPC, how long a connection's calls may still take once "
    "--grpc-connection-age-s closed it (answers a gRPC client does not read hold its share of --in-flight-answer-bytes "
    "until then)",
    "max_pooled_inputs": "inputs per POST /v1/embeddings request (one pooled vector each)",
    "max_pooled_tokens": "tokens per POST /v1/embeddings request, all inputs together (embedded in chunks of "
    "--max-request-tokens, so memory is bounded by the answer, not the request)",
    "max_queue_tokens": "tokens waiting in the queue before new requests get RESOURCE_EXHAUSTED 'overloaded'",
    "max_batch_tokens": "tokens per runtime call (the runtime sorts and sub-batches them)",
    "max_batch_sentences": "sentences per runtime call",
    "max_delay_ms": "while a batch is running, how long a partial batch waits for company (an idle batcher sends "
    "what one pass of the event loop brought at once)",
    "express_tokens": "requests of at most this many tokens may run on one extra runtime worker while all others "
    "are busy, so that they never wait behind long ones (0 = no express worker)",
    "max_concurrent_rpcs": "gRPC calls open at once before new ones get RESOURCE_EXHAUSTED (health checks are not "
    "counted: a probe is never refused because embedding calls are full)",
    "max_calls_per_peer": "gRPC calls one client address may have open at once, its share of --max-concurrent-rpcs "
    "(behind a proxy every call comes from the proxy: raise it to --max-concurrent-rpcs there)",
    "max_streams_per_connection": "RPCs one gRPC connection may have open at once (HTTP/2 max concurrent streams): "
    "a peer holding calls it never finishes sending holds at most this many, not --max-concurrent-rpcs",
    "grpc_idle_timeout": "seconds a gRPC connection with no RPC open stays up before the server closes it; also "
    "how long an EmbedStream may go without sending a request (then its answers are sent and it ends with "
    "DEADLINE_EXCEEDED)",
    "grpc_message_timeout": "seconds a gRPC call's request message may take to arrive after its headers (then "
    "DEADLINE_EXCEEDED): a call whose message never completes holds its place no longer",
    "grpc_connection_age": "seconds after which the server closes a gRPC connection (GOAWAY; its RPCs get "
    "--answer-write-timeout-s more; "
    "clients reconnect): whatever a connection holds is held for at most this long (0 = no age limit)",
    "max_stream_inflight": "EmbedStream requests in flight per stream",
    "shutdown_delay": "on SIGTERM, seconds the server keeps answering while its health checks (gRPC health, GET "
    "/health) say NOT_SERVING, so that a load balancer takes it out of rotation before it refuses anything; set it "
    "above the balancer's check interval x fall count (deploy/haproxy.cfg takes about 2 s: 5 is ample). A second "
    "signal ends it early. Then the drain (--drain-timeout-s)",
    "drain_seconds": "on SIGTERM, seconds in-flight requests get to finish",
    "request_workers": "threads that tokenize requests and build answers, off the event loop",
    "background_nice": "how much lower (nice) the runtime threads computing long requests (over --express-tokens) run "
    "while short ones are about: the cores go to the short requests first; an idle machine runs long ones at full "
    "speed (0 = the same priority; Linux only)",
    "http_header_timeout": "seconds an HTTP request's headers may take to arrive",
    "http_body_timeout": "seconds an HTTP request body may pause between two reads",
    "http_body_deadline_s": "seconds an HTTP request body may take in all, from its headers to its last byte, "
    "however steadily it trickles (then 408 and the connection is closed)",
    "http_idle_timeout": "seconds an idle keep-alive HTTP connection stays open",
    "max_connections": "open HTTP connections; beyond, new ones get 503 and are closed",
    "max_connections_per_peer": "open HTTP connections from one client address, its share of --max-connections "
    "(beyond: 503; behind a proxy raise it to --max-connections)",
    "overflow": "sentences over --max-sentence-tokens when the request names no policy: reject, truncate, or "
    "window (overlapping windows stitched back)",
    "window_overlap": "tokens shared by neighbouring windows under --overflow window (capped at half the window)",
}


# Flags whose name is not the field's: units said (-s, -tokens, -bytes), threads named as such. Each field's older
# flag still works, hidden (elmo.flags.DeprecatedAlias).
_FLAG_NAMES = {
    "max_tokens_per_sentence": "max-sentence-tokens",
    "max_tokens_per_request": "max-request-tokens",
    "answer_bytes_in_flight": "in-flight-answer-bytes",
    "answer_bytes_in_flight_per_peer": "in-flight-answer-bytes-per-peer",
    "grpc_idle_timeout": "grpc-idle-timeout-s",
    "grpc_message_timeout": "grpc-message-timeout-s",
    "grpc_connection_age": "grpc-connection-age-s",
    "shutdown_delay": "shutdown-delay-s",
    "drain_seconds": "drain-timeout-s",
    "request_workers": "request-threads",
    "http_header_timeout": "http-header-timeout-s",
    "http_body_timeout": "http-body-timeout-s",
    "http_idle_timeout": "http-idle-timeout-s",
    "window_overlap": "window-overlap-tokens",
}
# --help's group of each limit (elmo serve shows them in this order after the essentials); the rest: batching and limits
_CONNECTIONS = (
    "max_concurrent_rpcs",
    "max_calls_per_peer",
    "max_streams_per_connection",
    "grpc_idle_timeout",
    "grpc_message_timeout",
    "grpc_connection_age",
    "max_stream_inflight",
    "http_header_timeout",
    "http_body_timeout",
    "http_body_deadline_s",
    "http_idle_timeout",
    "max_connections",
    "max_connections_per_peer",
    "answer_write_timeout_s",
)
_RUNTIME = ("request_workers", "background_nice")
_OPERATIONS = ("shutdown_delay", "drain_seconds")


def flag_name(field_name: str) -> str:
    """A limit's flag, without the dashes: ``max_tokens_per_sentence`` -> ``max-sentence-tokens``."""
    return _FLAG_NAMES.get(field_name, field_name.replace("_", "-"))


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The limits' flags in three groups (batching and limits, connections, runtime tuning); the shutdown's two
    among the operations flags (the parser's own group)."""
    runtime = _group(parser, "runtime tuning")
    group_of = {
        **{name: _group(parser, "connections") for name in _CONNECTIONS},
        **{name: runtime for name in _RUNTIME},
        **{name: parser for name in _OPERATIONS},
    }
    add_fields_as_flags(
        _group(parser, "batching and limits"),
        Limits(),
        _HELP,
        flag_name,
        choices={"overflow": [o.value for o in Overflow]},
        group_of=group_of,
        dest_is_field=True,
        aliases={name: "--" + name.replace("_", "-") for name in _FLAG_NAMES},
    )


def _group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The parser's argument group of this title (made if there is none yet)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def limits_from_args(args: argparse.Namespace) -> Limits:
    return fields_from_args(Limits, args).validate()


METADATA_SOFT_BYTES = 8 * 1024
METADATA_HARD_BYTES = 16 * 1024


def grpc_server_settings(limits: Limits, reuse_port: bool = False) -> dict:
    """``grpc.aio.server``'s keyword arguments for these limits: message sizes and gRPC core's per-connection
    bounds (without them one connection of half-sent calls could hold every one of --max-concurrent-rpcs, gRPC
    health included): streams open at once, idle and age limits. gRPC core's own count of open calls is only a backstop
    behind the call gate (service.grpc.interceptors.CallGate), with room for health checks and calls being refused.
    SO_REUSEPORT only when asked (``reuse_port``: sibling processes share the port): otherwise a second server on
    a taken port must fail, not share it."""
    options = [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_response_bytes + MIB),  # the answer's bound, plus framing
        ("grpc.so_reuseport", int(reuse_port)),
        ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
        ("grpc.max_connection_idle_ms", int(limits.grpc_idle_timeout * 1000)),
        # A call's headers as decoded, whatever they cost on the wire (HPACK lets a few bytes repeat a 4 KiB table
        # entry): over the soft bound some calls, over the hard one every call is refused with RESOURCE_EXHAUSTED
        # before anything is kept (gRPC's own defaults, stated here so that they are the service's bound).
        ("grpc.max_metadata_size", METADATA_SOFT_BYTES),
        ("grpc.absolute_max_metadata_size", METADATA_HARD_BYTES),
    ]
    if limits.grpc_connection_age > 0:
        options += [
            ("grpc.max_connection_age_ms", int(limits.grpc_connection_age * 1000)),
            # then it is closed whatever it holds: answers its client never took are freed here
            ("grpc.max_connection_age_grace_ms", int(limits.answer_write_timeout_s * 1000)),
        ]
    return {"maximum_concurrent_rpcs": 2 * limits.max_concurrent_rpcs + 256, "options": options}


__all__ = [
    "MIB",
    "Limits",
    "add_limit_arguments",
    "flag_name",
    "grpc_server_settings",
    "human_bytes",
    "limits_from_args",
]
