#!/usr/bin/env bash
# `dsv4 serve` over real HTTP with curl: endpoints, SSE framing, error bodies and status codes for bad input,
# a client that disconnects mid-stream, 32 concurrent requests, /metrics, SIGTERM. CTest: server.curl.
#   tests/server/curl_test.sh DSV4_BINARY MODEL_DIR
# DSV4_SERVE_ARGS adds flags to the server under test (the GPU check: DSV4_SERVE_ARGS="--device cuda").
set -uo pipefail
DSV4=${1:?usage: curl_test.sh DSV4_BINARY MODEL_DIR}
MODEL=${2:?usage: curl_test.sh DSV4_BINARY MODEL_DIR}
WORK=$(mktemp -d)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then kill -KILL "$SERVER_PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

PASSED=0
FAILED=0
check() {  # check NAME CONDITION...
  local name=$1
  shift
  if "$@"; then
    PASSED=$((PASSED + 1))
  else
    FAILED=$((FAILED + 1))
    echo "FAIL: $name" >&2
  fi
}

# Refusals at startup: a device this build or machine cannot serve on, a missing model.
"$DSV4" serve --model "$MODEL" --port 0 --device tpu >"$WORK/dev.log" 2>&1
check "unknown device: exit 1 with a message" [ $? = 1 ] && check "unknown device message" grep -q -- "--device tpu" "$WORK/dev.log"
"$DSV4" serve --model "$WORK/no-such-model" --port 0 >"$WORK/nomodel.log" 2>&1
check "missing model: exit 1" [ $? = 1 ]

# shellcheck disable=SC2086  # DSV4_SERVE_ARGS is a list of flags
"$DSV4" serve --model "$MODEL" --port 0 --max-batch 8 --max-queue 64 --max-context 4096 ${DSV4_SERVE_ARGS:-} \
  >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 200); do
  grep -q "listening on" "$WORK/server.log" 2>/dev/null && break
  sleep 0.05
done
URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$WORK/server.log" | head -1)
[ -n "$URL" ] || { cat "$WORK/server.log"; echo "FAIL: server did not start"; exit 1; }
NAME=$(basename "$MODEL")
C=(curl -sS --max-time 30)

# request METHOD PATH [BODY]: sets STATUS and BODY.
request() {
  STATUS=$("${C[@]}" -o "$WORK/body" -w '%{http_code}' -X "$1" "$URL$2" ${3+-H 'Content-Type: application/json' --data-binary "$3"})
  BODY=$(cat "$WORK/body")
}
json() { node -e "const j = JSON.parse(require('fs').readFileSync(0, 'utf8')); console.log($1)"; }

# --- endpoints
request GET /health
check "health" [ "$(json 'j.status' <<<"$BODY")" = ok ]
request GET /v1/models
check "models" [ "$(json 'j.data[0].id' <<<"$BODY")" = "$NAME" ]
request POST /v1/chat/completions "{\"model\":\"$NAME\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":5,\"temperature\":0}"
check "chat status" [ "$STATUS" = 200 ]
check "chat usage" [ "$(echo "$BODY" | json 'j.usage.completion_tokens + "/" + j.object')" = "5/chat.completion" ]
request POST /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"Hello\",\"max_tokens\":4,\"temperature\":0}"
check "completion" [ "$(echo "$BODY" | json 'j.choices[0].finish_reason + "/" + j.object')" = "length/text_completion" ]

# --- SSE: every event is "data: <json>" + blank line, the last one is [DONE]
"${C[@]}" -N -D "$WORK/headers" "$URL/v1/chat/completions" -d "{\"model\":\"$NAME\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":6,\"temperature\":0,\"stream\":true}" >"$WORK/sse"
check "sse content type" grep -qi '^content-type: text/event-stream' "$WORK/headers"
check "sse ends with [DONE]" [ "$(grep -v '^$' "$WORK/sse" | tail -1)" = "data: [DONE]" ]
check "sse framing" [ "$(grep -cv '^data: \|^$' "$WORK/sse")" = 0 ]
check "sse chunks parse" node -e "
  const lines = require('fs').readFileSync('$WORK/sse', 'utf8').split('\n').filter(l => l.startsWith('data: {'));
  const chunks = lines.map(l => JSON.parse(l.slice(6)));
  if (chunks[0].choices[0].delta.role !== 'assistant') process.exit(1);
  if (chunks.at(-1).choices[0].finish_reason !== 'length') process.exit(1);
  if (!chunks.every(c => c.object === 'chat.completion.chunk' && c.id === chunks[0].id)) process.exit(1);"

