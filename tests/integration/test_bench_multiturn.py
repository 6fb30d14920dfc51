"""`bench serve --workload multiturn` against a real router (router_fakes' workers): each turn
carries the whole history, the previous answer included, and the session id as `user`."""
from __future__ import annotations

import asyncio

from pdserve.bench.multiturn import MultiturnSpec, run_multiturn, session_id
from pdserve.bench.stream import Endpoint
from pdserve.bench.workload import parse_length

from router_fakes import MODEL, REPLY, TOKENIZER


def test_sessions_send_their_history_and_answers_back(make_cluster):
    cluster = make_cluster(decode_policy="session_affinity")
    workers = [cluster.add("d0"), cluster.add("d1")]
    spec = MultiturnSpec(2, 3, 0.01, parse_length("8"), parse_length("3"), parse_length("4"))
    model, turns = asyncio.run(run_multiturn(Endpoint(f"{cluster.http}/v1", model=MODEL), spec))
    assert model == MODEL and len(turns) == 6 and all(t.result.success for t in turns)
    assert {t.result.prompt_tokens is not None for t in turns} == {True}
    answer = len(TOKENIZER.encode("".join(REPLY)).ids)
    for turn in (t for t in turns if t.turn > 1):  # the previous prompt, its answer, and 3 new words
        earlier = next(t for t in turns if t.session == turn.session and t.turn == turn.turn - 1)
        assert turn.result.prompt_tokens >= earlier.result.prompt_tokens + answer + 3
        # the fakes' answer ids (100, 101, ...) are not what its text encodes to: the tokens this
        # prompt shares with the last are the last prompt's, as the router's /tokenize reads them
        assert turn.shared_tokens == earlier.result.prompt_tokens
    assert all(t.shared_tokens is None for t in turns if t.turn == 1)
    # one session's turns all went where its `user` hashes (session affinity): 3 at a time
    assert sorted(len(w.requests) for w in workers) in ([0, 6], [3, 3])
    assert session_id(spec, 0) != session_id(spec, 1)
