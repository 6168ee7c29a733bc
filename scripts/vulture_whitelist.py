"""Names vulture reports that are used, each with who uses it: a protocol or framework calls or
reads them (gRPC, pydantic, FastAPI, Prometheus, torch, tokenizers, CUDA), or a caller reads
them by name where vulture cannot see it.

Run by `make lint`: vulture pdserve services scripts/vulture_whitelist.py --min-confidence 60
--exclude pdserve/v1.
"""

# ruff: noqa: B018, F821  (bare names: vulture counts each as a use)

# -- gRPC -----------------------------------------------------------------------------------------

# services/decode/servicer.py: DecodeServicer.PushKV is an RPC of DecodeService (grpc calls it).
PushKV
# services/decode/servicer.py: DecodeServicer.ReadKV is an RPC of DecodeService (grpc calls it).
ReadKV
# services/decode/servicer.py: _HandlerRecorder stands in for a grpc.Server: the generated
# add_DecodeServiceServicer_to_server calls add_registered_method_handlers with grpc's `service`
# argument, though only the handlers are kept.
add_registered_method_handlers
service
# pdserve/rpc/auth.py: grpc.ServerInterceptor.intercept_service (both servers) and the client
# interceptors' intercept_* methods are called by grpc for every call.
intercept_service
intercept_unary_unary
intercept_unary_stream
intercept_stream_unary
intercept_stream_stream

# services/{prefill,decode,mixed}/servicer.py: one instance of a role and its server, outside
# Ray (the instance actor serves every role's service instead): benchmarks/kv_transfer.py,
# benchmarks/serve_load.py and the integration tests' stacks run instances with them.
serve_prefill
serve_decode
serve_mixed

# -- pydantic (services/router/openai_schema.py) -----------------------------------------------

# Each model's configuration (extra fields allowed, ignored or refused) is read by pydantic.
model_config
# Field and model validators: pydantic runs them when a request is parsed.
_bias
_supported
_single_prompt
_calls_parse
_unicode
_chat_supported
_one_input
# OpenAI fields a client may send (the models refuse unknown ones): FunctionDefinition's
# `description` and `strict` reach the chat template through model_dump; ChatMessage's
# `tool_call_id` is read by name (template_message).
description
strict
tool_call_id

# -- FastAPI and uvicorn (services/router) ------------------------------------------------------

# Route and exception handlers are registered by their decorators (app.py); FastAPI.openapi is
# replaced by the app's own schema function; uvicorn.Server.should_exit stops the server
# (server.py).
completions
validation
pdserve_error
openapi
should_exit

# -- others -------------------------------------------------------------------------------------

# pdserve/metrics.py: InstanceCollector.collect is prometheus_client's Collector protocol (the
# registry calls it at every scrape).
collect
# pdserve/model/parallel.py: torch.distributed's options objects (GatherOptions,
# BroadcastOptions, AllreduceOptions, ProcessGroupNCCL.Options) are read by the C++ backend.
rootRank
reduceOp
_timeout
# pdserve/model/tiny.py: a tokenizers.Tokenizer applies its pre_tokenizer and post_processor.
pre_tokenizer
post_processor
# pdserve/transfer/cuda_ipc.py: torch reads __cuda_array_interface__ (the CUDA array interface)
# to view device memory it knows only by address.
__cuda_array_interface__
# Used outside pdserve and services only, where vulture does not look: LLMEngine.kv_plan (how
# the KV cache was sized) is read by name by benchmarks/gpu_check.py's memory report;
# graphs.eager_capture is the graph capture benchmarks/gpu_check.py and the CPU tests run.
kv_plan
eager_capture
# services/router/load.py: Lease.__exit__ has the context-manager protocol's signature.
exc_type
traceback
# pdserve/kvcache/events.py: LoadReport's fields all travel on the KV-event stream (converted by
# name: pdserve.instance.convert.load_to_proto); the router keeps them, no policy weighs them yet.
num_reserved_blocks
predicted_queue_s
