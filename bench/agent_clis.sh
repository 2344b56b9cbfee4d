#!/bin/bash
# Codex CLI and Claude Code, each given a small file task, against `mlxspec serve` (offline).
#
#   bash bench/agent_clis.sh [MODEL] [PORT]      # default qwen2.5-coder-1.5b, 8790
#
# Needs `codex` and `claude` (npm install -g @openai/codex @anthropic-ai/claude-code). Each
# client works in a scratch folder holding greet.py and must change its printed text; the
# script says whether each did. The clients are configured as docs/SERVER.md ("Coding agents")
# says for a small model on a CPU: Codex with short instructions (`model_instructions_file`)
# and its optional tools off, Claude Code with `--bare` and three tools, both with timeouts
# long enough for a first prefill here.
set -u
MODEL=${1:-qwen2.5-coder-1.5b}
PORT=${2:-8790}
WORK=$(mktemp -d)
TASK='In greet.py, change the printed text from "hello world" to "hello mlxspec".'
mkdir -p "$WORK/codex" "$WORK/claude" "$WORK/codex_home"
for d in codex claude; do
    printf 'def greet():\n    print("hello world")\n\n\ngreet()\n' > "$WORK/$d/greet.py"
done
cat > "$WORK/instructions.md" <<'EOT'
You are a coding agent on the user's machine. To read or change files, call the function exec_command with one argument, cmd: the shell command to run (for example sed -i to replace text in a file). Give no other arguments. After the command has run, say in one sentence what you did.
EOT
cat > "$WORK/codex_home/config.toml" <<EOT
model = "$MODEL"
model_provider = "mlxspec"
model_instructions_file = "$WORK/instructions.md"
include_environment_context = false
web_search = "disabled"

[model_providers.mlxspec]
name = "mlxspec"
base_url = "http://127.0.0.1:$PORT/v1"
wire_api = "responses"
stream_idle_timeout_ms = 3600000
EOT

mlxspec serve -m "$MODEL" --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 2
done

start=$(date +%s)
(cd "$WORK/codex" && CODEX_HOME="$WORK/codex_home" OPENAI_API_KEY=local timeout 2400 \
    codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox \
    --disable multi_agent --disable goals --disable skill_search --disable view_image \
    --disable image_generation "$TASK" > ../codex.out 2> ../codex.err)
echo "codex: exit $?, $(( $(date +%s) - start )) s, $(grep -c 'hello mlxspec' "$WORK/codex/greet.py") change(s)"

start=$(date +%s)
(cd "$WORK/claude" && ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=local \
    API_TIMEOUT_MS=3600000 timeout 2400 claude -p "$TASK" --model "$MODEL" --bare \
    --tools Read Edit Bash --permission-mode acceptEdits --allowedTools Read Edit Bash \
    > ../claude.out 2> ../claude.err)
echo "claude: exit $?, $(( $(date +%s) - start )) s, $(grep -c 'hello mlxspec' "$WORK/claude/greet.py") change(s)"
echo "transcripts and the server's log: $WORK"
