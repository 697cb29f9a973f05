"""A CPU install has no Triton (requirements-cpu.txt): the engine must run without it, graphs
emulated, greedy and seeded sampling, text and image prompts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # any "import triton" now raises ImportError
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    llm = LLM(model="demo/mllama-tiny", max_model_len=128, max_num_seqs=4)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8))
    prompts = ["a text prompt", {"prompt": "<|image|>what is this", "multi_modal_data":
                                 {"image": image}}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, [greedy, seeded], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert "triton" not in {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU install's code path")
def test_engine_runs_without_triton() -> None:
    env = {**os.environ}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
