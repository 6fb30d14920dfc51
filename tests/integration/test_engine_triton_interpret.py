"""The engine's greedy output is unchanged when its CPU path runs the Triton kernels under
the interpreter (TRITON_INTERPRET=1, PDSERVE_USE_TRITON=1) instead of the torch paths.
The Triton run happens in a child process so the interpreter setting stays there."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, sys
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
path, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(path, num_blocks=48, max_num_tokens=24, block_size=16)
outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
llm.engine.assert_no_leaks()
print(json.dumps([list(o.token_ids) for o in outs]))
"""


def _run(path, prompts, env_extra):
    env = dict(os.environ, **env_extra)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(prompts)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_greedy_identical_with_triton_interpreter(tiny_model_factory):
    path = tiny_model_factory("llama")
    # ragged prompts, one longer than a chunk (chunked prefill over a cached prefix) and
    # several decode steps: store_kv, prefill and decode attention all run
    prompts = [[5, 9, 13, 200, 7], list(range(3, 40)), [100] * 17]
    torch_ids = _run(path, prompts, {"PDSERVE_USE_TRITON": "0"})
    triton_ids = _run(path, prompts, {"PDSERVE_USE_TRITON": "1", "TRITON_INTERPRET": "1"})
    assert triton_ids == torch_ids
