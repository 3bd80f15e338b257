"""Text processing, beside the data path rather than on it: the tokenizer (encode, chat template),
incremental detokenization with stop strings, the chat-template override, and the accumulators that fold
a request's deltas into an answer (OutputAccumulator; ResultCollector, the Python API's dict). The gateway
tokenizes requests and detokenizes deltas with it, the in-process Engine does the same for its Python
API, and the scheduler uses the shared stop-string check; nothing here imports anything of runtime but
errors and messages."""
