"""Structured output on the Ray path, TP=2: the grammar mask travels inside the WorkerBatch that rank 0
broadcasts, so both ranks mask, and sample, alike — the constrained outputs equal the in-process
TP=1 Engine's, token for token, beside unconstrained ones; the client compiles each new grammar in the
driver, so a bad one is an InvalidRequestError before any actor call."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from ray_helpers import run_all

from runtime.config import ServerArgs
from runtime.errors import InvalidRequestError
from runtime.messages import GenerateRequest
from runtime.sampling.params import SamplingParams

pytestmark = pytest.mark.ray
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "tags"]}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43], [300, 12, 99], [17, 18]]


def _params(i: int) -> dict:
    p = {"max_new_tokens": 60, "temperature": 1.0, "seed": i}
    return p | ({"json_schema": json.dumps(SCHEMA)} if i % 2 == 0 else {"regex": "[a-z]{3,9}!"} if i == 1 else {})


def test_tp2_grammar_matches_tp1(ray_local, tiny_llama):
    from runtime import Engine
    from runtime.cluster.launch import create_ray_engine_client

    with Engine(str(tiny_llama), device="cpu", max_total_tokens=2048) as engine:
        expected = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=[_params(i) for i in range(4)])]
        tokenizer = engine.tokenizer
    client = create_ray_engine_client(ServerArgs(model_path=str(tiny_llama), tp_size=2, device="cpu",
                                                 max_total_tokens=2048))
    try:
        reqs = [GenerateRequest(rid=f"g-{i}", input_ids=p, sampling_params=SamplingParams.from_dict(_params(i)))
                for i, p in enumerate(PROMPTS)]
        results = run_all(client, reqs)
        assert [ids for ids, _ in results] == expected
        for i in (0, 2):
            jsonschema.validate(json.loads(tokenizer.decode(results[i][0])), SCHEMA)
        bad = GenerateRequest(rid="bad", input_ids=[5], sampling_params=SamplingParams(json_schema='{"type": "objec"}'))
        with pytest.raises(InvalidRequestError) as e:
            asyncio.run(client.check_grammar(bad))
        assert e.value.param == "json_schema"
    finally:
        client.shutdown()
