"""`pdserve bench nemesis`: a deployment across hosts under faults, in the spirit of Jepsen.

Two prefill hosts, two decode hosts and a router in the network lab (`pdserve.lab`);
`--clients` clients send greedy completions for `--duration-s` seconds while a nemesis, every
few seconds, cuts a worker host's link (healed a few seconds later) or kills a worker (started
again a few seconds later). Every request must either complete with transformers' greedy
text or end with a clear error (an HTTP status with OpenAI's error body) within its
deadline. Afterwards every link is healed and every worker runs again; the run reports how
long until the deployment serves again and checks that every KV block is back.

    pdserve bench nemesis --clients 32 --duration-s 60
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdserve.lab.hosts import Lab
from pdserve.lab.namespaces import unavailable
from pdserve.lab.services import deploy

HOSTS = ["router", "prefill-0", "prefill-1", "decode-0", "decode-1"]
WORKERS = HOSTS[1:]
WORKER_ARGS = ["--kv-backends", "ucx,nccl", "--failure-policy", "recompute", "--num-threads", "1",
               "--max-kv-tokens", "8192", "--heartbeat-s", "0.5", "--prefill-timeout-s", "20"]
_TRADES = ["baker", "pilot", "gardener", "teacher", "fisher", "miller", "weaver", "potter", "cook", "smith",
           "carpenter", "tailor"]
# about 150 tokens each, no two sharing a first block: long enough for the router to send them
# to a prefill host (past --local-prefill-threshold), so faults hit transfers too
PROMPTS = [f"{w.capitalize()} story {i}. " + " ".join(f"On day {d} the {w} worked from dawn, rested at noon, "
                                                          f"and counted {d * (i + 3)} things by dusk."
                                                          for d in range(1, 8)) + f" What did the {w} do?"
           for i, w in enumerate(_TRADES)]


@dataclass
class Tally:
    """What the clients saw, and what the nemesis did."""

    outcomes: collections.Counter = field(default_factory=collections.Counter)
    wrong: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome == "wrong_text":
                self.wrong.append(detail)


def expected_texts(max_tokens: int) -> dict[str, str]:
    """transformers' greedy completion of each prompt (the oracle)."""
    import torch
    import transformers

    from pdserve.engine.loader import load_model

    loaded = load_model("default")
    tok = loaded.tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32)
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        out[prompt] = tok.decode(gen[0, len(ids):], skip_special_tokens=True)
    return out


def client(lab: Lab, url: str, model: str, expected: dict[str, str], max_tokens: int, until: float,
           deadline_s: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < until:
        prompt = rng.choice(PROMPTS)
        n += 1  # a salt of its own: no prefix cache answers it, every prompt is computed (and moved)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "cache_salt": f"{seed}-{n}"}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with lab.inside("router"), urllib.request.urlopen(req, timeout=deadline_s) as resp:
                text = json.loads(resp.read())["choices"][0]["text"]
            tally.add("completed" if text == expected[prompt] else "wrong_text", f"{prompt!r}: {text!r}")
        except urllib.error.HTTPError as err:
            body = err.read()
            clear = err.code >= 400 and b'"error"' in body
            tally.add(f"clear_error_{err.code}" if clear else f"unclear_error_{err.code}")
        except (TimeoutError, OSError) as err:  # no answer within the deadline: a hang
            tally.add("hung" if "timed out" in str(err) else "connection_error")


def nemesis(lab: Lab, services: dict, until: float, tally: Tally, seed: int) -> None:
    """Every 3-6 s: cut a worker host's link for 2-5 s, or kill a worker and start it again
    after 2-5 s."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        time.sleep(rng.uniform(3, 6))
        if time.monotonic() >= until:
            break
        name = rng.choice(WORKERS)
        if rng.random() < 0.5:
            lab.cut(name)
            tally.actions.append(f"{time.strftime('%X')} cut {name}")
            time.sleep(rng.uniform(2, 5))
            lab.heal(name)
        else:
            old = services[name]
            old.proc.kill()
            old.proc.wait(10)
            tally.actions.append(f"{time.strftime('%X')} kill {name}")
            time.sleep(rng.uniform(2, 5))
            services[name] = lab.start(name, name, old.proc.args[4:], {"PDSERVE_UCX_TLS": "tcp,self"})


def run(clients: int, duration_s: float, max_tokens: int, deadline_s: float, seed: int) -> dict:
    expected = expected_texts(max_tokens)
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="pdserve-nemesis-") as tmp, Lab(HOSTS) as lab:
        from pdserve.security.secret import ClusterSecret

        secret = os.path.join(tmp, "cluster-secret")
        ClusterSecret.create(secret)
        cluster = deploy(lab, secret, "router", WORKERS[:2], WORKERS[2:], (), WORKER_ARGS)
        services = {s.name: s for s in cluster.workers}
        model = cluster.request("/v1/models")["data"][0]["id"]
        until = time.monotonic() + duration_s
        threads = [threading.Thread(target=client, args=(lab, cluster.url, model, expected, max_tokens, until,
                                                         deadline_s, tally, seed + i)) for i in range(clients)]
        for t in threads:
            t.start()
        # on this thread: a service dies with the thread that started it (PR_SET_PDEATHSIG)
        nemesis(lab, services, until, tally, seed)
        for t in threads:
            t.join(deadline_s + 60)
        last_fault = time.monotonic()
        for name in WORKERS:  # everything back: links up, every worker running
            lab.heal(name)
            if services[name].proc.poll() is not None:
                services[name] = lab.start(name, name, services[name].proc.args[4:], {"PDSERVE_UCX_TLS": "tcp,self"})
        serving_again_s = _until_serving(lab, cluster.url, model, expected, max_tokens, last_fault)
        cluster.workers = list(services.values())
        cluster.wait_idle(timeout_s=60)  # every block back on every worker
        cluster.stop()
    return {"outcomes": dict(tally.outcomes), "wrong_texts": tally.wrong[:5], "faults": tally.actions,
            "serving_again_s": serving_again_s, "blocks_held_after": 0}  # wait_idle raised otherwise


def _until_serving(lab: Lab, url: str, model: str, expected: dict[str, str], max_tokens: int,
                   since: float, timeout_s: float = 120.0) -> float:
    """Seconds from `since` until every worker is registered and a request completes right."""
    prompt = PROMPTS[0]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    while time.monotonic() - since < timeout_s:
        try:
            with lab.inside("router"):
                health = json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())
                if health.get("decode_workers", 0) + health.get("prefill_workers", 0) >= len(WORKERS):
                    req = urllib.request.Request(url + "/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                    text = json.loads(urllib.request.urlopen(req, timeout=30).read())["choices"][0]["text"]
                    if text == expected[prompt]:
                        return time.monotonic() - since
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the deployment did not serve again within {timeout_s:.0f} s")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench nemesis", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (default %(default)s)")
    p.add_argument("--duration-s", type=float, default=60.0, help="how long faults run (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default %(default)s)")
    p.add_argument("--deadline-s", type=float, default=90.0, help="a request's deadline (default %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="the faults' and clients' seed (default %(default)s)")
    args = p.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"pdserve bench nemesis: {reason}", file=sys.stderr)
        return 2
    result = run(args.clients, args.duration_s, args.max_tokens, args.deadline_s, args.seed)
    print(json.dumps(result, indent=1))
    bad = {k: v for k, v in result["outcomes"].items() if not (k == "completed" or k.startswith("clear_error"))}
    return 1 if bad else 0
