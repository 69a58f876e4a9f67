#!/usr/bin/python3
"""A test agent for the subprocess sandbox, standard library only (the system Python runs it as `nobody`).

Reads its row from stdin (and checks it equals $ROLLOUT_ITEM_FILE), reports on stderr who and where it runs
(its user, folder, variables and the processes above it), which network interfaces it has, which of
$PROBE_PORTS on 127.0.0.1 it can reach directly and what the buffer answers beyond its session; then, by row
`mode`: `sleep` (past any time limit), `crash` (exit 3), `chatty` (a lot of stdout first), otherwise a
calculator tool loop over $OPENAI_BASE_URL writing its answer to result.json.
"""

import ast
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request


def reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def status_of(url: str, key: str) -> int:
    request = urllib.request.Request(url, headers={"authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def parents() -> list:
    """[pid, program] of the processes above this one, as the machine sees them (/proc/self is this process in
    the machine's PID namespace even inside a sandbox's own)."""
    out, stat_file = [], "/proc/self/stat"
    while len(out) < 6:
        try:
            with open(stat_file) as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                program = f.read().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            break
        if pid <= 1:
            break
        out.append([pid, program])
        stat_file = f"/proc/{pid}/stat"
    return out


def chat(messages: list, tools: list) -> dict:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "tools": tools}).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["choices"][0]["message"]


def main() -> int:
    item = json.load(sys.stdin)
    with open(os.environ["ROLLOUT_ITEM_FILE"]) as f:
        assert json.load(f) == item
    ports = [int(p) for p in os.environ.get("PROBE_PORTS", "").split(",") if p]
    base = os.environ["OPENAI_BASE_URL"]
    report = {"uid": os.getuid(), "cwd": os.getcwd(), "reachable": [p for p in ports if reachable(p)],
              "interfaces": sorted(name for _, name in socket.if_nameindex()),
              "env": sorted(os.environ), "parents": parents(),
              "buffer_status": status_of(base.split("/sessions/")[0] + "/status", os.environ["OPENAI_API_KEY"]),
              "models_with_wrong_key": status_of(base + "/models", "wrong-key")}
    print("REPORT " + json.dumps(report), file=sys.stderr, flush=True)
    if item.get("mode") == "sleep":
        time.sleep(120)
    if item.get("mode") == "chatty":
        print("chatter " * 40000, flush=True)  # 320 kB on stdout, past a small agent_max_output_bytes
    if item.get("mode") == "crash":
        print("boom: the agent crashed on purpose", file=sys.stderr)
        return 3
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    messages = [{"role": "user", "content": item["prompt"]}]
    for _ in range(4):
        message = chat(messages, tools)
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            expression = json.loads(call["function"]["arguments"])["expression"]
            value = eval(compile(ast.parse(expression, mode="eval"), "<calc>", "eval"), {"__builtins__": {}})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(int(value))})
    with open("result.json", "w") as f:
        json.dump({"answer": messages[-1].get("content") or ""}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
