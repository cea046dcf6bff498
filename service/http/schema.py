"""JSON <-> the gRPC contract's messages, for the HTTP API. No I/O, no event loop: pure functions over dicts.

Every request is turned into the same ``elmo.v1`` message the gRPC API takes (so limits, tokenization, task mixes and
the overflow policy are applied by one code path), and every answer is read back from the same response message.
Wrong shapes and types raise :class:`ServiceError` INVALID_INPUT naming the field: ``'input[2]' must be a string``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import numpy as np
from elmo.service.common.errors import clip, invalid
from elmo.service.core.answers import EmbedResult, sentence_answers, timing_of
from elmo.service.http.encodings import ENCODINGS

from elmo.v1 import embedder_pb2 as pb
from elmo.wire import DTYPE_NAMES, OVERFLOW_VALUES

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # the range of the contract's int32 fields (EmbedRequest.layers)
_TYPE_NAMES = {str: "a string", bool: "true or false", int: "an integer", list: "a list", dict: "an object"}
# A JSON escape of a UTF-16 surrogate: the only way a lone surrogate gets into a body that decoded as UTF-8.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object (else INVALID_INPUT saying what is wrong with it). Every failure of the
    parser is the client's: not UTF-8, not JSON, NaN or Infinity, nested too deeply, an integer too long for Python,
    a lone surrogate in any string (which protobuf, UTF-8 and every later step refuse)."""
    if not body:
        raise invalid("the request body is empty: send a JSON object")
    try:
        text = body.decode("utf-8")  # JSON on the wire is UTF-8 (RFC 8259); no guessing
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_not_a_json_number)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise invalid(f"the request body is not valid JSON: {exc.msg} at {where}") from None
    except RecursionError:
        raise invalid(
            "the request body is nested too deeply (arrays or objects inside one another past the parser's limit); "
            "this API's requests nest four levels at most"
        ) from None
    except ValueError as exc:  # Python's int max-str-digits guard ("Exceeds the limit (4300 digits) ...")
        if "integer string conversion" in str(exc):
            limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
            raise invalid(
                f"the request body holds an integer with more than {limit} digits: no field of this API takes one"
            ) from None
        raise invalid(f"the request body is not valid JSON: {clip(str(exc), 200)}") from None
    if not isinstance(value, dict):
        raise invalid(f"the request body must be a JSON object, not {_json_type(value)}")
    if _SURROGATE_ESCAPE.search(body):
        _check_strings(value)
    return value


def _not_a_json_number(name: str) -> Any:
    raise invalid(f"the request body is not valid JSON: {name} is not a JSON value (RFC 8259 has no NaN or Infinity)")


def _unicode(text: str, name: str) -> str:
    """``text`` unchanged if it is valid Unicode; a lone surrogate (JSON can spell one, UTF-8 cannot) is a 400."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(
                f"{name} holds a lone surrogate (\\u{ord(text[exc.start]):04x} at code point {exc.start}): "
                "strings must be valid Unicode"
            ) from None
    return text


def _check_strings(value: Any) -> None:
    """Every string of a parsed body, field names included, at any depth, in document order (no recursion: the
    parser's own depth is the only limit)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _unicode(item, f"'{clip(path)}'")
        elif isinstance(item, list):
            stack.extend((item[i], f"{path}[{i}]") for i in reversed(range(len(item))))
        elif isinstance(item, dict):
            where = f"a field name in '{clip(path)}'" if path else "a field name"
            for key in item:
                _unicode(key, where)
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in reversed(item.items()))


