"""Conversions between proto messages and the engine's types, shared by both servicers."""
from __future__ import annotations

from pdserve.proto.pdserve.v1 import common_pb2


def sampling_from_proto(p: common_pb2.SamplingParams):
    """The engine's SamplingParams of a request's: the sampling table's fields as sent (one
    left unset takes the table's default), the constraint converted."""
    from pdserve.engine.sampling_params import SamplingParams

    return SamplingParams.from_message(p, constraint=_constraint_from_proto(p.constraint))


def _constraint_from_proto(c: common_pb2.Constraint):
    from pdserve.engine.constraints import Constraint

    kind = c.WhichOneof("kind")
    if kind == "json_object" and c.json_object:
        return Constraint("json_object")
    if kind == "json_schema":
        return Constraint("json_schema", c.json_schema)
    if kind == "llguidance":
        return Constraint("llguidance", c.llguidance)
    if kind is not None:  # regex, choice, grammar: the router compiles them into llguidance
        from pdserve.common.errors import InvalidRequestError

        raise InvalidRequestError(f"a {kind} constraint must be compiled by the router (send llguidance)")
    return None


def logprob_to_proto(lp, tokenizer=None) -> common_pb2.TokenLogprob:
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, token=text(lp.token_id),
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top])


def logprob_from_proto(p: common_pb2.TokenLogprob):
    from pdserve.engine.request import TokenLogprob

    return TokenLogprob(p.token_id, p.logprob, tuple((t.token_id, t.logprob) for t in p.top_logprobs))


def model_info(engine, served_name: str, include_tokenizer: bool) -> common_pb2.ModelInfoResponse:
    tok = engine.tokenizer
    resp = common_pb2.ModelInfoResponse(
        model_name=served_name, max_model_len=engine.max_model_len, block_size=engine.kv.block_size,
        block_hash_salt=engine.compat_hash, eos_token_ids=list(engine.model_config.eos_token_ids),
        vocab_size=engine.model_config.vocab_size)
    if tok is not None:
        resp.chat_template = getattr(tok, "chat_template", None) or ""
        resp.bos_token = tok.bos_token or ""
        resp.eos_token = tok.eos_token or ""
        for key, value in (tok.special_tokens_map or {}).items():
            if isinstance(value, str):
                resp.special_tokens[key] = value
        resp.additional_special_tokens.extend(
            [t for t in (getattr(tok, "additional_special_tokens", None) or []) if isinstance(t, str)])
        if include_tokenizer:
            resp.tokenizer_json = tok.backend_tokenizer.to_str().encode()
    return resp


def load_to_proto(engine_loop, num_queued_extra: int = 0) -> common_pb2.WorkerLoad:
    """Liveness and load; what the worker caches goes to the routers as KV events."""
    s = engine_loop.last_stats
    return common_pb2.WorkerLoad(
        num_queued=s.num_waiting + num_queued_extra, num_running=s.num_running + s.num_waiting_remote,
        num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
        queued_prompt_tokens=s.num_queued_prompt_tokens,
        prefill_tokens_per_s=s.prefill_tokens_per_s, num_decoding=s.num_decoding,
        kv_backends=[common_pb2.KVBackendState(name=b.name, usable=b.usable, detail=b.detail)
                     for b in engine_loop.engine.connector.worker.backend_states()])
