"""LoRA adapters through the engine on a tiny random-weight Llama, against transformers.

Adapters are written in PEFT's format with random non-zero A and B (`lora_adapters`); the
reference is transformers' model with W + scaling * B @ A merged in (what PEFT computes),
and, where `peft` is installed, PEFT's own model. Greedy ids must match; a batch mixing the
base model and two adapters gives each its own reference; the prefix cache never crosses
adapters; adapters beyond max_loras swap in LRU, never mid-request. Every test ends with
every KV block back in its pool and no adapter or slot held.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_adapters import greedy, merged_reference, write_adapter
from pdserve.common.errors import (AlreadyExistsError, LoraAdapterError, LoraInUseError, LoraNotFoundError,
                                   to_service_error)
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 33)]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """Tiny matmuls run fastest on one thread."""


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_adapter(root / "all", model_dir, seed=1),
        "qv": write_adapter(root / "qv", model_dir, targets=("q_proj", "v_proj"), rank=8, alpha=4, seed=2),
        "mlp": write_adapter(root / "mlp", model_dir, targets=("gate_proj", "up_proj", "down_proj"), rank=2,
                             seed=3, use_rslora=True),
        "o": write_adapter(root / "o", model_dir, targets=("o_proj", "k_proj"), rank=4, seed=4),
    }


@pytest.fixture(scope="module")
def refs(model_dir, adapters):
    """Greedy continuations by (adapter or None, prompt), memoised."""
    models = {None: merged_reference(model_dir, None)}
    models.update({name: merged_reference(model_dir, path) for name, path in adapters.items()})
    memo: dict = {}

    def ref(name, prompt, n=NEW):
        key = (name, tuple(prompt), n)
        if key not in memo:
            memo[key] = greedy(models[name], prompt, n)
        return memo[key]
    return ref


def make_llm(model_dir, adapters, names=(), **overrides) -> LLM:
    overrides.setdefault("num_blocks", 64)
    llm = LLM(str(model_dir), enable_lora=True, **overrides)
    for name in names:
        llm.load_lora(name, str(adapters[name]))
    return llm


def ids(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


def test_each_adapter_alone_equals_merged_transformers(model_dir, adapters, refs):
    llm = make_llm(model_dir, adapters, adapters, max_loras=4)
    for name in adapters:
        assert ids(llm.generate(PROMPTS, GREEDY, lora_name=name)) == [refs(name, p) for p in PROMPTS], name
    assert ids(llm.generate(PROMPTS, GREEDY)) == [refs(None, p) for p in PROMPTS]
    llm.engine.assert_no_leaks()


@pytest.mark.parametrize("budget", [40, 256], ids=["decode_sized", "prefill_sized"])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_batch_mixing_base_and_two_adapters(model_dir, adapters, refs, budget, path, monkeypatch):
    """One step runs rows of the base model and of two adapters, prefill and decode alike,
    on each CPU path: the native op for every step, and the torch fallback (PDSERVE_CPU_ATTENTION
    =torch), whose steps of more than DENSE_MAX_ROWS rows (the whole batch's prompts at once
    under the 256 budget) take the grouped GEMMs, smaller ones the dense ops."""
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", path)
    llm = make_llm(model_dir, adapters, ("all", "qv"), max_loras=2, max_num_tokens=budget)
    assert llm.engine.loras.slots.path == path
    names = [None, "all", "qv", "qv", None, "all"]
    prompts = PROMPTS * 2
    outs = llm.generate(prompts, GREEDY, lora_name=names)
    assert ids(outs) == [refs(n, p) for n, p in zip(names, prompts)]
    llm.engine.assert_no_leaks()


def test_peft_model_reference(model_dir, tmp_path):
    """PEFT's own model (when installed) gives the same text as pdserve with its adapter."""
    peft = pytest.importorskip("peft")
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"],
                             init_lora_weights=False)  # random A and B: a non-zero update
    model = peft.get_peft_model(base, config)
    model.save_pretrained(tmp_path / "peft", safe_serialization=True)
    model.eval()
    model.generation_config.eos_token_id = None
    llm = LLM(str(model_dir), enable_lora=True, num_blocks=64)
    llm.load_lora("p", str(tmp_path / "peft"))
    assert ids(llm.generate(PROMPTS, GREEDY, lora_name="p")) == [greedy(model, p, NEW) for p in PROMPTS]
    llm.engine.assert_no_leaks()


