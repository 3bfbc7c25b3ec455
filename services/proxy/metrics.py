"""The proxy's `/metrics` (Prometheus text format): its own counters, the instances'
series stay on the instances' `/metrics`."""

from __future__ import annotations

from kvflow.services.proxy.decode_send import ProxyCounters


def render_metrics(counters: ProxyCounters) -> str:
    lines: list[str] = []

    def counter(name: str, help_text: str, values: dict[str, int], label: str = "") -> None:
        lines.append(f"# HELP kvflow:{name} {help_text}")
        lines.append(f"# TYPE kvflow:{name} counter")
        for key, value in values.items():
            labels = f'{{{label}="{key}"}}' if label else ""
            lines.append(f"kvflow:{name}{labels} {value}")

    counter("proxy_requests_total", "Requests the proxy received.", {"": counters.requests})
    counter(
        "proxy_prefill_failures_total",
        "Prefill sends that failed (the decode instance computed the prompt).",
        {"": counters.prefill_failures},
    )
    counter(
        "proxy_decode_resends_total",
        "Requests sent again after a decode instance failed them, by failure.",
        counters.resends,
        "reason",
    )
    counter(
        "proxy_prefill_fallbacks_total",
        "Requests sent whole to a prefill instance: every decode instance refused them.",
        {"": counters.prefill_fallbacks},
    )
    counter(
        "proxy_decode_gave_up_total",
        "Requests answered with the decode side's failure once resends ran out.",
        {"": counters.gave_up},
    )
    counter(
        "proxy_stream_resumes_total",
        "Streams resumed on a decode instance from their tokens so far: the one relaying "
        "them failed after the first chunk.",
        {"": counters.stream_resumes},
    )
    counter(
        "proxy_broken_streams_total",
        "Streams ended by an error event: the decode instance failed after the first chunk "
        "and the stream could not be resumed (resends spent, a beam search, no cluster secret).",
        {"": counters.broken_streams},
    )
    return "\n".join(lines) + "\n"
