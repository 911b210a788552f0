"""Sharing inside SGLang's own chat serving (HTTP process, AROUND hooks), for the requests the
middleware handed on with a ``ChatShare`` in their ASGI scope (``chat.py``); every other request
passes untouched.

- ``OpenAIServingChat._convert_to_internal_request``: the request is marked as being converted
  (``ServerContext.converting``); SGLang renders and converts it; the internal request then gets
  the sharing spec (``sampling_params.custom_params``) and the agent's radix namespace
  (``extra_key``).
- ``OpenAIServingChat._process_messages``: for a marked request, SGLang's rendered prompt (its
  ids decoded, as SGLang reads a multimodal prompt) is cut into segments (each shared message's
  content a PH segment) and tokenised segment-wise; those ids replace SGLang's prompt ids.

Running the request (its prefills, its record, the agent's output tokens) is ``generate.py``'s.
"""

from __future__ import annotations

from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.server.annotate import with_spec
from sglang_kvshare.integration.server.chat import ChatShare
from sglang_kvshare.integration.server.share import share_of
from sglang_kvshare.segments import AnnotationError

HOOKS = HookSet()
_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"


@HOOKS.around(f"{_CHAT}._convert_to_internal_request", ("self", "request", "raw_request"))
def convert_to_internal_request(ctx, original, serving, request, raw_request=None):
    share = share_of(raw_request)
    if not isinstance(share, ChatShare):
        return original(serving, request, raw_request)
    if request.input_ids is not None:
        raise AnnotationError("kvshare: the prompt is given by the messages; do not also send input_ids")
    ctx.converting[id(request)] = share
    try:
        adapted, processed = original(serving, request, raw_request)
    finally:
        ctx.converting.pop(id(request), None)
    if share.wire is None:
        if share.auto is not None:
            return adapted, processed  # nothing detected survived tokenisation: runs unshared
        raise AnnotationError(
            "kvshare: this model's chat prompt does not round-trip through text; its messages cannot be shared"
        )
    adapted.sampling_params = with_spec(adapted.sampling_params, share.wire)
    adapted.extra_key = share.wire.namespace
    return adapted, processed


@HOOKS.around(f"{_CHAT}._process_messages", ("self", "request", "is_multimodal"))
def process_messages(ctx, original, serving, request, *args, **kwargs):
    result = original(serving, request, *args, **kwargs)
    share = ctx.converting.get(id(request))
    if share is None or not isinstance(result.prompt_ids, list) or serving._prompt_text_round_trip_is_lossy:
        return result
    tok = serving.tokenizer_manager.tokenizer
    try:  # the rendered prompt's text, as SGLang reads it for a multimodal prompt
        result.prompt_ids = share.annotate(result.prompt or tok.decode(result.prompt_ids), tok, result.prompt_ids)
    except AnnotationError as e:
        raise AnnotationError(f"kvshare: {e}") from None
    return result
