"""What one sampled token does to its request: append it, advance the grammar, detokenize, and decide whether the
request has finished and why.

Stop rules (vLLM V1's): EOS (unless `ignore_eos`), a stop token id or a stop string ends the request only in the
tokens generated after the first `min_tokens`; a constrained request ends when its grammar does (it accepted EOS),
whatever `min_tokens` / `ignore_eos` say; `max_tokens` or the context limit end it with "length". A token the grammar
refused (impossible with the mask applied) ends it with "error".
"""

from __future__ import annotations

from typing import Any

from rose.engine import structured_check
from rose.engine.outputs import CompletionOutput, RequestOutput, StepOutput, TokenLogprob
from rose.engine.sequence import Sequence


def append_token(
    seq: Sequence,
    token: int,
    logprob: TokenLogprob | None,
    now: float,
    eos_token_ids: set[int],
    max_model_len: int,
) -> StepOutput:
    """Append `token` (sampled at wall time `now`) to `seq`; returns the step's output for it, with the request's
    final output when this token finished it."""
    seq.output_token_ids.append(token)
    if logprob is not None and seq.logprobs is not None:
        seq.logprobs.append(logprob)
    metrics = seq.metrics
    metrics.num_generated_tokens += 1
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    params = seq.params
    may_stop = len(seq.output_token_ids) > params.min_tokens
    reason = None
    grammar_done = seq.structured is not None and seq.structured.advance(token, seq.request_id)
    stop_token = grammar_done or (
        may_stop and (token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids))
    )
    if stop_token:
        reason = "stop"
    delta = ""
    detok = seq.detokenizer
    if detok is not None:
        decode = not stop_token or params.include_stop_str_in_output
        delta = detok.update(token, decode=decode, check_stop=may_stop)
        if detok.stop_reason is not None:
            reason = "stop"
    if reason is None and (len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    new_logprobs = [logprob] if logprob is not None else None
    if reason is None:
        return StepOutput(seq.request_id, [token], delta, new_logprobs=new_logprobs)
    if detok is not None:
        delta += detok.finish()
        seq.text = detok.text
    error = invalid = None
    if grammar_done and seq.structured.refused is not None:
        reason, error = "error", f"structured_outputs: the grammar refused sampled token {token}"
    elif grammar_done and reason == "stop" and detok is not None:
        # the grammar's own end (a stop string or stop token of the job's own cuts it short: not checked)
        text = seq.text
        if params.include_stop_str_in_output:  # the stop token's text follows the output
            text = text.removesuffix(detok.token_text(token))
        invalid = structured_check.violation(seq.structured.params, text)
        if invalid is not None:  # the grammar let it through: not reported as a clean stop
            reason, error = "error", f"structured_outputs: the output breaks its constraint: {invalid}"
    seq.finish_reason = reason
    metrics.finished_time = now
    output = request_output(seq, error, invalid)
    return StepOutput(seq.request_id, [token], delta, True, reason, new_logprobs=new_logprobs, output=output)


def sampled_vocab(model: Any, tokenizer: Any) -> int:
    """The ids a request may sample: the model's vocabulary, cut to the tokenizer's where that is smaller (ids past
    it are padding rows of the embedding)."""
    vocab = model.config.get_text_config().vocab_size
    if tokenizer is not None and 0 < len(tokenizer) < vocab:
        return len(tokenizer)
    return vocab


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every EOS id the model's generation config, its config and the tokenizer name (transformers' `generate`
    stops at any of them)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def request_output(seq: Sequence, error: str | None = None, invalid: str | None = None) -> RequestOutput:
    """The request's whole result so far (its final one once it has finished); `error` / `invalid`: why it finished
    "error" (CompletionOutput's `error` / `structured_output_error`)."""
    choice = CompletionOutput(
        0, seq.text, list(seq.output_token_ids), seq.finish_reason, seq.logprobs, error, invalid
    )
    return RequestOutput(
        seq.request_id, seq.prompt, seq.prompt_token_ids, [choice], seq.metrics, seq.prompt_logprobs
    )
