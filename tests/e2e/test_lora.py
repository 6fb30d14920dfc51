"""LoRA adapters through real processes: a router (--enable-lora, an admin key), one prefill
and two decode services, each allowed the adapters under one root and loading a listed one
on first use. A request whose model names an adapter gets the greedy text of transformers +
peft with that adapter, disaggregated and local, streamed and not, over HTTP and gRPC; base
requests in the same batch keep the base model's text; the hand-off names the adapter and
its digest, and a prefill whose adapter of that name differs is refused (the decode
recomputes under its own). Unknown adapters are 404 in OpenAI's shape, malformed ones 400
naming the problem; the admin endpoints need the admin key; the router sends an adapter's
requests to the decode that holds it.

The served adapters are made by `peft` itself on the default model as transformers loads it
(`init_lora_weights=False`: random non-zero A and B) and saved with `save_pretrained`; the
reference text is that peft model's own `generate`, the adapter unmerged. Malformed adapters
are written by hand (`tests/lora_adapters.py`), which is what a bad file needs."""
from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from harness import MODEL, deploy_workers
from lora_adapters import write_adapter

pytestmark = pytest.mark.slow

CLIENT_KEY = "sk-client-lora"
ADMIN_KEY = "sk-admin-lora"
# over the router's local-prefill threshold (32 uncached tokens): a prefill service computes it
LONG = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
        "combined movable metal type, oil-based ink and a screw press into one workshop process. Then")
SHORT = "The three primary colors are"  # under it: the decode prefills it itself
MAX_TOKENS = 12


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, target modules); each a LoRA of its own in one peft model
ADAPTERS = {"a1": (1, 4, ALL_TARGETS), "a2": (2, 8, ["q_proj", "v_proj", "down_proj"]), "a3": (3, 4, ALL_TARGETS),
            "skew-decode": (4, 4, ALL_TARGETS), "skew-prefill": (5, 4, ALL_TARGETS)}


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory):
    """The default model in transformers (fp32) with every adapter of ADAPTERS made by peft,
    each saved under root/<name> by `save_pretrained`; returns (root, model dir, peft model)."""
    import peft
    import transformers
    from pdserve.engine.loader import load_model

    root = tmp_path_factory.mktemp("adapters")
    model_dir = Path(load_model("default").model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None  # the reference cuts at EOS itself, as the service does
    model = None
    for name, (seed, rank, targets) in ADAPTERS.items():
        config = peft.LoraConfig(r=rank, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 init_lora_weights=False)  # nn.Linear's random init for A and B: non-zero
        torch.manual_seed(seed)
        if model is None:
            model = peft.get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        model.save_pretrained(root, selected_adapters=[name], safe_serialization=True)  # root/<name>
        assert (root / name / "adapter_model.safetensors").is_file()
    model.eval()
    return root, model_dir, model


@pytest.fixture(scope="module")
def lora(peft_model):
    root, model_dir, _ = peft_model
    admin_file = root.parent / "admin-key"
    admin_file.write_text(ADMIN_KEY)
    admin_file.chmod(0o600)
    common = ["--enable-lora", "--lora-allowed-root", str(root), "--lora-modules", f"a1={root / 'a1'}",
              f"a3={root / 'a3'}", json.dumps({"name": "a1-alias", "path": str(root / "a1"),
                                               "base_model_name": "SmolLM2-base"})]
    os.environ["PDSERVE_API_KEY"] = CLIENT_KEY  # the router's, inherited
    try:
        d = deploy_workers(
            [("prefill-0", "prefill", ["--lora-modules", f"skew={root / 'skew-prefill'}"]),
             ("decode-0", "decode", ["--lora-modules", f"skew={root / 'skew-decode'}"]),
             ("decode-1", "decode", ["--lora-modules", f"skew={root / 'skew-decode'}"])],
            router_args=["--enable-lora", "--admin-api-key-file", str(admin_file), "--static-routing"],
            common=common)
    finally:
        del os.environ["PDSERVE_API_KEY"]
    d.root, d.model_dir = root, model_dir
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


@pytest.fixture(scope="module")
def reference(peft_model):
    """greedy(adapter name or None, prompt) -> the peft model's greedy text under that adapter
    (None: its adapters disabled, the base model), cut at EOS; each computed once."""
    from pdserve.engine.loader import load_model

    _, _, model = peft_model
    tok = load_model("default").tokenizer
    eos = set(tok.convert_tokens_to_ids([tok.eos_token])) | {tok.eos_token_id}
    cache: dict = {}

    def run(ids: list[int], max_tokens: int):
        return model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False)

    def greedy(adapter: str | None, prompt: str, max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> str:
        key = (adapter, prompt, max_tokens, ignore_eos)
        if key not in cache:
            ids = tok(prompt).input_ids
            with torch.no_grad():
                if adapter is None:
                    with model.disable_adapter():
                        out = run(ids, max_tokens)
                else:
                    model.set_adapter(adapter)
                    out = run(ids, max_tokens)
            new = out[0, len(ids):].tolist()
            if not ignore_eos:
                new = new[:next((i for i, t in enumerate(new) if t in eos), len(new))]
            cache[key] = tok.decode(new, skip_special_tokens=True)
        return cache[key]

    return greedy


def _client(d, key: str = ADMIN_KEY):
    from openai import OpenAI

    return OpenAI(base_url=d.base_url, api_key=key, timeout=180, max_retries=0)


def _complete(d, model: str, prompt: str, stream: bool = False, **kw):
    client = _client(d)
    if not stream:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kw)
        return out.choices[0].text, out.model_extra["pdserve"]
    text, extra = "", {}
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text or ""
        extra.update((chunk.model_extra or {}).get("pdserve") or {})
    return text, extra


