"""Oversized prompts against a live router: refused, and the workers kept.
Real router listeners on 127.0.0.1, in-test workers (`router_fakes`)."""
from __future__ import annotations

from router_fakes import MODEL


def test_bench_abuse_reports_oversized_prompts_refused_and_workers_kept(make_cluster, capsys):
    """`pdserve bench abuse` on a small scale: every big prompt is refused (413 over HTTP,
    RESOURCE_EXHAUSTED over gRPC), small chats keep answering, no worker is lost."""
    from pdserve.bench import abuse

    cluster = make_cluster()
    cluster.add("d0")
    assert abuse.main(["--url", cluster.http, "--grpc", cluster.grpc_address, "--model", MODEL, "--clients", "2",
                       "--big-mb", "0.05", "--grpc-mb", "0.1", "--chats", "5", "--settle-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "p99 ratio" in out and "inf" not in out.split("p99 ratio")[1].split()[0], out
    statuses = dict(part.rsplit(": ", 1) for part in out.split("gRPC: ")[1].splitlines()[0].split(", "))
    assert set(statuses) == {"http 413", "grpc RESOURCE_EXHAUSTED"}, out
    assert "before 1/0, during 1/0, after 1/0" in out, out
