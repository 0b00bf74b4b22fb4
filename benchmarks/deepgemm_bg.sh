# Sourced by the device calls that time DeepGEMM (gpu_final.sh, gpu_h200_staged.sh): DeepGEMM 2.8.2 built in the
# background from the carried .deps/deepgemm while other steps run.
#   dg_start LOG   starts the build (its output to LOG) when .deps/deepgemm is there
#   dg_join        waits for it; on success exports PYTHONPATH and LD_PRELOAD for `import deep_gemm`. Sets DG_MSG
#                  to one line saying how it went (empty when no build was started), for the caller's log. Call it
#                  in the calling shell itself (not in $(...)): the wait and the exports must happen there.
DG_PID="" DG_LOG="" DG_MSG=""
dg_start() {
  DG_LOG=$1
  [ -f .deps/deepgemm/deepgemm-build.sh ] || return 0
  ( nice -n 10 bash .deps/deepgemm/deepgemm-build.sh .deps/deepgemm > "$DG_LOG" 2>&1 ) &
  DG_PID=$!
}
dg_join() {
  DG_MSG=""
  [ -n "$DG_PID" ] || return 0
  wait "$DG_PID"; DG_PID=""
  if [ -d /tmp/deepgemm-site ]; then
    export PYTHONPATH=/tmp/deepgemm-site:$PYTHONPATH LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6
    DG_MSG="deepgemm built: $(tail -n 2 "$DG_LOG" | head -n 1)"
  else
    DG_MSG="deepgemm build failed: $(tail -n 3 "$DG_LOG")"
  fi
}