def _header(value: str, name: str) -> str:
    """A header's value as it goes into the message. aiohttp decodes header bytes as UTF-8 with surrogateescape, so an
    invalid byte arrives as a lone surrogate U+DC80..U+DCFF: report the byte."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        if 0xDC80 <= code <= 0xDCFF:
            offset = len(value[: exc.start].encode("utf-8"))
            raise invalid(
                f"the '{name}' header is not valid UTF-8 (byte 0x{code - 0xDC00:02x} at offset {offset})"
            ) from None
        _unicode(value, f"the '{name}' header")
    return value


def _number(value: int) -> str:
    """An integer for a message: a huge one is described, not echoed."""
    return str(value) if value.bit_length() <= 64 else f"an integer of about {int(value.bit_length() * 0.30103)} digits"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _typed(value: Any, kind: type, name: str) -> Any:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise invalid(f"'{name}' must be {_TYPE_NAMES[kind]}, not {_json_type(value)}")
    return _unicode(value, f"'{name}'") if kind is str else value


def _int32(value: Any, name: str, low: int = INT32_MIN, what: str = "a 32-bit integer") -> int:
    _typed(value, int, name)
    if not low <= value <= INT32_MAX:
        raise invalid(f"'{name}' = {_number(value)} is out of range: it must be {what} ({low}..{INT32_MAX})")
    return value


def _get(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else _typed(value, kind, name)


def _choice(body: dict, name: str, choices: tuple[str, ...] | list[str], default: str) -> str:
    value = _get(body, name, str, default).strip().lower()
    if value not in choices:
        raise invalid(f"'{name}' must be one of {', '.join(choices)}, not '{clip(value)}'")
    return value


def _no_unknown_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"unknown field '{clip(unknown[0])}' (this endpoint takes: {', '.join(sorted(known))})")


def _overflow(body: dict) -> int:
    if body.get("overflow") is None:
        return pb.OVERFLOW_DEFAULT
    return OVERFLOW_VALUES[_choice(body, "overflow", list(OVERFLOW_VALUES), "")]


def split_model(value: str, aliases: Container[str] = ()) -> tuple[str, str]:
    """OpenAI's ``model`` -> (served model, task): ``default``, ``default:pos_brown``, or ``:pos_brown`` for the task
    of the default model. An empty model means the default one; an alias (``--model-alias``) stays whole (the
    model registry resolves it, with its task)."""
    if value in aliases:
        return value, ""
    model, sep, task = value.rpartition(":")
    return (model, task) if sep else (value, "")


# -- POST /v1/embeddings (OpenAI) ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenAIRequest:
    embed: pb.EmbedRequest
    encoding: str
    dimensions: int | None
    normalize: bool | None  # None: the server's default (--normalize)


def parse_openai(body: dict, request_id: str = "", aliases: Container[str] = ()) -> OpenAIRequest:
    """OpenAI's embeddings request, plus this service's ``normalize`` and ``overflow``. Unknown fields (``user``...)
    are ignored, as OpenAI-compatible servers do."""
    texts = _openai_inputs(body.get("input"))
    model, task = split_model(_get(body, "model", str, ""), aliases)
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise invalid(f"'normalize' must be true or false, not {_json_type(normalize)}")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        dimensions = _int32(dimensions, "dimensions", low=1, what="a positive 32-bit integer")
    request = pb.EmbedRequest(
        inputs=[pb.Input(text=t) for t in texts],
        model=model,
        task=task,
        omit_layers=bool(task),
        overflow=_overflow(body),
        request_id=_header(request_id, "X-Request-Id"),
    )
    return OpenAIRequest(request, _choice(body, "encoding_format", list(ENCODINGS), "float"), dimensions, normalize)


def _openai_inputs(value: Any) -> list[str]:
    if value is None:
        raise invalid("'input' is missing: send a string or a list of strings")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise invalid(f"'input' must be a string or a list of strings, not {_json_type(value)}")
    if not value:
        raise invalid("'input' is an empty list: send at least one string")
    for i, item in enumerate(value):
        if isinstance(item, (int, list)) and not isinstance(item, bool):
            raise invalid(
                f"'input[{i}]' is a token id or a list of token ids: this service tokenizes text itself; send strings "
                "(LangChain's OpenAIEmbeddings sends token ids unless check_embedding_ctx_length=False)"
            )
        _typed(item, str, f"input[{i}]")
    return value


def openai_answer(
    parsed: OpenAIRequest,
    vectors: list[np.ndarray],
    n_tokens: int,
    model_id: str,
    model_version: int = 0,
    task_stale: bool = False,
) -> dict:
    """OpenAI's embeddings answer from one pooled float32 vector per input (service.core.answers.pooled), with the
    version of the model that computed it (0: served with --model) and whether the task mix applied is stale."""
    write = ENCODINGS[parsed.encoding].write_vector
    data = [{"object": "embedding", "index": index, "embedding": write(vector)} for index, vector in enumerate(vectors)]
    return {
        "object": "list",
        "data": data,
        "model": model_id,
        "model_version": model_version,
        "task_stale": task_stale,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


# -- POST /v1/embed (the gRPC contract's content) -----------------------------------------------------------------
# One name per idea across the three routes: ``input`` (OpenAI's) is what to embed or tokenize, ``encoding_format``
# (OpenAI's) how vectors are written. The older names stay accepted as aliases (documented as such in the OpenAPI
# document); sending a name and its alias together is refused rather than one silently winning.
INPUT_ALIASES = {"/v1/embed": ("inputs",), "/v1/tokenize": ("text", "texts")}
ENCODING_ALIASES = ("encoding",)
EMBED_OPTIONS = ("layers", "task", "omit_layers", "dtype", "model", "request_id", "overflow")  # the proto's own names
EMBED_FIELDS = {"input", *INPUT_ALIASES["/v1/embed"], "encoding_format", *ENCODING_ALIASES, *EMBED_OPTIONS}


@dataclass(frozen=True)
class EmbedCall:
    embed: pb.EmbedRequest
    encoding: str


def _one_of(body: dict, names: tuple[str, ...], what: str) -> str | None:
    """The one of ``names`` (a field and its aliases) that ``body`` has, or None; two of them are a 400."""
    sent = [name for name in names if name in body]
    if len(sent) > 1:
        first = names[0]
        alias = f"'{sent[1]}' is an alias of '{first}'" if sent[0] == first else f"both are aliases of '{first}'"
        raise invalid(f"send {what} once: '{sent[0]}' and '{sent[1]}' are the same field ({alias})")
    return sent[0] if sent else None


def parse_embed(body: dict, request_id: str = "") -> EmbedCall:
    """``input``: strings (tokenized by the service) or lists of tokens (``{"text": ...}`` and ``{"tokens": [...]}``
    are accepted too; one string is one input); ``inputs`` is its alias. The other fields are the gRPC
    EmbedRequest's, plus ``encoding_format`` (float | base64; alias ``encoding``)."""
    _no_unknown_fields(body, EMBED_FIELDS)
    name = _one_of(body, ("input", *INPUT_ALIASES["/v1/embed"]), "the inputs")
    inputs = None if name is None else body[name]
    if inputs is None:
        raise invalid("'input' is missing: send a list of texts or of token lists")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list):
        raise invalid(f"'{name}' must be a string or a list of texts or token lists, not {_json_type(inputs)}")
    layers = _get(body, "layers", list, [])
    encoding_name = _one_of(body, ("encoding_format", *ENCODING_ALIASES), "the encoding") or "encoding_format"
    request = pb.EmbedRequest(
        inputs=[_embed_input(item, f"{name}[{i}]") for i, item in enumerate(inputs)],
        layers=[_int32(layer, f"layers[{i}]") for i, layer in enumerate(layers)],
        task=_get(body, "task", str, ""),
        omit_layers=_get(body, "omit_layers", bool, False),
        dtype=DTYPE_NAMES[_choice(body, "dtype", list(DTYPE_NAMES), "float32")],
        model=_get(body, "model", str, ""),
        request_id=_get(body, "request_id", str, "") or _header(request_id, "X-Request-Id"),
        overflow=_overflow(body),
    )
    return EmbedCall(request, _choice(body, encoding_name, list(ENCODINGS), "float"))


