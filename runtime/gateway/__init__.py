"""The HTTP gateway: the first and last hop of a request.

In: an OpenAI-compatible (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/models`) or
SGLang-style (`/generate`) HTTP request. The gateway checks the API key, decodes the body into msgspec
Structs (protocol.py), applies the chat template, tokenizes, builds one GenerateRequest per choice and has
the EngineClient validate it — so every bad input ends here as an OpenAI-style 4xx (errors.py) and nothing
below sees an invalid request.

`/v1/responses` (OpenAI's Responses API, openai_responses.py) takes its input items through the same
chat template and tool machinery as chat completions and answers a Response object or its event stream;
it keeps no state (previous_response_id, conversation, background are a 400).

Out: it consumes the EngineClient's RequestOutput deltas, detokenizes them incrementally (stop strings
cut, never a broken UTF-8 character), and answers one JSON body or an SSE stream flushed per delta. A
client that goes away closes the delta streams, which aborts its requests and frees their KV.

Beside the data path: /health, /health_generate, /abort_request, /tokenize and /detokenize (vLLM's),
Prometheus /metrics (metrics.py), whose scheduler gauges and counters come from EngineClient.stats() at
scrape time, and the live status page /dashboard (dashboard.py), polling /dashboard/data every second.

Every generating route runs on one spine (generation.py): read the body, build and validate one
GenerateRequest per choice, admit them, fan their deltas in, answer as the route's Responder writes.

Entry points: app.build_app (the aiohttp Application), server.run_server (blocking `shoal serve`),
server.serve_in_thread (tests, Ray actors)."""
