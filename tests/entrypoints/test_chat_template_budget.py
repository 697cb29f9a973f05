"""Chat templates render in a sandbox whose work itself is bounded: templates that would take
seconds, gigabytes or a 500 stop from inside the render with a named error, quickly and with
little memory; real templates render exactly as ``transformers`` renders them."""

from __future__ import annotations

import threading
import time
import tracemalloc
from typing import Any

import pytest

from vllm.entrypoints.chat_template import (
    ChatTemplateBudget,
    ChatTemplateBudgetError,
    ChatTemplateError,
    render_template,
)
from vllm.entrypoints.chat_utils import render_chat_prompt
from vllm.transformers_utils.demo_checkpoints import get_demo_checkpoint
from vllm.transformers_utils.tokenizer import get_tokenizer

BIG = "'a' * 3000000"  # 3 M characters: under the 4 Mi default, so only what follows is refused
ATTACKS = {
    "string repeat": "{% set x = 'ab' * 100000000 %}{{ x|length }}",
    "list repeat then print": f"{{% set s = {BIG} %}}{{% set l = [s] * 400000 %}}{{{{ l }}}}",
    "range": "{% for i in range(10**6) %}{% endfor %}",
    "power": "{{ 2 ** 100000 }}",
    "squaring": "{% set n = namespace(v=3) %}{% for i in range(40) %}"
    "{% set n.v = n.v * n.v %}{% endfor %}",
    "center filter": "{{ 'a'|center(1000000000) }}",
    "str.center": "{{ 'a'.center(1000000000) }}",
    "str.replace": "{% set s = 'a' * 100000 %}{{ s.replace('', 'b' * 64) }}",
    "percent width": "{{ '%01000000000d' % 1 }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "strftime width": "{{ strftime_now('%1000000000Y') }}",
    "doubling with ~": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
    "{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "doubling in a block": "{% set ns = namespace(x='ab') %}{% for i in range(40) %}"
    "{% set y %}{{ ns.x }}{{ ns.x }}{% endset %}{% set ns.x = y %}{% endfor %}",
    "many copies": f"{{% set s = {BIG} %}}{{% set ns = namespace(l=[]) %}}"
    "{% for i in range(1000) %}{% set ns.l = ns.l + [s ~ i] %}{% endfor %}",
    "indent": "{% set s = '\\n' * 100000 %}{{ s|indent(100000) }}",
    "join": "{% set s = 'a' * 100000 %}{{ s.join(['x'] * 100000) }}",
    "tojson of copies": f"{{% set s = {BIG} %}}{{{{ ([s] * 100)|tojson }}}}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.parametrize("source", ATTACKS.values(), ids=ATTACKS.keys())
def test_attacks_stop_inside_the_render(source: str) -> None:
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ChatTemplateBudgetError):
            render_template(source, {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < ChatTemplateBudget().timeout + 1.0
    assert peak < 128 << 20, f"{peak / 1e6:.0f} MB"


def test_the_deadline_stops_the_render_in_its_own_thread() -> None:
    """No thread is left running: the error comes out of the render itself."""
    threads = threading.active_count()
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ChatTemplateBudgetError, match="--chat-template-timeout"):
        render_template(forever, {}, ChatTemplateBudget(max_steps=10**9, timeout=0.05))
    assert time.monotonic() - start < 1.0
    assert threading.active_count() == threads


def test_step_and_size_budgets_are_the_given_ones() -> None:
    loop = "{% for i in range(300) %}x{% endfor %}"
    assert render_template(loop, {}, ChatTemplateBudget(max_steps=1000)) == "x" * 300
    with pytest.raises(ChatTemplateBudgetError, match="more than 500 steps"):
        render_template(loop, {}, ChatTemplateBudget(max_steps=500))
    with pytest.raises(ChatTemplateBudgetError, match="over the limit of 200"):
        render_template(loop, {}, ChatTemplateBudget(max_chars=200))


@pytest.mark.parametrize(
    "source,match",
    [
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{% for %}", "Expected an expression"),
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{% set ns = namespace(_x=1) %}", "is private"),
        ("{{ 1 // 0 }}", "could not be rendered"),
        ("{{ 'a' + 1 }}", "could not be rendered"),
        ("{{ x|tojson(indent=1000) }}", "indent"),
    ],
)
def test_template_errors_are_named_errors(source: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        render_template(source, {"x": [1]})


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_tokenizer(get_demo_checkpoint("demo/mllama-tiny"))


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "tool", "content": "{}"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("kwargs", [{}, {"date_string": "1 Jan 2025"}])
def test_renders_as_transformers_does(tokenizer: Any, messages: list, kwargs: dict) -> None:
    ours = render_chat_prompt(tokenizer, messages, chat_template_kwargs=kwargs)
    theirs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert ours == theirs
    cont = [*messages, {"role": "assistant", "content": "The answer is"}]
    ours = render_chat_prompt(tokenizer, cont, add_generation_prompt=False,
                              continue_final_message=True)
    theirs = tokenizer.apply_chat_template(
        cont, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert ours == theirs and ours.endswith("The answer is")
