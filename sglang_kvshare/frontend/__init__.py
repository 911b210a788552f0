"""SGLang frontend language support: agent roles and shared context in ``@sgl.function`` programs.

A frontend program builds its prompt as one string (``StreamExecutor.text_``) and every
``sgl.gen`` hands that string to the backend's ``generate``. The hook is therefore a backend:
:class:`KVShareEndpoint`, a :class:`sglang.RuntimeEndpoint` whose ``generate`` /
``generate_stream`` turn the accumulated text into a ``kvshare`` annotation. The program marks
what is what with two helpers that return ordinary strings (so they pass through ``s += ...``,
``sgl.user(...)``, f-strings and ``+`` unchanged):

- :func:`agent_role` declares which agent the program speaks for (``kvshare.agent``), optionally
  with a system prompt (rendered as ``sgl.system(...)`` by the chat template) and a LoRA adapter
  name sent as ``lora_path``;
- :func:`shared` wraps a span of text as a shared (PH) segment with a slot name;
  :func:`agent_output` is ``shared(text, "out:<agent>")`` for an earlier agent's output.

Both are written into the text as Unicode private-use markers (U+E000..U+E004), which the
endpoint parses back: text outside ``shared`` spans becomes private (PF) segments, the marker
characters never reach the model. Programs without markers are sent exactly as stock
``RuntimeEndpoint`` sends them.

.. code-block:: python

    import sglang as sgl
    from sglang_kvshare.frontend import KVShareEndpoint, agent_role, agent_output, shared

    @sgl.function
    def agent(s, name, system_prompt, question, earlier):
        s += agent_role(name, system_prompt=system_prompt)
        s += sgl.user(shared(question, "q") + "".join(
            f"\\n\\n{who} wrote:\\n" + agent_output(who, text) for who, text in earlier))
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(KVShareEndpoint("http://127.0.0.1:30000", workflow="wf-1",
                                            method="fullshared", chat_template_name="chatml"))
    a = agent.run(name="solver", system_prompt="You solve.", question=q, earlier=[])
    b = agent.run(name="critic", system_prompt="You check.", question=q,
                  earlier=[("solver", a["answer"])])
    b.get_meta_info("answer")["kvshare"]   # segments with mode "injected" for q and out:solver

Limits: one agent per program state (one request = one agent turn; run one program per turn, as
SGLang's own multi-agent examples do); ``sgl.gen(choices=...)`` (select), ``sgl.image`` and
the lazy/prefix-caching calls are sent as plain text without sharing (markers stripped); an
agent's output is shared by passing its ``state[var]`` text unchanged to :func:`agent_output`.
"""

from sglang_kvshare.frontend.endpoint import KVShareEndpoint
from sglang_kvshare.frontend.markup import (
    AgentHeader,
    MarkupError,
    agent_output,
    agent_role,
    build_request,
    kvshare_meta,
    parse_marked,
    plain_text,
    shared,
)

__all__ = [
    "AgentHeader",
    "KVShareEndpoint",
    "MarkupError",
    "agent_output",
    "agent_role",
    "build_request",
    "kvshare_meta",
    "parse_marked",
    "plain_text",
    "shared",
]
