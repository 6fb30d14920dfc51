"""The OpenAI API surface through a disaggregated `pdserve up` (one prefill, one decode, the
default local-prefill threshold): sampling identical on both paths, and the API's options."""
from __future__ import annotations

import pytest
from harness import MODEL, deploy

pytestmark = pytest.mark.slow

STORY = ("Write a short story about a fox who learns to read, set in a small village at the edge "
         "of a great forest, told from the point of view of the village librarian.")


@pytest.fixture(scope="module")
def cluster():
    d = deploy()
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def _complete(client, prompt: str, seed: int):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                    temperature=1.0, seed=seed, extra_body={"min_tokens": 3})
    return out.choices[0].text, out.model_extra["pdserve"]["transfer"]["outcome"]


def test_seeded_sampling_gives_the_same_text_disaggregated_and_local(cluster):
    """The first time a prompt is prefilled remotely; the second time decode has its blocks
    cached, so only a short uncached tail is left and it prefills locally."""
    client = cluster.openai()
    for seed in (1, 7, 42, 1234):
        prompt = f"Draft {seed}. {STORY}"
        remote_text, remote_path = _complete(client, prompt, seed)
        local_text, local_path = _complete(client, prompt, seed)
        assert (remote_path, local_path) == ("transferred", "local")
        assert remote_text == local_text, seed
    cluster.assert_no_leaks()
