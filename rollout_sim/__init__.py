"""The simulated SGLang engine: SGLang's HTTP behaviour with scripted replies, for demos, tests and benchmarks
without a GPU. It stands beside the service, which never imports it (the demo starts it as a process); of the service
it uses only `rollout_buffer.tokens.tokenizer`, the tokenizer the engine it imitates loads too.

Modules: `contract` (limits, sampling parameters, request bodies), `engine` (the scheduler and `/generate`), `chat`
(`/v1/chat/completions`), `turns` (scripted replies and finish rules, `policy` choosing them), `detokenizer`,
`replies` (answers in SGLang's shapes), `replay` (routed experts, top-p kept ids), `requests` (what the scheduler
holds of a request), `faults`, `info` (`/model_info`, `/server_info`, `/sim/stats`), `server`
(routes and command line), `tool_calls` (SGLang's `--tool-call-parser`).

Token-in-token-out like the real server: the prompt ids are decoded with the real tokenizer, a scripted reply
is chosen (`policy`), encoded with the same tokenizer and closed with the end-of-turn id. `--sglang-version`
picks the release imitated where they differ: `0.5.23` (default) or `0.5.15` (0.5.15.post1, which slime pins).
File references below are to SGLang's sources of those releases.

Imitated (both releases unless said):

- Limits (`tokenizer_manager._validate_one_request`, `scheduler.init_req_max_new_tokens`,
  `managers.utils.validate_input_length`, `tp_worker.get_worker_info`): with context length C, a prompt of
  ≥ C tokens and prompt + `max_new_tokens` > C are refused with HTTP 400 `{"error": {"message"}}` in SGLang's
  wording (streamed: HTTP 200, one `data: {"error": {"message", "type": "invalid_request_error", "code": 400,
  "retryable": false}}` event, then `data: [DONE]`). A prompt of ≥ C - 6 tokens (`max_req_input_len`) passes
  that check but is refused by the scheduler as an abort with `status_code` 400 (below). `max_new_tokens`
  absent from `/generate` means 128 and is not checked against C; `null` (and a chat request without
  `max_tokens`) means unlimited; either way generation stops at C - 2 - prompt tokens (finish `length`).
- Finish rules per token as the scheduler checks them: length first, then stop strings, then stop token ids
  and the end-of-turn id. `output_ids` include the matched stop token; `text` leaves it out (also a
  non-special one such as Qwen3's `</tool_call>`) unless `no_stop_trim`; a matched stop string is cut from
  `text` (kept, and nothing after it, with `no_stop_trim`). Text comes from SGLang's incremental detokenizer
  (`detokenizer_manager`: 5 prompt tokens of context, an incomplete character held back).
- Streaming (`stream: true`, `scheduler_components/output_streamer.accept`): `--stream-interval` N (default
  1) tokens per event, 0.5.15 sending at tokens 1, N+1, 2N+1… and 0.5.23 at the first token then whenever
  N are unsent; an event whose last tokens could begin a stop string is held back (the tokens go with a later
  event). With `incremental_streaming_output` off (default) each event holds the output so far (`text`,
  `output_ids`, `meta_info.output_token_logprobs`); with `--incremental-streaming-output` only the new part.
  `meta_info.completion_tokens` counts the output so far in both. The last event has the finish reason, then
  `data: [DONE]`.
- Aborts: `/abort_request` (rid prefix, or `abort_all`), `/pause_generation` `abort`, `/update_weight_version`
  (which aborts by default: `abort_all_requests` is true unless sent false) and client hang-ups end running
  requests with their output so far and finish `{"type": "abort", "message": "Aborted", "status_code": null,
  "err_type": null}`. A request retracted by `/pause_generation {"mode": "retract"}` sits in the waiting queue:
  aborted there it is answered at once in `tokenizer_manager._handle_abort_req`'s shape (finish
  `{"type": "abort", "message": "Abort in waiting queue"}`, no `prompt_tokens`; streamed, 0.5.15 sends
  `output_ids` = [last token] with cumulative log-probs, 0.5.23 the whole output unless incremental). One held
  in place (`in_place`) is answered when generation continues. Requests sent while paused wait before
  validation, and no abort reaches them.
- Weight loads: `/update_weights_from_disk` loads nothing but answers as SGLang does, and from then on every
  log-prob it answers is that of other weights (the checkpoint's path joins the hash each log-prob is drawn from),
  also when the version is kept (a load without `weight_version`, or one whose cache flush failed). A `model_path`
  that is not a folder fails (400, `success: false`); `abort_all_requests` aborts first; requests still in the
  scheduler (held in place, or aborted and not answered yet) make the cache flush after the load fail (400,
  "Weights were updated, but the cache was not flushed ...") and leave `weight_version` as it was; otherwise
  `weight_version`, when given, becomes the version (200, "Succeeded to update model weights. Weight version
  updated to V.").
- Weight versions: `meta_info.weight_version` is the server's version when the event is built (0.5.15: an
  answer built after a version bump carries the new one). 0.5.23 adds, in the last event,
  `meta_info.weight_versions` = `[{"version", "start", "end"}]` spans of output positions per version
  (`utils/weight_versions.py`), and `weight_version` is then the last span's. 0.5.23's `meta_info` also has,
  as the real server sends them: `input_token_logprobs` (from `logprob_start_len`: empty unless it is given, the
  first prompt token's log-prob None) and `output_token_logprobs_length` with
  log-probs, `cached_tokens_details` (null without cached tokens, as the sim's always are) and `dp_rank` (null).
- Replay (`replay`): with `--enable-return-routed-experts` and `--moe-layers`, `return_routed_experts` from
  `routed_experts_start_len` (SGLang 0.5.23's rows `[start, prompt + output - 1)`, base64 of int32, in a finished
  answer, an aborted running request's included; a start outside the prompt refused as a 400 abort); with
  `--top-p-replay`, the kept ids slime reads for `custom_params.return_top_p_token_ids`.
- Endpoints: `/health` and `/health_generate` run a one-token generation and answer 200 once the engine has
  shown progress since the check began, 503 after `SGLANG_HEALTH_CHECK_TIMEOUT` (20) s without (a long
  pause); `/flush_cache` (GET or POST, `?timeout=`) answers 400 while requests are running or waiting (0.5.23:
  waiting ones are ignored while paused); `/get_weight_version` is 404 (0.5.15: SGLang's deprecation message;
  0.5.23: no such route); `/model_info`, `/server_info` (`context_length` as for a server started with
  `--context-length`, `max_req_input_len`, `max_total_num_tokens`, `version`) with `get_` aliases, `/v1/models`
  (`max_model_len`), `/get_load`.
  0.5.23's JSON contract refuses unknown or mistyped sampling params with 400 `{"error": "unknown field …"}`
  and writes a refused number as Rust does (`got -1.`);
  0.5.15 fails them with a bare 500 (its `SamplingParams` raises TypeError).
- `/v1/chat/completions` (not streamed): errors in OpenAI's shape `{"object": "error", "message", "type",
  "param", "code"}`, tool calls as SGLang's `--tool-call-parser` (`tool_calls`), `metadata.weight_version`
  (0.5.23: and `weight_versions`).

Faults, each at its own rate from a seeded RNG (`--abort-rate`, `--error-rate` over `--error-kinds`), or
queued exactly for the next requests with `POST /sim/faults {"next": [...]}` (sent to each engine directly,
so it works behind a router):

- `abort`: the request is aborted half-way (running-abort finish, partial output).
- `refuse_400`: the scheduler refuses it as too long (`set_finish_with_abort`): non-streamed HTTP 400
  `{"error": {"message": "Input length (N tokens) exceeds the maximum allowed length (M tokens). Use a
  shorter input or enable --allow-auto-truncate."}}`; streamed, one event with finish `{"type": "abort",
  "message", "status_code": 400, "err_type": "BadRequestError"}`, `prompt_tokens` 1 and one junk output token
  (SGLang prefills a 1-token stand-in prompt), then `[DONE]`.
- `refuse_503`: the waiting queue is full (`_abort_on_queued_limit`; a waiting timeout looks the same):
  non-streamed HTTP 503 `{"object": "error", "message": "The request queue is full.", "type": "503",
  "param": null, "code": 503}`; streamed, one `_handle_abort_req` event with finish `{"type": "abort",
  "status_code": 503, "message": "The request queue is full."}`, then `[DONE]`.
- `http_500`, `hang` (longer than any client timeout), `reset` (TCP reset), `truncated_json`: failures of the
  engine or the network, not SGLang answers. `--error-kinds` defaults to these four; the refusals are opt-in.

Not imitated: the prefix cache (`cached_tokens` is 0); batching, queueing and memory (every request runs at
once; `max_running_requests`, `max_queued_requests` and the waiting timeout exist only as the `refuse_503`
fault); the one extra token real SGLang's last decode step appends to an aborted running request; top
log-probs (`top_logprobs_num`); `ignore_eos`, `min_new_tokens`, regex/grammar constraints and `n` > 1; SGLang's
per-request timing fields beyond `e2e_latency`; the ≥ 1 s a healthy real `/health` takes (its first poll is
after a second; the sim answers as soon as it sees progress); 0.5.23 dropped `/get_load` for `/v1/loads`, the
sim serves `/get_load` in both and not `/v1/loads` (tests count its requests with it); real SGLang does not
check input ids against the vocabulary (on the CPU path an id past it ends the server), the sim refuses them
(400), the buffer sends only ids its tokenizer made; `/get_model_info`'s `embedding` block; log-probs of a
model (the sim's are scripted, not those of a distribution at the request's temperature); streamed
`/v1/chat/completions` (400). `tests/test_real_sglang.py` sends the same requests to both and compares the
answers' shapes.

`GET /sim/stats` counts requests by endpoint; `GET /sim/requests` lists the last requests. An aborted turn can
be resumed the way SGLang callers do it, by resending prompt + partial output: the engine remembers recent turns
and continues the same scripted reply, so the concatenation equals the uninterrupted output (per process).
"""
