"""``vllm.LLM``: offline batched generation with vLLM's interface."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from numbers import Integral
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import check_cache_salt
from vllm.multimodal.image import check_image
from vllm.multimodal.image_identity import HashedImage
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """A model for offline inference: ``generate()`` and ``chat()`` over batches of prompts.

    Accepts every :class:`~vllm.engine.arg_utils.EngineArgs` field as a keyword argument
    (``dtype``, ``enforce_eager``, ``max_model_len``, ``max_num_seqs``,
    ``limit_mm_per_prompt``, ``load_format``, ``seed``, ``revision``, ``download_dir``,
    ``mm_processor_kwargs``, ``hf_overrides``, ...).
    """

    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: str = "auto",
                 seed: int | None = 0, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.9, disable_log_stats: bool = True,
                 **kwargs: Any) -> None:
        kwargs.pop("trust_remote_code", None)
        # Offline batches want throughput: prefill first unless asked otherwise.
        if kwargs.get("enable_chunked_prefill") is None:
            kwargs["enable_chunked_prefill"] = False
        # Offline, caching only when asked for: a prompt's logprobs then do not depend on
        # what ran before it (a cached prefix is attended by another kernel).
        if kwargs.get("enable_prefix_caching") is None:
            kwargs["enable_prefix_caching"] = False
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, seed=seed,
                          enforce_eager=enforce_eager,
                          gpu_memory_utilization=gpu_memory_utilization,
                          disable_log_stats=disable_log_stats, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's method); pages in use stay with their owners."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True,
                 lora_request: Any = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generates for one prompt or a list (strings, token-id dicts, multimodal dicts,
        explicit encoder/decoder dicts; ``vllm.inputs`` types them). Returns outputs in input
        order. ``lora_request`` must be None (LoRA adapters are not supported). ``priority``:
        one value per prompt (``scheduling_policy="priority"``; lower values first)."""
        _check_no_lora(lora_request)
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Iterable):
            prompts = [prompts]  # one prompt (checked below like any other)
        prompts = list(prompts)
        for i, prompt in enumerate(prompts):
            check_prompt(prompt, f"prompts[{i}]")
        params = self._params_list(sampling_params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities, strict=True):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, p, priority=prio)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """OpenAI-style messages (text and ``image_url`` parts) through the chat template,
        with vLLM's options: ``continue_final_message`` continues the last (assistant)
        message instead of starting a new one; ``chat_template_content_format`` "string"
        gives the template string content (placeholders for images), "auto"/"openai" parts;
        ``tools`` reach the template. Processor options are the engine's
        (``LLM(mm_processor_kwargs=...)``), not per call."""
        from vllm.entrypoints.chat_utils import parse_chat_messages

        _check_no_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs per chat call is not supported; pass it to "
                             "LLM(..., mm_processor_kwargs=...) instead.")
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            prompts.append(parse_chat_messages(
                conv, self.get_tokenizer(), chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs,
                continue_final_message=continue_final_message,
                content_format=chat_template_content_format,
                lookup=self.llm_engine.input_processor.image_lookup()))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _params_list(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if isinstance(sampling_params, (dict, str)) or not isinstance(sampling_params, Sequence):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__} (for a dict: SamplingParams(**d))."
            )
        for p in sampling_params:
            if not isinstance(p, SamplingParams):
                raise TypeError(
                    f"sampling_params must hold SamplingParams, got {type(p).__name__}."
                )
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        out = []
        for p in params:
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            out.append(p)
        return out

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        engine = self.llm_engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]


def _check_no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported by this engine.")


def check_prompt(prompt: Any, where: str = "prompt") -> None:
    """The offline prompt forms (see ``MllamaInputProcessor.process``), checked before the
    engine sees them so that a mistake gets a message naming it: token ids must be integers
    (1.7 is not silently truncated), ``multi_modal_data`` a dict of PIL images with pixels,
    ``cache_salt`` a non-empty string of bounded length."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, dict):
        raise TypeError(f"{where} must be a string or a dict, got {type(prompt).__name__}.")
    try:
        check_cache_salt(prompt.get("cache_salt"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for part in ("encoder_prompt", "decoder_prompt"):
        if isinstance(prompt.get(part), dict):
            check_prompt(prompt[part], f"{where}[{part!r}]")
    ids = prompt.get("prompt_token_ids")
    if ids is not None:
        if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Sequence):
            raise ValueError(f"{where}['prompt_token_ids'] must be a list of integers.")
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)), None)
        if bad is not None:
            raise ValueError(
                f"{where}['prompt_token_ids'] must be a list of integers, got {bad!r}."
            )
    mm = prompt.get("multi_modal_data")
    if mm is None:
        return
    if not isinstance(mm, dict):
        raise ValueError(
            f"{where}['multi_modal_data'] must be a dict such as {{'image': image}} or "
            f"{{'image': [image, ...]}}, got {type(mm).__name__}."
        )
    images = mm.get("image")
    for j, img in enumerate(images if isinstance(images, (list, tuple)) else [images]):
        if img is not None and not isinstance(img, HashedImage):  # LLM.chat's are checked
            check_image(img, f"{where}['multi_modal_data']['image'][{j}]")
