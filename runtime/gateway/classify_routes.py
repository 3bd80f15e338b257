"""POST /classify (and SGLang's /v1/classify) on a server of a *ForSequenceClassification model (a reward
model or classifier, served with --is-embedding). vLLM's form: `input` (a string, strings, token ids or
lists of them) or `messages`, answered {"data": [{"index", "label", "probs", "num_classes"}], "usage"},
probs being vLLM's activation of the score head's logits (softmax over several labels, sigmoid of one;
raw with use_activation false) and label id2label's name of the most probable class. SGLang's /classify
takes its embedding body (`text` / `input_ids`) and answers as /encode does, with the raw logits as the
embedding: a body with those fields gets that answer. Admitted, tracked and counted as /v1/embeddings is.
Elsewhere a 400 naming `model`: on a generation server, or an embedding server without a score head."""

from __future__ import annotations

import time

from aiohttp import web
from msgspec import UNSET

from runtime.gateway import native_routes
from runtime.gateway.body import read_body
from runtime.gateway.embeddings_protocol import (
    ClassificationData,
    ClassificationResponse,
    ClassificationUsage,
    ClassifyRequest,
)
from runtime.gateway.errors import bad_request
from runtime.gateway.openai_embeddings import embedding_requests, run_admitted, token_inputs
from runtime.gateway.protocol import encode
from runtime.gateway.state import STATE_KEY
from runtime.text.embedding_request import truncate_tokens
from runtime.text.pooling_config import require_classifier


async def classify(request: web.Request) -> web.Response:
    arrival = time.monotonic()
    body = await read_body(request, ClassifyRequest)
    state = request.app[STATE_KEY]
    client = state.client()
    model = state.check_model(client, body.model)
    pooling = require_classifier(client.pooling)
    sglang = body.text is not None or body.input_ids is not None
    if sglang and (body.input is not UNSET or body.messages is not UNSET):
        raise bad_request("give input (or messages), vLLM's form, or text / input_ids, SGLang's; not both",
                          param="input")
    if sglang and body.request_id is not None:  # /encode's answer is named by SGLang's rid, never request_id
        raise bad_request("request_id goes with input / messages, vLLM's form; SGLang's names its request by rid",
                          param="request_id")
    if sglang:
        return await native_routes.encode_request(request)  # reads the same body as SGLang's EncodeRequest
    for name, value in (("dimensions", body.dimensions), ("encoding_format", body.encoding_format),
                        ("normalize", body.normalize)):
        if value is not None:
            raise bad_request(f"{name} applies to /v1/embeddings, not to classification", param=name)
    if body.use_activation is not None and body.activation is not None and body.use_activation != body.activation:
        raise bad_request("use_activation and activation (its older name) disagree", param="use_activation")
    activate = next((v for v in (body.use_activation, body.activation) if v is not None), pooling.use_activation)
    ids = [truncate_tokens(x, body.truncate_prompt_tokens, client.context_len)
           for x in await token_inputs(state, client, body, request)]
    base = state.new_id("classify", request_id=body.request_id)
    reqs = embedding_requests(client, [f"{base}-{i}" for i in range(len(ids))], ids, cache_salt=body.cache_salt)
    all_logits = await run_admitted(state, client, base, reqs, arrival)
    data = []
    for i, logits in enumerate(all_logits):
        probs = pooling.probabilities(logits) if activate else logits
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=i, label=pooling.labels[best], probs=probs, num_classes=len(probs)))
    tokens = sum(len(r.input_ids) for r in reqs)
    out = ClassificationResponse(id=base, created=int(time.time()), model=model, data=data,
                                 usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))
    return web.Response(body=encode(out), content_type="application/json")