def _embed_input(item: Any, name: str) -> pb.Input:
    if isinstance(item, dict):
        _no_unknown_fields(item, {"text", "tokens"})
        if ("text" in item) == ("tokens" in item):
            raise invalid(f"'{name}' must have exactly one of 'text' and 'tokens'")
        item = item.get("text", item.get("tokens"))
    if isinstance(item, str):
        return pb.Input(text=_unicode(item, f"'{name}'"))
    if isinstance(item, list):
        return pb.Input(tokens=pb.Tokens(tokens=[_typed(t, str, f"{name}[{j}]") for j, t in enumerate(item)]))
    raise invalid(f"'{name}' must be a string, a list of tokens, or an object with 'text' or 'tokens'")


def tensor_json(array: np.ndarray, encoding: str) -> Any:
    """A tensor (an array in its wire dtype) as its encoding writes it (service/http/encodings.py)."""
    return ENCODINGS[encoding].write_tensor(array)


def embed_answer(result: EmbedResult, encoding: str, request_id: str = "") -> dict:
    """/v1/embed's answer: the fields of ``elmo.v1.EmbedResponse``, vectors written from the arrays themselves."""
    prepared = result.prepared
    embeddings = []
    for index, sentence in enumerate(sentence_answers(result)):
        item: dict[str, Any] = {"index": index, "tokens": sentence.tokens}
        if sentence.offsets:
            item["offsets"] = sentence.offsets  # (start, end) pairs: JSON arrays
        if sentence.truncated:
            item["truncated_tokens"] = sentence.truncated
        if sentence.layers is not None:
            item["layers"] = tensor_json(sentence.layers, encoding)
        if sentence.mix is not None:
            item["mix"] = tensor_json(sentence.mix, encoding)
        embeddings.append(item)
    n_tokens = prepared.n_tokens
    return {
        "object": "embed",
        "model": prepared.model.name,
        "model_version": prepared.model.number,
        "task_stale": prepared.task_stale,
        # the layers the embeddings hold: none under omit_layers (only the task's mix)
        "layers": [] if prepared.omit_layers else list(prepared.layers or range(prepared.model.n_layers)),
        "request_id": request_id,
        "embeddings": embeddings,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "timing": timing_of(result),
    }


