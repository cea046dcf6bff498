"""The gRPC door bounded per connection, against a real `elmo serve` process (issue 39).

The attack: calls whose request never arrives. A unary call whose message never completes is never answered (gRPC
starts a unary handler only once the message is whole), an EmbedStream that never sends waits for ever; each holds
one of --max-concurrent-rpcs. 1,030 of them on one connection used to make every RPC, gRPC health included, answer
RESOURCE_EXHAUSTED. Now one connection holds at most --max-streams-per-connection of them, and a caller without the
token is refused at its headers, before its message is read.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elmo.v1 import embedder_pb2 as pb
from tests.serve_process import ServeProcess

TOKEN = "door-token"
HALF_SENT = 1030  # more than --max-concurrent-rpcs (1,024)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # a channel of its own: a connection of its own


async def _never_sends():
    await asyncio.Event().wait()  # the request message never comes, the stream is never half-closed
    yield pb.EmbedRequest()  # pragma: no cover


async def _attack_and_probe(target: str, token: str | None) -> dict:
    """HALF_SENT unary Embeds that never send their message and as many EmbedStreams that never send, all on one
    connection without a token; meanwhile a well-behaved client on its own connection checks health and embeds."""
    attacker = grpc.aio.insecure_channel(target, options=OWN_CONNECTION)
    polite = grpc.aio.insecure_channel(target, options=OWN_CONNECTION)
    try:
        half_sent = attacker.stream_unary(
            "/elmo.v1.Embedder/Embed", pb.EmbedRequest.SerializeToString, pb.EmbedResponse.FromString
        )
        idle_stream = attacker.stream_stream(
            "/elmo.v1.Embedder/EmbedStream", pb.EmbedRequest.SerializeToString, pb.EmbedResponse.FromString
        )
        calls = [half_sent(_never_sends()) for _ in range(HALF_SENT)]
        streams = [idle_stream(_never_sends()) for _ in range(1024)]
        await asyncio.sleep(1.0)  # the attack's calls reach the server (as many as it lets one connection open)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        health = await health_pb2_grpc.HealthStub(polite).Check(health_pb2.HealthCheckRequest(), timeout=20)
        embed = polite.unary_unary(
            "/elmo.v1.Embedder/Embed", pb.EmbedRequest.SerializeToString, pb.EmbedResponse.FromString
        )
        answer = await embed(pb.EmbedRequest(inputs=[pb.Input(text="a b")]), metadata=metadata,
                             timeout=30)  # fmt: skip
        refused = []
        if token:  # no token: refused at the headers, before the message that never comes
            for call in calls[:50]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await asyncio.wait_for(call, 20)
                refused.append(error.value.code())
        for call in [*calls, *streams]:
            call.cancel()
        return {"health": health.status, "embedded": len(answer.embeddings), "refused": refused}
    finally:
        await attacker.close(grace=None)
        await polite.close(grace=None)


@pytest.mark.parametrize("token", [None, TOKEN], ids=["open", "with-auth-token"])
def test_calls_that_never_send_leave_health_serving_and_others_answered(tiny_model_dir: Path, tmp_path: Path,
                                                                        token: str | None) -> None:  # fmt: skip
    args = ["--model", str(tiny_model_dir), *(["--auth-token", token] if token else [])]
    with ServeProcess(args, tmp_path) as server:
        target = server.wait_serving()
        seen = asyncio.run(_attack_and_probe(target, token))
        assert seen["health"] == health_pb2.HealthCheckResponse.SERVING
        assert seen["embedded"] == 1
        if token:
            assert seen["refused"] == [grpc.StatusCode.UNAUTHENTICATED] * 50
        assert not server.exited()
        server.sigterm()
        assert server.wait(30) == 0
