"""The gRPC door bounded per connection, against a real `elmo serve` process (issue 39).

The attack: calls whose request never arrives. A unary call whose message never completes is never answered (gRPC
starts a unary handler only once the message is whole), an EmbedStream that never sends waits for ever; each holds
one of --max-concurrent-rpcs. 1,030 of them on one connection used to make every RPC, gRPC health included, answer
RESOURCE_EXHAUSTED. Now one connection holds at most --max-streams-per-connection of them, a caller without the
token is refused at its headers, before its message is read, a message that does not arrive within
--grpc-message-timeout-s ends its call, one client address holds at most --max-calls-per-peer calls, and health
checks are not counted at all.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio
import pytest
from elmo.service.common.shares import Shares, peer_address
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elmo.v1 import embedder_pb2 as pb
from tests.serve_process import ServeProcess, wait_until

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
        # connected first: the server's SETTINGS (its stream limit) are known before the attack opens its calls,
        # else the first calls race them and some are refused as streams (UNAVAILABLE) before any handler
        await attacker.channel_ready()
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
        answer = await embed(pb.EmbedRequest(inputs=[pb.Input(text="a b")]), metadata=metadata, timeout=30)
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
def test_calls_that_never_send_leave_health_serving_and_others_answered(
    tiny_model_dir: Path, tmp_path: Path, token: str | None
) -> None:
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


def _unary(channel: grpc.aio.Channel, half_sent: bool = False):
    kind = channel.stream_unary if half_sent else channel.unary_unary
    return kind("/elmo.v1.Embedder/Embed", pb.EmbedRequest.SerializeToString, pb.EmbedResponse.FromString)


async def _health(channel: grpc.aio.Channel) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)).status


async def _error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(call, 30)
    return error.value


async def _fill_then_probe(target: str, held: int) -> dict:
    """``held`` half-sent Embeds on one connection, then one more call and a health check on another."""
    attacker = grpc.aio.insecure_channel(target, options=OWN_CONNECTION)
    probe = grpc.aio.insecure_channel(target, options=OWN_CONNECTION)
    try:
        await attacker.channel_ready()
        calls = [_unary(attacker, half_sent=True)(_never_sends()) for _ in range(held)]
        await asyncio.sleep(1.0)
        refused = await _error(_unary(probe)(pb.EmbedRequest(inputs=[pb.Input(text="a b")]), timeout=20))
        health = await _health(probe)
        first_done = [call.done() for call in calls]
        for call in calls:
            call.cancel()
        return {"refused": refused, "health": health, "held_open": first_done.count(False)}
    finally:
        await attacker.close(grace=None)
        await probe.close(grace=None)


def test_a_full_server_still_answers_health_and_refuses_calls_by_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--max-concurrent-rpcs", "8", "--max-calls-per-peer", "8"]
    with ServeProcess(args, tmp_path) as server:
        seen = asyncio.run(_fill_then_probe(server.wait_serving(), held=8))
    assert seen["held_open"] == 8
    assert seen["refused"].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "8 calls open at once (--max-concurrent-rpcs)" in seen["refused"].details()
    assert seen["health"] == health_pb2.HealthCheckResponse.SERVING


def test_one_client_address_holds_at_most_its_share(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--max-concurrent-rpcs", "64", "--max-calls-per-peer", "3"]
    with ServeProcess(args, tmp_path) as server:
        seen = asyncio.run(_fill_then_probe(server.wait_serving(), held=3))
    assert seen["refused"].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this client (127.0.0.1) has 3 calls open at once, its share (--max-calls-per-peer)" in (
        seen["refused"].details()
    )
    assert seen["health"] == health_pb2.HealthCheckResponse.SERVING


async def _late_message_and_silent_stream(target: str) -> dict:
    channel = grpc.aio.insecure_channel(target, options=OWN_CONNECTION)
    try:
        late = await _error(_unary(channel, half_sent=True)(_never_sends()))

        async def one_then_silence():
            yield pb.EmbedRequest(inputs=[pb.Input(text="a b c")])
            await asyncio.Event().wait()

        stream = channel.stream_stream(
            "/elmo.v1.Embedder/EmbedStream", pb.EmbedRequest.SerializeToString, pb.EmbedResponse.FromString
        )(one_then_silence())
        answers = []
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for answer in stream:
                answers.append(len(answer.embeddings))
        return {"late": late, "answers": answers, "ended": ended.value}
    finally:
        await channel.close(grace=None)


def test_a_message_that_never_completes_and_a_silent_stream_are_closed(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--grpc-message-timeout-s", "1", "--grpc-idle-timeout-s", "2"]
    with ServeProcess(args, tmp_path) as server:
        seen = asyncio.run(_late_message_and_silent_stream(server.wait_serving()))
        assert not server.exited()
    assert seen["late"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not arrive within 1 s of the call's headers (--grpc-message-timeout-s)" in seen["late"].details()
    assert len(seen["answers"]) == 1 and seen["answers"][0] > 0  # what it sent was answered first
    assert seen["ended"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no request message for 2 s (--grpc-idle-timeout-s)" in seen["ended"].details()


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:10.0.0.7:5312", "10.0.0.7"),
        ("ipv6:[::1]:5312", "::1"),
        ("ipv6:[fe80::1%eth0]:80", "fe80::1%eth0"),
        ("10.0.0.7:80", "10.0.0.7"),
        ("unix:/run/elmo.sock", "unix:/run/elmo.sock"),
    ],
)
def test_a_peer_is_its_address_without_the_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address


def test_shares_bound_each_peer_and_the_whole() -> None:
    calls = Shares(total=3, per_peer=2, what="calls", flags=("--total", "--per-peer"))
    calls.take("a")
    calls.take("a")
    assert "its share (--per-peer)" in (calls.refusal("a") or "")
    calls.take("b")  # another peer still has room
    assert "(--total)" in (calls.refusal("c") or "")
    calls.give_back("a")
    assert calls.refusal("c") is None and calls.held_by("a") == 1 and calls.count == 2


def test_a_client_gone_before_its_answer_is_one_info_line_not_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Calls whose client closes its connection before taking the answer (a zero window, then gone): one INFO line
    each naming the method, no ERROR, no traceback, no server fault counted (grpc.aio logs an ERROR by itself)."""
    from tests.h2_peer import EMBED, HEALTH_CHECK, H2Peer, health_request

    embed = pb.EmbedRequest(inputs=[pb.Input(text="nobody reads this answer")] * 4).SerializeToString()
    with ServeProcess(["--model", str(tiny_model_dir)], tmp_path) as server:
        host, port = server.wait_serving().rsplit(":", 1)
        for method, request in ((HEALTH_CHECK, health_request()), (EMBED, embed)):
            with H2Peer(host, int(port), initial_window=0) as peer:
                stream = peer.send_call(method, request)
                peer.read_events(0.5)  # the answer is computed and waits for a window that never opens
                assert not peer.streams[stream].ended
        wait_until(lambda: server.stderr().count("client disconnect") >= 2, 10, "both disconnects logged")
        server.sigterm()
        assert server.wait(30) == 0
        log = server.stderr()
    assert f"INFO grpc._cython.cygrpc: client disconnect: the answer to {HEALTH_CHECK} was not delivered" in log
    assert f"client disconnect: the answer to {EMBED} was not delivered" in log
    assert " ERROR " not in log and "Traceback" not in log and " WARNING " not in log, log
