"""service.telemetry.tracing: a real `elmo serve` exports the trace of one request to a real OTLP receiver.

The receiver is a gRPC server implementing the OTLP TraceService (the proto classes of opentelemetry-proto, what the
OpenTelemetry Collector implements), started by the test on 127.0.0.1; the server under test exports to it through
the SDK's OTLP/gRPC exporter, as it would to a collector. Nothing is mocked. The spans of one Embed call (gRPC) and
one POST /v1/embed (HTTP) must arrive, children of the caller's W3C traceparent."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import urllib.request
from concurrent import futures

import grpc
import pytest

from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import REPO
from tests.serve_process import ServeProcess, wait_until

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")

STEPS = {"elmo.admission", "elmo.queue_wait", "elmo.batch", "elmo.answer"}  # children of the request's span


class Receiver(trace_service_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span it is sent, by trace id (hex)."""

    def __init__(self) -> None:
        self.spans: dict[str, list] = {}
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the proto's method name
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.setdefault(span.trace_id.hex(), []).append(span)
        return trace_service.ExportTraceServiceResponse()

    def of(self, trace_id: str) -> list:
        with self.lock:
            return list(self.spans.get(trace_id, []))


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = Receiver()
    trace_service_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture(scope="module")
def traced_server(receiver, tiny_model_dir, tmp_path_factory):
    _, port = receiver
    args = ["--model", str(tiny_model_dir), "--http-port", "0", "--otlp-endpoint", f"http://127.0.0.1:{port}"]
    # a short export delay: the spans reach the receiver within a fraction of a second, not the SDK's 5 s
    with ServeProcess(args, tmp_path_factory.mktemp("traced"), env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as server:
        target = server.wait_serving()
        http_port = server.port_file.read_text().split("\n")[2].strip()
        yield server, target, f"http://127.0.0.1:{http_port}"


def traceparent() -> tuple[str, str, str]:
    """(header value, trace id, parent span id): a sampled W3C traceparent, as a caller's tracer sends it."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def arrived(receiver: Receiver, trace_id: str, request_span: str) -> dict[str, list]:
    """The trace's spans by name, once the request's span and every step's have arrived."""

    def complete() -> bool:
        names = {span.name for span in receiver.of(trace_id)}
        return {request_span, *STEPS, "elmo.runtime_call"} <= names

    wait_until(complete, 60, f"the spans of trace {trace_id} at the OTLP receiver")
    by_name: dict[str, list] = {}
    for span in receiver.of(trace_id):
        by_name.setdefault(span.name, []).append(span)
    return by_name


def check_tree(spans: dict[str, list], request_span: str, caller_span: str) -> None:
    """The request's span is the caller's child, each step the request's child, each runtime call its batch's."""
    (root,) = spans[request_span]
    assert root.parent_span_id.hex() == caller_span
    assert root.kind == root.SPAN_KIND_SERVER
    for name in STEPS:
        for span in spans[name]:
            assert span.parent_span_id == root.span_id, name
            assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
            assert span.end_time_unix_nano <= root.end_time_unix_nano, name
    batches = {span.span_id for span in spans["elmo.batch"]}
    assert {span.parent_span_id for span in spans["elmo.runtime_call"]} <= batches
    (queue,) = spans["elmo.queue_wait"]
    assert queue.end_time_unix_nano <= min(span.start_time_unix_nano for span in spans["elmo.batch"])
    (admission,), (answer,) = spans["elmo.admission"], spans["elmo.answer"]
    assert admission.end_time_unix_nano <= queue.start_time_unix_nano
    assert answer.start_time_unix_nano >= max(span.end_time_unix_nano for span in spans["elmo.batch"])


@pytest.mark.slow  # a served model (its module fixture) and the receiver: `make test`, not `make check`
def test_a_grpc_call_is_traced_under_the_callers_traceparent(receiver, traced_server):
    servicer, _ = receiver
    _, target, _ = traced_server
    header, trace_id, caller_span = traceparent()
    request = pb.EmbedRequest(inputs=[pb.Input(text="the river bank flooded"), pb.Input(text="a bank loan")])
    with grpc.insecure_channel(target) as channel:
        reply = pb_grpc.EmbedderStub(channel).Embed(request, metadata=[("traceparent", header)], timeout=60)
    assert len(reply.embeddings) == 2
    spans = arrived(servicer, trace_id, "elmo.v1.Embedder/Embed")
    check_tree(spans, "elmo.v1.Embedder/Embed", caller_span)
    (root,) = spans["elmo.v1.Embedder/Embed"]
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["rpc.grpc.status_code"].int_value == 0
    assert (
        sum(a.value.int_value for b in spans["elmo.batch"] for a in b.attributes if a.key == "elmo.batch.tokens") >= 6
    )


@pytest.mark.slow  # a served model (its module fixture) and the receiver: `make test`, not `make check`
def test_an_http_request_is_traced_under_the_callers_traceparent(receiver, traced_server):
    servicer, _ = receiver
    _, _, url = traced_server
    header, trace_id, caller_span = traceparent()
    body = json.dumps({"inputs": [{"text": "the river bank flooded"}]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/embed", data=body, method="POST", headers={"Content-Type": "application/json", "traceparent": header}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200
    spans = arrived(servicer, trace_id, "POST /v1/embed")
    check_tree(spans, "POST /v1/embed", caller_span)
    (root,) = spans["POST /v1/embed"]
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["http.response.status_code"].int_value == 200


@pytest.mark.slow  # a served model (its module fixture) and the receiver: `make test`, not `make check`
def test_a_refused_call_is_traced_with_its_status(receiver, traced_server):
    """A request the checks refuse still leaves its span, marked with its status (no steps past admission)."""
    servicer, _ = receiver
    _, target, _ = traced_server
    header, trace_id, caller_span = traceparent()
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.EmbedderStub(channel).Embed(
            pb.EmbedRequest(inputs=[pb.Input(text="x")], layers=[99]), metadata=[("traceparent", header)], timeout=60
        )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: any(s.name == "elmo.admission" for s in servicer.of(trace_id)), 60, "the refused trace")
    wait_until(lambda: any(s.name == "elmo.v1.Embedder/Embed" for s in servicer.of(trace_id)), 60, "its span")
    (root,) = [s for s in servicer.of(trace_id) if s.name == "elmo.v1.Embedder/Embed"]
    assert root.parent_span_id.hex() == caller_span
    assert {a.key: a.value.int_value for a in root.attributes}["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT
    assert not any(s.name == "elmo.batch" for s in servicer.of(trace_id))


def test_serving_needs_no_opentelemetry_without_an_endpoint():
    """Without an endpoint nothing imports OpenTelemetry; the flag without it installed is one clear error."""
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if the `otel` extra were not installed\n"
        "import elmo.service.server\n"
        "from elmo.errors import ConfigError\n"
        "from elmo.service.telemetry import tracing\n"
        "assert not tracing.configure_tracing(tracing.TracingOptions(), environ={})\n"
        "assert tracing.grpc_interceptors() == [] and tracing.http_middlewares() == []\n"
        "assert not tracing.configure_tracing(tracing.TracingOptions(), {'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://x:1'})\n"
        "try:\n"
        "    tracing.configure_tracing(tracing.TracingOptions('http://127.0.0.1:4317'), environ={})\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--otlp-endpoint needs OpenTelemetry" in done.stdout and "otel" in done.stdout
    assert "no traces" in done.stderr  # the environment's endpoint without the extra: one warning
