"""bench.loadgen's answer check, medians and tables: what a run's rounds add up to, and the issue's before/after
check (throughput and p50 not worse, served / in-process at least 0.9 in every round)."""

from __future__ import annotations

import http.client
import json

import numpy as np
from elmo.bench.server_process import REQUEST_TIMEOUT_S, split_address


def check_answers(
    grpc_target: str | None,
    http_address: str | None,
    grpc_request: tuple[bytes, int, int],
    http_request: tuple[bytes, int, int],
    auth_token: str | None = None,
) -> dict:
    """One request per protocol, its answer decoded: the tokens the server embedded (every embedding's layers
    shaped [layers, tokens, dim] with its bytes all there) against the count the load's tallies use."""
    out: dict = {}
    if grpc_target is not None:
        import grpc

        from elmo.v1 import embedder_pb2 as pb

        data, _, expected = grpc_request
        metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        try:
            with grpc.insecure_channel(grpc_target, options=[("grpc.max_receive_message_length", -1)]) as channel:
                call = channel.unary_unary("/elmo.v1.Embedder/Embed", request_serializer=None)
                response = pb.EmbedResponse.FromString(call(data, timeout=REQUEST_TIMEOUT_S, metadata=metadata))
            found = sum(len(e.tokens) for e in response.embeddings)
            shapes_ok = all(e.layers.shape[1] == len(e.tokens) for e in response.embeddings)
            out["grpc"] = {"tokens": found, "expected": expected, "ok": found == expected and shapes_ok}
        except grpc.RpcError as exc:
            out["grpc"] = {"error": exc.code().name, "ok": False}
    if http_address is not None:
        body, _, expected = http_request
        headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        )
        conn = http.client.HTTPConnection(*split_address(http_address), timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/embed", body=body, headers=headers)
            response = conn.getresponse()
            status, data = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            status, data = f"conn:{type(exc).__name__}", b""
        finally:
            conn.close()
        if status != 200:
            out["http"] = {"error": str(status), "body": data[:300].decode(errors="replace"), "ok": False}
        else:
            import base64

            answer = json.loads(data)
            found = sum(len(e["tokens"]) for e in answer["embeddings"])
            shapes_ok = True
            for e in answer["embeddings"]:
                layers = e["layers"]
                size = int(np.prod(layers["shape"])) * np.dtype(layers["dtype"]).itemsize
                shapes_ok &= layers["shape"][1] == len(e["tokens"]) and len(base64.b64decode(layers["data"])) == size
            out["http"] = {"tokens": found, "expected": expected, "ok": found == expected and shapes_ok}
    return out


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds of one served series (``rounds[i]["served"]``), and its ratio to the in-process runtime
    when every round has one."""
    served = [r["served"] for r in rounds]
    out = {
        "served_tokens_per_s": _median(s["tokens_per_s"] for s in served),
        "served_requests_per_s": _median(s["requests_per_s"] for s in served),
        "served_latency_ms_p50": _median(s["latency_ms"].get("p50", 0) for s in served),
        "served_latency_ms_p99": _median(s["latency_ms"].get("p99", 0) for s in served),
        "served_tokens_per_server_cpu_s": _median(s["tokens_per_cpu_s"] or 0 for s in served),
        "errors": sum(sum(s["errors"].values()) for s in served),
        "server_rss_mib_first_start": served[0]["rss_mib"].get("start"),
        "server_rss_mib_last_end": served[-1]["rss_mib"].get("end"),
    }
    if all("in_process" in r for r in rounds):
        base = [r["in_process"] for r in rounds]
        out["in_process_tokens_per_s"] = _median(b["tokens_per_s"] for b in base)
        out["in_process_tokens_per_cpu_s"] = _median(b["tokens_per_cpu_s"] or 0 for b in base)
        out["served_over_in_process"] = _ratio(out["served_tokens_per_s"], out["in_process_tokens_per_s"])
        out["served_over_in_process_per_round"] = [
            _ratio(r["served"]["tokens_per_s"], r["in_process"]["tokens_per_s"]) for r in rounds
        ]
        out["served_over_in_process_min"] = min(out["served_over_in_process_per_round"], default=None)
        out["served_over_in_process_per_cpu_s"] = _ratio(
            out["served_tokens_per_server_cpu_s"], out["in_process_tokens_per_cpu_s"]
        )
    return out


def summarize_phases(rounds: list[dict], labels: list[str], protocols: list[str]) -> dict:
    """Per tree and protocol, :func:`summarize`'s medians; with a before tree, after / before per protocol (ratio of
    the medians, and per round), and the issue's check."""
    out: dict = {}
    for tree_label in labels:
        for protocol in protocols:
            series = [
                {k: v for k, v in r.items() if k == "in_process"} | {"served": r["phases"][tree_label][protocol]}
                for r in rounds
            ]
            out.setdefault(tree_label, {})[protocol] = summarize(series)
    out["errors"] = sum(out[t][p]["errors"] for t in labels for p in protocols)
    if rounds and all("in_process" in r for r in rounds):
        out["in_process_tokens_per_s"] = _median(r["in_process"]["tokens_per_s"] for r in rounds)
    if "before" in labels:
        out["after_over_before"] = {}
        out["issue_check"] = {}
        for protocol in protocols:
            before, after = out["before"][protocol], out["after"][protocol]
            per_round = [(r["phases"]["before"][protocol], r["phases"]["after"][protocol]) for r in rounds]
            ratios = {
                "tokens_per_s": _ratio(after["served_tokens_per_s"], before["served_tokens_per_s"]),
                "tokens_per_s_per_round": [_ratio(a["tokens_per_s"], b["tokens_per_s"]) for b, a in per_round],
                "latency_p50": _ratio(after["served_latency_ms_p50"], before["served_latency_ms_p50"]),
                "latency_p50_per_round": [
                    _ratio(a["latency_ms"].get("p50"), b["latency_ms"].get("p50")) for b, a in per_round
                ],
                "latency_p99": _ratio(after["served_latency_ms_p99"], before["served_latency_ms_p99"]),
            }
            out["after_over_before"][protocol] = ratios
            check = {
                "throughput_not_worse": ratios["tokens_per_s"] is not None and ratios["tokens_per_s"] >= 1.0,
                "p50_not_worse": ratios["latency_p50"] is not None and ratios["latency_p50"] <= 1.0,
            }
            if "served_over_in_process_min" in after:
                check["served_over_in_process_min"] = {
                    "before": before["served_over_in_process_min"],
                    "after": after["served_over_in_process_min"],
                }
                check["after_served_over_in_process_at_least_0.9_every_round"] = (
                    after["served_over_in_process_min"] is not None and after["served_over_in_process_min"] >= 0.9
                )
            out["issue_check"][protocol] = check
    return out