def test_prefix_cache_never_crosses_adapters(model_dir, adapters, refs):
    llm = make_llm(model_dir, adapters, ("all", "qv"), max_loras=2)
    prompt = PROMPTS[2]  # two full blocks
    for name in (None, "all", "qv", "all", None):
        out = llm.generate([prompt], GREEDY, lora_name=name)[0]
        assert list(out.token_ids) == refs(name, prompt)
    engine = llm.engine
    keys = {name: engine.prompt_blocks(prompt, lora_name=name).hashes for name in (None, "all", "qv")}
    assert len({tuple(k) for k in keys.values()}) == 3
    # the second run of "all" and of the base model hit their own blocks
    hits = [llm.generate([prompt], GREEDY, lora_name=n)[0].num_cached_tokens for n in ("all", None, "qv")]
    assert hits == [32, 32, 32]
    # the same adapter reloaded (same name, same content) keys its blocks alike; another under that name does not
    engine.unload_lora("qv")
    engine.load_lora("qv", str(adapters["qv"]))
    assert engine.prompt_blocks(prompt, lora_name="qv").hashes == keys["qv"]
    engine.unload_lora("qv")
    engine.load_lora("qv", str(adapters["o"]))
    assert engine.prompt_blocks(prompt, lora_name="qv").hashes != keys["qv"]
    out = llm.generate([prompt], GREEDY, lora_name="qv")[0]
    assert out.num_cached_tokens == 0 and list(out.token_ids) == refs("o", prompt)
    llm.engine.assert_no_leaks()


