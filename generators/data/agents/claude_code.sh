#!/bin/sh
# Claude Code (`claude -p`) as a rollout-buffer `agent_command`, e.g.
#   "agent_command": ["/abs/generators/data/agents/claude_code.sh"], "agent_env": {"CLAUDE_BIN": "/abs/bin/claude"}
# The run sets ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY (the row's session) and ROLLOUT_ITEM_FILE (the row);
# Claude Code runs the row's `prompt` with its Bash tool, and its final answer, printed last, is the answer.
# CLAUDE_BIN: the `claude` executable, else `claude` on PATH. Node reads the row: npm installed Claude Code with it.
set -eu
prompt=$(node -e 'process.stdout.write(JSON.parse(require("fs").readFileSync(process.env.ROLLOUT_ITEM_FILE)).prompt)')
# No telemetry, update checks or other calls beyond the session (an isolated agent reaches nothing else).
export DISABLE_TELEMETRY=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
# stdin: the row again, which `claude -p` would add to the prompt.
exec "${CLAUDE_BIN:-claude}" -p "$prompt" --allowedTools Bash </dev/null