# -- POST /v1/tokenize ---------------------------------------------------------------------------------------------
def parse_tokenize(body: dict) -> pb.TokenizeRequest:
    """``input``: a string or a list of strings; ``text`` (a string) and ``texts`` (a list) are its aliases."""
    names = ("input", *INPUT_ALIASES["/v1/tokenize"])
    _no_unknown_fields(body, {*names, "model"})
    name = _one_of(body, names, "the texts")
    if name is None or body[name] is None:
        raise invalid("'input' is missing: send a string or a list of strings")
    texts = body[name]
    if name == "text":
        texts = [_typed(texts, str, name)]
    elif name == "input" and not isinstance(texts, (str, list)):
        raise invalid(f"'input' must be a string or a list of strings, not {_json_type(texts)}")
    elif isinstance(texts, str) and name == "input":
        texts = [texts]
    _typed(texts, list, name)
    return pb.TokenizeRequest(
        texts=[_typed(t, str, f"{name}[{i}]") for i, t in enumerate(texts)], model=_get(body, "model", str, "")
    )


def tokenize_answer(response: pb.TokenizeResponse) -> dict:
    return {
        "texts": [{"tokens": list(t.tokens), "offsets": [[s.start, s.end] for s in t.offsets]} for t in response.texts]
    }


# -- GET /v1/models ------------------------------------------------------------------------------------------------
def model_entries(info: pb.ModelInfo, status: pb.ModelStatus | None = None) -> list[dict]:
    """OpenAI's model objects for one served model: the model itself (with its loaded versions, from ``status``),
    then one ``model:task`` per task mix."""
    limits = info.limits
    details = {
        "n_layers": info.n_layers,
        "dim": info.dim,
        "version": info.version,
        "model_version": info.model_version,
        "versions": [version_json(v) for v in status.versions] if status is not None else [],
        "execution_provider": info.execution_provider,
        "max_tokens_per_sentence": info.max_tokens_per_sentence,
        "tasks": list(info.tasks),
        "stale_tasks": list(info.stale_tasks),
        "limits": {
            "max_inputs": limits.max_inputs,
            "max_tokens_per_sentence": limits.max_tokens_per_sentence,
            "max_tokens_per_request": limits.max_tokens_per_request,
            "max_message_bytes": limits.max_message_bytes,
            "max_response_bytes": limits.max_response_bytes,
            "max_pooled_inputs": limits.max_pooled_inputs,
            "max_pooled_tokens": limits.max_pooled_tokens,
        },
    }
    base = {"object": "model", "created": 0, "owned_by": "elmo"}
    entries = [{"id": info.name, **base, **details}]
    for task in info.tasks:
        entries.append(
            {"id": f"{info.name}:{task}", **base, "parent": info.name, "task": task, "stale": task in info.stale_tasks}
        )
    return entries


def version_json(version: pb.VersionStatus) -> dict:
    """One version of a model, as /v1/models and the admin API list it."""
    item = {
        "version": version.version,
        "state": pb.VersionState.Name(version.state).removeprefix("VERSION_").lower(),
        "serving": version.serving,
        "memory_bytes": version.memory_bytes,
        "in_flight": version.in_flight,
    }
    if version.reason:
        item["reason"] = version.reason
    return item


def status_json(status: pb.ModelStatus) -> dict:
    return {"name": status.name, "versions": [version_json(v) for v in status.versions]}


def alias_entry(alias: str, model: str, task: str) -> dict:
    """OpenAI's model object for an alias (``--model-alias``)."""
    return {
        "id": alias,
        "object": "model",
        "created": 0,
        "owned_by": "elmo",
        "alias_of": f"{model}:{task}" if task else model,
    }


__all__ = [
    "alias_entry",
    "EmbedCall",
    "OpenAIRequest",
    "embed_answer",
    "model_entries",
    "openai_answer",
    "parse_embed",
    "parse_json",
    "parse_openai",
    "parse_tokenize",
    "split_model",
    "status_json",
    "tensor_json",
    "tokenize_answer",
    "version_json",
]