def print_table(rounds: list[dict], labels: list[str], protocols: list[str], summary: dict, file=None) -> None:
    """Per round and phase, and the medians, as a markdown table; then after / before per protocol."""
    print(
        "\n| round | tree | protocol | tokens/s | requests/s | p50 ms | p99 ms | served / in-process | errors |",
        file=file,
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|", file=file)
    for r in rounds:
        base = r.get("in_process")
        if base:
            print(f"| {r['round']} | | in-process | {base['tokens_per_s']:,.0f} | | | | | |", file=file)
        for protocol in protocols:
            for tree_label in labels:
                s = r["phases"][tree_label][protocol]
                ratio = _ratio(s["tokens_per_s"], base["tokens_per_s"]) if base else None
                print(
                    f"| {r['round']} | {tree_label} | {protocol} | {s['tokens_per_s']:,.0f} | "
                    f"{s['requests_per_s']:.1f} | "
                    f"{_fmt(s['latency_ms'].get('p50'))} | {_fmt(s['latency_ms'].get('p99'))} | {_fmt(ratio, 3)} | "
                    f"{sum(s['errors'].values())} |",
                    file=file,
                )
    for protocol in protocols:
        for tree_label in labels:
            m = summary[tree_label][protocol] if tree_label in summary else summary
            ratio = _fmt(m.get("served_over_in_process"), 3)
            if m.get("served_over_in_process_min") is not None:
                ratio += f" (min {_fmt(m['served_over_in_process_min'], 3)})"
            print(
                f"| median | {tree_label} | {protocol} | {m['served_tokens_per_s']:,.0f} | "
                f"{m['served_requests_per_s']:.1f} | {_fmt(m['served_latency_ms_p50'])} | "
                f"{_fmt(m['served_latency_ms_p99'])} | {ratio} | {m['errors']} |",
                file=file,
            )
    for protocol, ratios in summary.get("after_over_before", {}).items():
        print(
            f"{protocol}: after / before: tokens/s {_fmt(ratios['tokens_per_s'], 3)} (rounds "
            f"{', '.join(_fmt(v, 3) for v in ratios['tokens_per_s_per_round'])}), p50 {_fmt(ratios['latency_p50'], 3)} "
            f"(rounds {', '.join(_fmt(v, 3) for v in ratios['latency_p50_per_round'])}), "
            f"p99 {_fmt(ratios['latency_p99'], 3)}",
            file=file,
        )
    for protocol, check in summary.get("issue_check", {}).items():
        line = f"{protocol}: throughput not worse: {_yes(check['throughput_not_worse'])}; "
        line += f"p50 not worse: {_yes(check['p50_not_worse'])}"
        if "served_over_in_process_min" in check:
            key = "after_served_over_in_process_at_least_0.9_every_round"
            line += f"; after served / in-process >= 0.9 in every round: {_yes(check[key])} "
            line += f"(lowest {_fmt(check['served_over_in_process_min']['after'], 3)})"
        print(line, file=file)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _median(values) -> float:
    return round(float(np.median(list(values))), 2)
