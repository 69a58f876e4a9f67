#!/bin/sh
# Codex (`codex exec`) as a rollout-buffer `agent_command`, e.g.
#   "agent_command": ["/abs/generators/data/agents/codex.sh"], "agent_env": {"CODEX_BIN": "/abs/bin/codex"}
# The run sets OPENAI_BASE_URL / OPENAI_API_KEY (the row's session) and ROLLOUT_ITEM_FILE (the row); Codex
# speaks the Responses API to the session, runs the row's `prompt` with its shell tool, and prints its final
# answer last, which is the answer. CODEX_BIN: the `codex` executable, else `codex` on PATH.
set -eu
prompt=$(node -e 'process.stdout.write(JSON.parse(require("fs").readFileSync(process.env.ROLLOUT_ITEM_FILE)).prompt)')
# A configuration of its own in the scratch HOME, never a user's ~/.codex.
export CODEX_HOME="$HOME/.codex-home"
mkdir -p "$CODEX_HOME"
cat >"$CODEX_HOME/config.toml" <<TOML
model = "policy"
model_provider = "rollout-buffer"

[model_providers.rollout-buffer]
name = "rollout-buffer"
base_url = "$OPENAI_BASE_URL"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
TOML
# danger-full-access: Codex's own sandbox off, the run's (user, network, scratch folder) is the sandbox. stdin:
# the row again, which Codex would append to the prompt.
exec "${CODEX_BIN:-codex}" exec --skip-git-repo-check --sandbox danger-full-access "$prompt" </dev/null