def _admin(d, path: str, body: dict, key: str = ADMIN_KEY) -> httpx.Response:
    return httpx.post(d.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=180)


def test_adapter_text_equals_peft_on_every_path_and_base_stays_base(lora, reference):
    # each long prompt opens differently: no cached prefix makes the router prefill it locally
    cases = [("a1", f"Story 1. {LONG}", False), ("a1", f"Story 2. {LONG}", True), ("a1", SHORT, False),
             ("a1", SHORT, True), (MODEL, f"Story 3. {LONG}", False), (MODEL, SHORT, True),
             ("a1-alias", f"Story 4. {LONG}", False)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # adapters and base in one batch
        answers = list(pool.map(lambda case: _complete(lora, *case), cases))
    for (model, prompt, stream), (text, extra) in zip(cases, answers):
        adapter = None if model == MODEL else "a1"
        assert text == reference(adapter, prompt), (model, prompt, stream)
        local = prompt is SHORT
        assert extra["transfer"]["outcome"] == ("local" if local else "transferred"), (model, prompt, extra)
    assert reference("a1", LONG) != reference(None, LONG)  # the adapter changes the text
    lora.assert_no_leaks()


def test_n_choices_and_grpc_generate_run_under_the_adapter(lora, reference):
    from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    out = _client(lora).completions.create(model="a1", prompt=LONG, max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.text for c in out.choices] == [reference("a1", LONG)] * 2
    guided = _client(lora).completions.create(model="a1", prompt=f"Story 5. {LONG}", max_tokens=4, temperature=0,
                                              extra_body={"guided_choice": ["printing", "press"]})
    assert guided.choices[0].text in ("printing", "press")
    assert guided.model_extra["pdserve"]["transfer"]["outcome"] == "transferred"  # the grammar on both legs
    with grpc.insecure_channel(f"127.0.0.1:{lora.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(model="a1", prompt=SHORT,
                                                 sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        text = "".join(r.text for r in stub.Generate(request, timeout=180,
                                                     metadata=[("authorization", f"Bearer {CLIENT_KEY}")]))
    assert text == reference("a1", SHORT)
    lora.assert_no_leaks()


def test_a_prefill_whose_adapter_differs_is_refused_and_decode_recomputes(lora, reference):
    text, extra = _complete(lora, "skew", LONG)
    assert extra["transfer"]["outcome"] == "recomputed", extra
    assert "digest" in extra["transfer"]["reason"] or "FAILED_PRECONDITION" in extra["transfer"]["reason"], extra
    assert text == reference("skew-decode", LONG)  # the decode's adapter, never the prefill's
    lora.assert_no_leaks()


def test_models_lists_adapters_with_their_parent_and_unknown_ones_are_404(lora):
    listed = {m.id: m.model_extra for m in _client(lora, CLIENT_KEY).models.list().data}
    assert listed[MODEL]["parent"] is None
    assert listed["a1"]["parent"] == MODEL and listed["a3"]["parent"] == MODEL
    assert listed["a1-alias"]["parent"] == "SmolLM2-base"
    response = httpx.post(lora.base_url + "/completions", json={"model": "no-such-adapter", "prompt": "hi"},
                          headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found" and "no-such-adapter" in response.json()["error"]["message"]
    tokens = {model: httpx.post(lora.base_url.replace("/v1", "/tokenize"), json={"model": model, "prompt": SHORT},
                                headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60).json()["tokens"]
              for model in (MODEL, "a1")}
    assert tokens["a1"] == tokens[MODEL]  # an adapter tokenizes as its base model


def test_load_and_unload_need_the_admin_key_and_reach_every_worker(lora, reference):
    body = {"lora_name": "a2", "lora_path": str(lora.root / "a2")}
    assert _admin(lora, "/load_lora_adapter", body, key=CLIENT_KEY).status_code == 401
    assert _admin(lora, "/unload_lora_adapter", {"lora_name": "a1"}, key=CLIENT_KEY).status_code == 401
    loaded = _admin(lora, "/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["workers"] == 3
    assert _complete(lora, "a2", LONG)[0] == reference("a2", LONG)
    assert _complete(lora, "a2", SHORT, stream=True)[0] == reference("a2", SHORT)
    # in use: refused (the engine's rule) where a request runs under it, which keeps its adapter
    stream = _client(lora).completions.create(model="a2", prompt=LONG, max_tokens=48, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    text = ""
    for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        if text:
            break
    refused = _admin(lora, "/unload_lora_adapter", {"lora_name": "a2"})
    assert refused.status_code == 400 and "in use" in refused.json()["error"]["message"], refused.text
    text += "".join(chunk.choices[0].text or "" for chunk in stream if chunk.choices)
    assert text == reference("a2", LONG, 48, ignore_eos=True)
    unloaded = _admin(lora, "/unload_lora_adapter", {"lora_name": "a2"})  # the decode that refused, now idle
    assert unloaded.status_code == 200, unloaded.text
    assert _admin(lora, "/unload_lora_adapter", {"lora_name": "a2"}).status_code == 404
    gone = httpx.post(lora.base_url + "/completions", json={"model": "a2", "prompt": "hi"},
                      headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=60)
    assert gone.status_code == 404
    lora.assert_no_leaks()


def _malformed(root: Path, model_dir: Path, outside: Path) -> dict[str, Path]:
    empty = root / "bad-empty"
    empty.mkdir(exist_ok=True)
    rank = write_adapter(root / "bad-rank", model_dir, rank=32, seed=6)  # over --max-lora-rank 16
    module = write_adapter(root / "bad-module", model_dir, rank=4, seed=7, targets=("q_proj",))
    config = json.loads((module / "adapter_config.json").read_text())
    (module / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_gate"]}))
    shapes = write_adapter(root / "bad-shapes", model_dir, rank=4, seed=8, targets=("q_proj",))
    config = json.loads((shapes / "adapter_config.json").read_text())
    (shapes / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))  # the tensors are rank 4
    pickled = root / "bad-pickle"
    pickled.mkdir(exist_ok=True)
    (pickled / "adapter_config.json").write_text(json.dumps(config))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    outside_adapter = write_adapter(outside / "elsewhere", model_dir, rank=4, seed=9)
    return {"missing files": empty, "rank": rank, "target modules": module, "shapes": shapes,
            "pickle": pickled, "outside the allowed root": outside_adapter}


def test_each_malformed_adapter_is_a_400_naming_the_problem(lora, tmp_path):
    cases = _malformed(lora.root, lora.model_dir, tmp_path)
    for problem, path in cases.items():
        response = _admin(lora, "/load_lora_adapter", {"lora_name": f"bad-{len(problem)}", "lora_path": str(path)})
        assert response.status_code == 400, (problem, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error", (problem, response.text)
    missing = _admin(lora, "/load_lora_adapter", {"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    listed = {m.id for m in _client(lora, CLIENT_KEY).models.list().data}
    assert not any(name.startswith("bad-") for name in listed)
    assert _complete(lora, MODEL, SHORT)[0]  # the service stays healthy


def test_requests_for_an_adapter_go_to_the_decode_that_holds_it(lora):
    health = lambda: httpx.get(lora.base_url.replace("/v1", "/health"),  # noqa: E731
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()
    holders = lambda: {w for w, held in health().get("lora_adapters", {}).items()  # noqa: E731
                       if held.get("a3") == "loaded" and w.startswith("decode")}
    assert not holders()
    first = _complete(lora, "a3", "Tell me about whales. " * 3)[1]["routing"]["decode_worker_id"]
    lora.wait_until(lambda: holders() == {first}, f"{first} reported holding a3", timeout_s=30)
    for i in range(3):  # different prompts: no prefix to follow, only the adapter
        routing = _complete(lora, "a3", f"Question {i}: why is the sky {'blue' * (i + 1)}?")[1]["routing"]
        assert routing["decode_worker_id"] == first, routing
    metrics = httpx.get(lora.base_url.replace("/v1", "/metrics"), headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                        timeout=10).text
    sample = 'pdserve_router_routing_decisions_total{policy="lora",pool="decode",reason="lora_holder"} '
    assert float(next(line for line in metrics.splitlines() if line.startswith(sample)).split()[-1]) >= 3
    lora.assert_no_leaks()