def test_lru_swap_beyond_max_loras(model_dir, adapters, refs):
    """Four adapters over two slots and two in memory: each request runs under its own,
    swapped in when a slot is free of running requests, never mid-request."""
    llm = make_llm(model_dir, adapters, adapters, max_loras=2, max_cpu_loras=2)
    names = ["all", "qv", "mlp", "o", None, "all", "mlp"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = llm.generate(prompts, GREEDY, lora_name=names)
    assert ids(outs) == [refs(n, p) for n, p in zip(names, prompts)]
    assert len(llm.engine.loras.resident()) == 2
    llm.engine.assert_no_leaks()


def test_slots_are_held_while_running(model_dir, adapters, refs):
    """With one slot, a request of another adapter waits until the running one ends."""
    llm = make_llm(model_dir, adapters, ("all", "qv"), max_loras=1)
    engine = llm.engine
    first = llm.add_request(PROMPTS[0], GREEDY, lora_name="all")
    outs = llm.step()
    second = llm.add_request(PROMPTS[1], GREEDY, lora_name="qv")
    outs += llm.step()
    assert [r.request_id for r in engine.scheduler.running] == [first]
    assert [r.request_id for r in engine.scheduler.waiting] == [second]
    while engine.has_unfinished():
        outs += llm.step()
    tokens = {first: [], second: []}
    for out in outs:
        tokens[out.request_id] += out.new_token_ids
    assert tokens[first] == refs("all", PROMPTS[0]) and tokens[second] == refs("qv", PROMPTS[1])
    engine.assert_no_leaks()


def test_unload_refused_while_in_use(model_dir, adapters, refs):
    llm = make_llm(model_dir, adapters, ("all",))
    engine = llm.engine
    rid = llm.add_request(PROMPTS[0], GREEDY, lora_name="all")
    with pytest.raises(LoraInUseError) as err:
        engine.unload_lora("all")
    assert to_service_error(err.value).http_status == 400 and "all" in str(err.value)
    outs = llm.step()
    with pytest.raises(LoraInUseError):
        engine.unload_lora("all")
    while engine.has_unfinished():
        outs += llm.step()
    tokens = [t for o in outs if o.request_id == rid for t in o.new_token_ids]
    assert tokens == refs("all", PROMPTS[0])
    engine.unload_lora("all")
    assert engine.lora_names() == []
    with pytest.raises(LoraNotFoundError):
        llm.generate(PROMPTS[:1], GREEDY, lora_name="all")
    engine.assert_no_leaks()


def test_abort_releases_the_adapter(model_dir, adapters):
    llm = make_llm(model_dir, adapters, ("all",))
    rid = llm.add_request(PROMPTS[1], GREEDY, lora_name="all")
    llm.step()
    assert llm.abort(rid)
    llm.engine.unload_lora("all")
    while llm.engine.has_unfinished():
        llm.step()
    llm.engine.assert_no_leaks()


def test_unknown_and_disabled_names_are_404(model_dir, adapters):
    llm = make_llm(model_dir, adapters, ("all",))
    with pytest.raises(LoraNotFoundError) as err:
        llm.generate(PROMPTS[:1], GREEDY, lora_name="nope")
    assert to_service_error(err.value).http_status == 404 and "nope" in str(err.value)
    with pytest.raises(AlreadyExistsError):
        llm.load_lora("all", str(adapters["qv"]))
    plain = LLM(str(model_dir), num_blocks=16)
    with pytest.raises(LoraNotFoundError, match="enable_lora"):
        plain.generate(PROMPTS[:1], GREEDY, lora_name="all")
    with pytest.raises(LoraNotFoundError):
        plain.engine.load_lora("all", str(adapters["all"]))
    assert plain.engine.lora_names() == []
    llm.engine.assert_no_leaks()
    plain.engine.assert_no_leaks()


def test_bad_adapter_is_refused_and_the_engine_stays_healthy(model_dir, adapters, refs, tmp_path):
    llm = make_llm(model_dir, adapters, (), max_lora_rank=4, lora_allowed_root=str(adapters["all"].parent))
    with pytest.raises(LoraAdapterError, match="max_lora_rank"):
        llm.load_lora("big", str(adapters["qv"]))  # rank 8 > 4
    with pytest.raises(LoraAdapterError, match="outside the allowed root"):
        llm.load_lora("out", str(tmp_path))
    assert to_service_error(LoraAdapterError("x")).http_status == 400
    llm.load_lora("all", str(adapters["all"]))
    assert llm.engine.lora_names() == ["all"]
    assert ids(llm.generate(PROMPTS, GREEDY, lora_name="all")) == [refs("all", p) for p in PROMPTS]
    llm.engine.assert_no_leaks()


def test_preemption_gives_the_slot_back_and_recomputes_under_the_adapter(model_dir, adapters, refs):
    """MAX_UTILIZATION on a cache too small for the batch: preempted requests of several
    adapters are recomputed under their own adapter."""
    long_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = make_llm(model_dir, adapters, ("all", "qv", "mlp"), max_loras=3, capacity_policy="MAX_UTILIZATION",
                   num_blocks=8, max_num_tokens=64)
    names = ["all", None, "qv", "mlp", "all", "qv"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = llm.generate(prompts, long_params, lora_name=names)
    assert llm.engine.stats().num_preemptions > 0
    assert ids(outs) == [refs(n, p, 16) for n, p in zip(names, prompts)]
    llm.engine.assert_no_leaks()


def test_speculative_decoding_keeps_the_adapter(model_dir, adapters, refs, monkeypatch):
    """Draft rows (several per sequence in one step) run under their sequence's adapter:
    drafts from each adapter's own reference, one wrong in every four, keep its text."""
    import numpy as np

    from pdserve.engine import speculation
    from pdserve.engine.config import SpeculativeConfig

    names = [None, "all", "qv"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 9, 11, 4, 7 + i] * 3 for i in range(3)]
    script = {tuple(p): refs(n, p, 16) for n, p in zip(names, prompts)}

    def propose(tokens, min_n, max_n, k):
        seq = tokens.tolist()
        for prompt, reference in script.items():
            if tuple(seq[:len(prompt)]) == prompt:
                done = len(seq) - len(prompt)
                drafts = list(reference[done:done + k])
                if done % 4 < len(drafts):
                    drafts[done % 4] = (drafts[done % 4] + 1) % 250 + 3
                return np.array(drafts, dtype=np.int32)
        raise AssertionError("an unknown sequence")

    monkeypatch.setattr(speculation, "propose", propose)
    llm = make_llm(model_dir, adapters, ("all", "qv"), speculative=SpeculativeConfig(num_speculative_tokens=3))
    llm.engine.speculator.cost = type("FreeRows", (), {"ratio": 0.0, "note": lambda self, rows, s: None})()
    outs = llm.generate(prompts, params, lora_name=names)
    assert ids(outs) == [refs(n, p, 16) for n, p in zip(names, prompts)]
    assert llm.engine.stats().num_accepted_tokens > 0
    llm.engine.assert_no_leaks()


def test_an_adapter_changed_on_disk_fails_its_request_only(model_dir, adapters, refs, tmp_path):
    """Evicted from memory (max_cpu_loras), an adapter is read again when a request needs it;
    content that no longer matches its digest ends that request with an error, and the
    engine goes on serving the others."""
    import shutil

    shutil.copytree(adapters["qv"], tmp_path / "qv")
    llm = make_llm(model_dir, adapters, (), max_loras=1, max_cpu_loras=1)
    llm.load_lora("qv", str(tmp_path / "qv"))
    llm.load_lora("all", str(adapters["all"]))  # evicts "qv" from memory: neither is resident yet
    assert llm.engine.loras.adapter("qv") is None
    write_adapter(tmp_path / "qv", model_dir, targets=("q_proj", "v_proj"), rank=8, alpha=4, seed=9)
    outs = llm.generate(PROMPTS[:2], GREEDY, lora_name=["qv", "all"])
    assert outs[0].finish_reason == "error" and list(outs[0].token_ids) == []
    assert list(outs[1].token_ids) == refs("all", PROMPTS[1])
    llm.engine.assert_no_leaks()


TRITON_CHILD = r"""
import json, sys
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
model, adapters, prompts, names = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model, num_blocks=48, max_num_tokens=24, enable_lora=True, max_loras=2)
for name, path in adapters.items():
    llm.load_lora(name, path)
outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), lora_name=names)
llm.engine.assert_no_leaks()
print(json.dumps([list(o.token_ids) for o in outs]))
"""


def test_the_triton_path_through_the_engine_under_the_interpreter(model_dir, adapters, refs):
    """The engine's LoRA rows through the Triton kernels (TRITON_INTERPRET=1 in a child
    process): base and two adapters in one batch, chunked prefill and decode."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    names = [None, "all", "qv"]
    prompts = PROMPTS
    env = dict(os.environ, PDSERVE_USE_TRITON="1", TRITON_INTERPRET="1")
    paths = {n: str(adapters[n]) for n in ("all", "qv")}
    out = subprocess.run([sys.executable, "-c", TRITON_CHILD, str(model_dir), json.dumps(paths),
                          json.dumps(prompts), json.dumps(names)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == [refs(n, p, 5) for n, p in zip(names, prompts)]


def test_disaggregated_hand_off_under_an_adapter(model_dir, adapters, refs, tmp_path):
    """Prefill and decode engines both under the adapter (KV sent through the disk backend):
    the text is the adapter's; a prefix the decode side cached under another adapter or
    the base model is not reused."""
    from engine_pair import assert_all_blocks_back, disaggregated, engines
    from pdserve.kvtransfer import KVTransferConfig
    from pdserve.kvtransfer.verdict import RECOMPUTE

    config = KVTransferConfig(backends=("disk", RECOMPUTE), disk_store=str(tmp_path / "store"))
    prompt = list(range(20, 60))
    with engines(model_dir, config, common=dict(enable_lora=True, max_loras=2)) as (prefill, decode, _):
        for llm in (prefill, decode):
            llm.load_lora("all", str(adapters["all"]))
            llm.load_lora("qv", str(adapters["qv"]))
        for i, name in enumerate(["all", None, "qv", "all"]):
            tokens, sent, received = disaggregated(prefill, decode, prompt, f"r{i}", lora_name=name)
            assert sent.ok and received.ok, received.describe()
            assert tokens == refs(name, prompt, 6)
            # only the repeat of "all" finds its blocks cached on the decode side
            assert sent.num_blocks == (1 if i == 3 else 3), (i, sent.num_blocks)  # 2 full blocks + 1 part
        assert_all_blocks_back(prefill, decode)
