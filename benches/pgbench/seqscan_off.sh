#!/usr/bin/env bash
# What `enable_seqscan = off` on the store's lookup functions costs: function_setting.sh for
# that setting (same options but -s).
set -euo pipefail
exec "$(dirname "$0")/function_setting.sh" -s enable_seqscan "$@"
