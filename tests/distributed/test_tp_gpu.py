"""Tensor-parallel ranks on GPUs: one GPU a rank, the model's collectives over NCCL inside the
decode graphs. The outputs of two GPU ranks against one GPU (check_logprobs_close) and a rank
killed inside a step need two GPUs (skipped otherwise). On any machine: the GPU count is
checked before anything starts, and rank 0's watcher (which ends a process whose NCCL
collectives wait for a dead peer) acts only on a call that stays in flight past its grace."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers.compare import check_logprobs_close, vllm_greedy
from helpers.tp_llm import tp_llm

from vllm import LLM, SamplingParams
from vllm.distributed.tp_engine import EXIT_RANK_LOST, MULTICAST_OFF, Ranks
from vllm.engine.arg_utils import EngineArgs

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_more_ranks_than_gpus_is_refused() -> None:
    n = max(2, torch.cuda.device_count() + 1)
    args = EngineArgs(model="demo/mllama-tiny", tensor_parallel_size=n, device="cuda")
    seen = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"needs {n} GPUs \\(one a rank\\); {seen} visible"):
        args.create_engine_config()


def _exiting_rank(delay_s: float) -> mp.Process:
    p = mp.get_context("spawn").Process(target=time.sleep, args=(delay_s,), daemon=True)
    p.start()
    return p


def _watched(delay_s: float, grace_s: float) -> tuple[Ranks, list[int]]:
    ranks = Ranks([_exiting_rank(delay_s)])
    ended: list[int] = []
    ranks.watch(grace_s=grace_s, end=ended.append)
    return ranks, ended


def test_watcher_ends_the_process_when_a_call_outlives_a_dead_rank() -> None:
    ranks, ended = _watched(0.2, grace_s=0.3)
    with ranks.in_call():  # a step whose collective never completes
        deadline = time.monotonic() + 30
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ended == [EXIT_RANK_LOST]
    assert ranks.closed


def test_watcher_leaves_an_idle_engine_to_fail_its_next_call() -> None:
    ranks, ended = _watched(0.1, grace_s=0.2)
    ranks.procs[0].join(30)
    time.sleep(0.6)
    assert ended == [] and not ranks.closed
    with pytest.raises(Exception, match="rank 1 exited"):
        ranks.check()


def test_watcher_leaves_a_call_that_ends_within_the_grace() -> None:
    ranks, ended = _watched(0.1, grace_s=1.0)
    with ranks.in_call():  # the call fails on its own (as gloo's collectives do) and returns
        ranks.procs[0].join(30)
        time.sleep(0.2)
    time.sleep(1.3)
    assert ended == [] and not ranks.closed


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)


def _prompts() -> list:
    import numpy as np
    from PIL import Image

    def image(w: int, h: int, seed: int) -> Image.Image:
        rng = np.random.default_rng(seed)
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    return [
        "Text prompt number 0 talks about",
        {
            "prompt": "<|image|><|begin_of_text|>Image 1 shows",
            "multi_modal_data": {"image": image(50, 60, 1)},
        },
        {
            "prompt": "<|begin_of_text|>Between <|image|> and <|image|>, 2 is",
            "multi_modal_data": {"image": [image(56, 112, 2), image(60, 60, 3)]},
        },
        "Another text prompt, number 3, goes on",
    ]


def _llm(tp: int, **kw) -> LLM:
    return tp_llm(tp, **{"device": "cuda", **kw})


@pytest.mark.gpu
@two_gpus
def test_two_gpu_ranks_generate_what_one_gpu_does() -> None:
    prompts = _prompts()
    one = vllm_greedy(_llm(1).generate(prompts, GREEDY, use_tqdm=False))
    llm = _llm(2)
    try:
        engine = llm.llm_engine
        assert engine._ranks is not None and engine.runner.device == torch.device("cuda", 0)
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = engine.runner.stats
        assert stats.eager_decode_steps == 0 and sum(stats.graph_replays.values()) > 0
    finally:
        llm.llm_engine.shutdown()
    check_logprobs_close(one, vllm_greedy(out), "one GPU", "two GPU ranks")


_KILL_MID_STEP = textwrap.dedent("""
    import os, signal, sys
    from vllm import LLM, SamplingParams
    llm = LLM(model="demo/mllama-tiny", tensor_parallel_size=2, max_model_len=256,
              max_num_seqs=4, device="cuda")
    engine = llm.llm_engine
    engine.add_request("r", "Hello", SamplingParams(temperature=0, max_tokens=200,
                                                    ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(engine._ranks.procs[0].pid, signal.SIGKILL)
    for _ in range(200):
        engine.step()
    print("no error", flush=True)
""")


@pytest.mark.gpu
@two_gpus
def test_a_gpu_rank_killed_inside_steps_ends_the_engine_instead_of_hanging() -> None:
    """Rank 1 killed between steps on the GPU: the next steps either fail by name at the
    send, or (a step already launched and waiting on the GPU for the dead peer) the watcher
    ends the process with EXIT_RANK_LOST; it never hangs and never carries on."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_MID_STEP], capture_output=True, text=True, timeout=300
    )
    log = proc.stdout + proc.stderr
    assert "no error" not in log
    assert "rank 1 exited" in log or "rank 1 (code" in log, log[-3000:]
    if proc.returncode == EXIT_RANK_LOST:
        assert "exited while a step was running" in log
    else:
        assert "TensorParallelError" in log, log[-3000:]


def test_gpu_ranks_get_their_gpu_and_multicast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank r's config names GPU r; ``start_ranks`` sets the multicast variables (keeping a
    value the environment gives) before it starts the ranks, which inherit them, and stops
    the started ranks when rank 0 cannot join."""
    import vllm.distributed.tp_engine as tpe

    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "custom")
    seen: dict = {}

    class Stop(Exception):
        pass

    def join(*a):
        seen.update({k: tpe.os.environ.get(k) for k in MULTICAST_OFF})
        raise Stop

    monkeypatch.setattr(tpe, "_join", join)
    procs: list = []
    monkeypatch.setattr(tpe.mp, "get_context", lambda _: _NoProcesses(procs))
    cpu = EngineArgs(model="demo/mllama-tiny", device="cpu").create_engine_config()
    assert tpe.rank_device(cpu, 1) is cpu
    gpu = dataclasses.replace(
        cpu,
        device_config=dataclasses.replace(cpu.device_config, device=torch.device("cuda")),
        parallel_config=dataclasses.replace(cpu.parallel_config, tensor_parallel_size=2),
    )
    assert tpe.rank_device(gpu, 1).device_config.device == torch.device("cuda", 1)
    with pytest.raises(Stop):
        tpe.start_ranks(gpu, object)
    assert seen == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "custom",
    }
    assert len(procs) == 1 and procs[0].terminated


class _NoProcesses:
    """A spawn context whose processes record that they were started and terminated."""

    def __init__(self, made: list) -> None:
        self.made = made

    def Process(self, **kw):  # multiprocessing's name
        made = self.made

        class P:
            terminated = False

            def start(self) -> None:
                made.append(self)

            def terminate(self) -> None:
                self.terminated = True

        return P()


def test_watcher_is_not_woken_by_a_normal_stop() -> None:
    """``shutdown`` closes the group before the ranks are joined: their exits end nothing."""
    ranks = Ranks([_exiting_rank(0.3)])
    ended: list[int] = []
    t = ranks.watch(grace_s=0.1, end=ended.append)
    with ranks.in_call():
        ranks.closed = True
        t.join(30)
    assert not t.is_alive() and ended == []
