"""``KVShareEndpoint``: the ``sgl.RuntimeEndpoint`` that sends marked programs as annotated requests."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any, Dict, Optional

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.global_config import global_config
from sglang.lang.ir import SglSamplingParams
import requests

from sglang_kvshare.frontend.markup import _MARKER_RE, MarkupError, build_request, kvshare_meta, plain_text
from sglang_kvshare.routing import routing_headers
from sglang_kvshare.segments.wire import KEY


_DEFAULT_TEMPLATES = (("smollm", "chatml"),)


class KVShareEndpoint(RuntimeEndpoint):
    """``sgl.RuntimeEndpoint`` for a ``sglang_kvshare`` server; generation calls of programs that
    use :func:`agent_role` / :func:`shared` are sent with a ``kvshare`` annotation.

    workflow: default ``kvshare.workflow`` (a fresh ``sgl-<hex>`` id if None); see
        :meth:`new_workflow`. One workflow = one run of the multi-agent task.
    method: default ``kvshare.method`` (None: the server's ``--kvshare-method``).
    chat_template_name: as for RuntimeEndpoint; when None and SGLang's model-path matching finds
        only its ``default`` template, SmolLM2 paths get ``chatml`` (their real template).
    """

    def __init__(
        self,
        base_url: str,
        workflow: Optional[str] = None,
        method: Optional[str] = None,
        *,
        api_key: Optional[str] = None,
        verify: Optional[str] = None,
        chat_template_name: Optional[str] = None,
    ):
        super().__init__(base_url.rstrip("/"), api_key=api_key, verify=verify, chat_template_name=chat_template_name)
        if chat_template_name is None and self.chat_template.name == "default":
            from sglang.lang.chat_template import get_chat_template

            path = self.model_info.get("model_path", "").lower()
            for needle, name in _DEFAULT_TEMPLATES:
                if needle in path:
                    self.chat_template = get_chat_template(name)
        self.workflow = workflow or self._fresh_id()
        self.method = method

    @staticmethod
    def _fresh_id() -> str:
        return f"sgl-{uuid.uuid4().hex[:12]}"

    def new_workflow(self, workflow: Optional[str] = None) -> str:
        """Start a new default workflow id (programs run afterwards belong to it); returns it."""
        self.workflow = workflow or self._fresh_id()
        return self.workflow

    # ------------------------------------------------------------------ request building

    def _sampling(self, sampling_params: SglSamplingParams) -> Dict[str, Any]:
        # as RuntimeEndpoint.generate builds it
        return {
            "skip_special_tokens": global_config.skip_special_tokens_in_output,
            "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
            **sampling_params.to_srt_kwargs(),
        }

    def _annotated(self, s, sampling_params: SglSamplingParams) -> Optional[Dict[str, Any]]:
        """The annotated request body, or None for a program without markup (stock path)."""
        if not _MARKER_RE.search(s.text_):
            return None
        self._handle_dtype_to_regex(sampling_params)
        data = build_request(s.text_, self._sampling(sampling_params), workflow=self.workflow, method=self.method)
        if s.images_:
            raise MarkupError("images are not supported together with kvshare segments")
        for item in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        return data

    def _post(self, data: Dict[str, Any], stream: bool = False) -> requests.Response:
        """POST an annotated body to /generate with the workflow's routing-key header (behind
        ``launch_router`` it pins the workflow to one worker; a single server ignores it)."""
        headers = {"Content-Type": "application/json; charset=utf-8", **routing_headers(data)}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return requests.post(
            self.base_url + "/generate",
            json=data,
            stream=stream,
            headers=headers,
            verify=self.verify if self.verify is not None else True,
        )

    # ------------------------------------------------------------------ BaseBackend API

    def generate(self, s, sampling_params: SglSamplingParams):
        data = self._annotated(s, sampling_params)
        if data is None:
            return super().generate(s, sampling_params)
        res = self._post(data)
        self._assert_success(res)
        obj = res.json()
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        data = self._annotated(s, sampling_params)
        if data is None:
            yield from super().generate_stream(s, sampling_params)
            return
        data["stream"] = True
        res = self._post(data, stream=True)
        self._assert_success(res)
        pos = 0
        for chunk in res.iter_lines(decode_unicode=False):
            chunk = chunk.decode("utf-8")
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    break
                obj = json.loads(chunk[5:].strip("\n"))
                meta = dict(obj["meta_info"])
                if KEY in meta:
                    meta[KEY] = kvshare_meta(meta)
                piece = obj["text"][pos:]
                pos += len(piece)
                yield piece, meta

    # Calls that have no kvshare form: send the plain text (markers stripped), no sharing.

    def select(self, s, choices, temperature, choices_method):
        return super().select(_plain_view(s), choices, temperature, choices_method)

    def commit_lazy_operations(self, s):
        return super().commit_lazy_operations(_plain_view(s))

    def fill_image(self, s):
        return super().fill_image(_plain_view(s))

    def cache_prefix(self, prefix_str: str):
        return super().cache_prefix(plain_text(prefix_str) if _MARKER_RE.search(prefix_str) else prefix_str)


def _plain_view(s):
    """A stand-in for a StreamExecutor with the markup stripped (for the stock code paths)."""
    if not _MARKER_RE.search(s.text_):
        return s
    return SimpleNamespace(text_=plain_text(s.text_), images_=s.images_)
