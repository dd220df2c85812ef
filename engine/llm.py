"""Offline batch generation in the shape of vLLM's `LLM` (outside tools rely on this shape):

    from k3serve import LLM, SamplingParams
    llm = LLM()                                       # the shipped k3-code, or a dir / preset
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=16))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
"""

from __future__ import annotations

from typing import Any, Sequence

from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.outputs import CompletionOutput, RequestFailedError, RequestOutput
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.packaged import DEFAULT_MODEL

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, params_list):
            try:
                rid = engine.add_request(prompt, p)
            except Exception:  # all or nothing: a bad prompt leaves no earlier prompt queued
                for added in order:
                    engine.abort_request(added)
                raise
            order.append(rid)
            request = engine.scheduler.requests[rid]
            outputs[rid] = RequestOutput(
                request_id=rid,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(request.prompt_token_ids),
                prompt_logprobs=None,
                outputs=[CompletionOutput(0, "", [], None if p.logprobs is None else 0.0, None if p.logprobs is None else [])],
                finished=False,
            )
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.error is not None:  # a failed request fails the call, as a bad prompt does
                    for rid in order:
                        engine.abort_request(rid)
                    raise RequestFailedError(delta.error)
                out = outputs[delta.request_id]
                out.num_cached_tokens = delta.num_cached_tokens
                completion = out.outputs[0]
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = [None if e is None else e.to_dict() for e in delta.prompt_logprobs]
                completion.token_ids.extend(delta.new_token_ids)
                completion.text += delta.new_text
                if delta.logprobs is not None:
                    completion.logprobs.extend(e.to_dict() for e in delta.logprobs)
                    completion.cumulative_logprob += sum(e.chosen_logprob for e in delta.logprobs)
                if delta.finished:
                    out.finished = True
                    completion.finish_reason = delta.finish_reason
                    completion.stop_reason = delta.stop_reason
        return [outputs[rid] for rid in order]