# --- bad input: status and an OpenAI error body (error.message, error.type)
bad() {  # bad NAME EXPECTED_STATUS PATH BODY
  request POST "$3" "$4"
  check "$1: status $STATUS" [ "$STATUS" = "$2" ]
  check "$1: error body" [ "$(echo "$BODY" | json 'typeof j.error.message + typeof j.error.type')" = stringstring ]
}
bad "malformed JSON" 400 /v1/chat/completions '{"model": "x", "messages": [ '
bad "not an object" 400 /v1/chat/completions '[1, 2, 3]'
bad "empty body" 400 /v1/completions ''
bad "unknown field" 400 /v1/chat/completions "{\"model\":\"$NAME\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"frobnicate\":1}"
bad "missing messages" 400 /v1/chat/completions "{\"model\":\"$NAME\"}"
bad "missing prompt" 400 /v1/completions "{\"model\":\"$NAME\"}"
bad "negative max_tokens" 400 /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"x\",\"max_tokens\":-1}"
bad "absurd max_tokens" 400 /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"x\",\"max_tokens\":99999999999999999999}"
bad "absurd temperature" 400 /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"x\",\"temperature\":1e308}"
bad "string temperature" 400 /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"x\",\"temperature\":\"warm\"}"
bad "unknown model" 404 /v1/completions '{"model":"nope","prompt":"x"}'
LONG=$(head -c 30000 /dev/zero | tr '\0' 'a' | sed 's/a\{5\}/word /g')
bad "prompt over the context" 400 /v1/completions "{\"model\":\"$NAME\",\"prompt\":\"$LONG\"}"
bad "invalid UTF-8" 400 /v1/completions "$(printf '{"model":"%s","prompt":"\xff\xfe"}' "$NAME")"
request GET /v1/nothing-here
check "unknown route 404" [ "$STATUS" = 404 ]
head -c 9000000 /dev/zero | tr '\0' ' ' >"$WORK/huge"
STATUS=$("${C[@]}" -o /dev/null -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' --data-binary @"$WORK/huge")
check "body too large 413 ($STATUS)" [ "$STATUS" = 413 ]
request GET /health
# A JSON body over 8 KB sent as curl -d's default form Content-Type is still read as JSON.
BIG=$(head -c 12000 /dev/zero | tr '\0' 'a' | sed 's/a\{6\}/tok a /g')
STATUS=$("${C[@]}" -o "$WORK/body" -w '%{http_code}' "$URL/v1/completions" -d "{\"model\":\"$NAME\",\"prompt\":\"${BIG:0:1500}\",\"max_tokens\":1,\"junk\":\"$BIG\"}")
check "large form-typed JSON body is parsed ($STATUS)" grep -q 'Unrecognized request argument supplied: junk' "$WORK/body"
check "alive after bad input" [ "$(json 'j.status' <<<"$BODY")" = ok ]

# --- a client that disconnects mid-stream frees its slot (1 s: long enough to be admitted on a loaded machine,
# far shorter than the 4000 tokens take)
"${C[@]}" -N --max-time 1 "$URL/v1/completions" -d "{\"model\":\"$NAME\",\"prompt\":\"x\",\"max_tokens\":4000,\"ignore_eos\":true,\"stream\":true}" >/dev/null 2>&1
for _ in $(seq 100); do
  request GET /metrics
  M=$BODY
  echo "$M" | grep -q '^dsv4_running_sequences 0$' && echo "$M" | grep -q 'reason="cancelled"} [1-9]' && break
  sleep 0.05
done
check "disconnect frees the slot" grep -q '^dsv4_running_sequences 0$' <<<"$M"
check "disconnect counted as cancelled" grep -q 'dsv4_requests_finished_total{reason="cancelled"} 1$' <<<"$M"
# ... and so does one that gives up waiting for a non-streamed answer
"${C[@]}" --max-time 1 "$URL/v1/completions" -d "{\"model\":\"$NAME\",\"prompt\":\"x\",\"max_tokens\":4000,\"ignore_eos\":true}" >/dev/null 2>&1
for _ in $(seq 100); do
  request GET /metrics
  M=$BODY
  echo "$M" | grep -q '^dsv4_running_sequences 0$' && echo "$M" | grep -q 'reason="cancelled"} 2$' && break
  sleep 0.05
done
check "non-streamed disconnect frees the slot" grep -q 'dsv4_requests_finished_total{reason="cancelled"} 2$' <<<"$M"

# --- 32 concurrent requests, half streamed
for i in $(seq 32); do
  stream=$([ $((i % 2)) = 0 ] && echo true || echo false)
  "${C[@]}" -o "$WORK/c$i" -w '%{http_code}' "$URL/v1/completions" \
    -d "{\"model\":\"$NAME\",\"prompt\":\"client $i\",\"max_tokens\":8,\"temperature\":0,\"stream\":$stream}" >"$WORK/s$i" &
done
wait $(jobs -p | grep -v "^$SERVER_PID$") 2>/dev/null
OK=0
for i in $(seq 32); do [ "$(cat "$WORK/s$i")" = 200 ] && OK=$((OK + 1)); done
check "32 concurrent all 200 ($OK)" [ "$OK" = 32 ]

# --- /metrics in Prometheus text format
request GET /metrics
M=$BODY
for metric in dsv4_http_responses_total dsv4_generation_tokens_total dsv4_prompt_tokens_total dsv4_queue_length \
  dsv4_time_to_first_token_seconds_bucket dsv4_inter_token_latency_seconds_count dsv4_requests_finished_total; do
  check "metric $metric" grep -q "^$metric" <<<"$M"
done
check "metrics TYPE lines" [ "$(grep -c '^# TYPE ' <<<"$M")" -ge 10 ]
check "metrics lines well-formed" [ "$(grep -v '^#' <<<"$M" | grep -cvE '^[a-z_][a-z0-9_]*(\{[^}]*\})? [0-9.e+-]+$')" = 0 ]

# --- SIGTERM: clean exit
kill -TERM "$SERVER_PID"
for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.05; done
wait "$SERVER_PID"
RC=$?
check "SIGTERM exit code 0 ($RC)" [ "$RC" = 0 ]
SERVER_PID=""

echo "$PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
