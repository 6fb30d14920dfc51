"""The OpenAI API surface through a disaggregated `pdserve up` (one prefill, one decode, the
default local-prefill threshold): sampling identical on both paths, and the API's options."""
from __future__ import annotations

import pytest
from harness import MODEL, deploy

pytestmark = pytest.mark.slow

LIGHTHOUSE = ("A short story about a lighthouse keeper who finds a message in a bottle. "
              "It begins on a stormy night, when")
STORY = ("Write a short story about a fox who learns to read, set in a small village at the edge "
         "of a great forest, told from the point of view of the village librarian.")


@pytest.fixture(scope="module")
def cluster():
    d = deploy()
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def _decode(cluster, prompt_ids: list[int], seed: int, remote: bool) -> tuple[str, int]:
    """One Decode call straight to the decode worker, told to prefill remotely or locally (the
    router's choice, made here so the test does not depend on its cache view)."""
    import grpc

    from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    (address,) = cluster.worker_addresses("decode").values()
    (prefill_address,) = cluster.worker_addresses("prefill").values()
    choice = decode_pb2.PrefillChoice(worker_id="prefill-0", address=prefill_address) if remote else \
        decode_pb2.PrefillChoice(reason="test_local")
    sampling = common_pb2.SamplingParams(max_tokens=20, min_tokens=3, temperature=1.0, top_p=1.0, top_k=0,
                                         seed=seed, repetition_penalty=1.0)
    request = decode_pb2.DecodeRequest(request_id=f"seed-{seed}-{remote}", prompt_token_ids=prompt_ids,
                                       sampling=sampling, prefill=choice)
    text, outcome = [], None
    with grpc.insecure_channel(address) as channel:
        metadata = cluster.credentials("/pdserve.v1.Decode/Decode")
        for message in decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=120, metadata=metadata):
            text.append(message.text)
            if message.HasField("transfer"):
                outcome = message.transfer.outcome
    return "".join(text), outcome


def test_seeded_sampling_gives_the_same_text_disaggregated_and_local(cluster, hf_reference):
    """Each seed through the prefill service and then prefilled on decode itself (the second
    run reuses decode's cached prompt blocks but samples every token there)."""
    from pdserve.proto.pdserve.v1 import common_pb2

    tok, _ = hf_reference
    for seed in (1, 7, 42, 1234):
        prompt_ids = tok.encode(f"Draft {seed}. {STORY}", add_special_tokens=False)
        remote_text, remote_path = _decode(cluster, prompt_ids, seed, remote=True)
        local_text, local_path = _decode(cluster, prompt_ids, seed, remote=False)
        assert (remote_path, local_path) == (common_pb2.TRANSFER_OUTCOME_TRANSFERRED,
                                             common_pb2.TRANSFER_OUTCOME_LOCAL)
        assert remote_text == local_text, seed
    cluster.assert_no_leaks()


def test_logit_bias_and_penalties_reach_the_prefill_and_decode(cluster, hf_reference):
    tok, _ = hf_reference
    client = cluster.openai()
    banana = tok.encode(" banana", add_special_tokens=False)
    assert len(banana) == 1
    out = client.completions.create(model=MODEL, prompt=f"Draft 0. {STORY}", max_tokens=6, temperature=0,
                                    logit_bias={str(banana[0]): 100})
    assert out.choices[0].text == " banana" * 6  # the prefill's first token is biased too
    assert out.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"
    plain = client.completions.create(model=MODEL, prompt=LIGHTHOUSE, max_tokens=24, temperature=0)
    penalised = client.completions.create(model=MODEL, prompt=LIGHTHOUSE, max_tokens=24, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5})
    assert plain.choices[0].text and penalised.choices[0].text != plain.choices[0].text
    cluster.assert_no_leaks()
